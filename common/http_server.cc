#include "common/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <malloc.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"

namespace dd::http {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kTickMs = 100;  // timeouts and hang-ups are noticed within this

std::string PeerAddress(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(ss).sin_addr, buf, sizeof(buf));
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr, buf, sizeof(buf));
  }
  return buf;
}

// A short response sent without blocking before a connection is closed by the loop.
void SendAndForget(int fd, const Refusal& r) {
  const std::string text = absl::StrCat("HTTP/1.1 ", r.status, " ", StatusText(r.status), "\r\nContent-Type: ",
                                        r.content_type, "\r\nContent-Length: ", r.body.size(),
                                        "\r\nConnection: close\r\n\r\n", r.body);
  (void)!send(fd, text.data(), text.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

void SendAndForget(int fd, int status, absl::string_view message) {
  SendAndForget(fd, Refusal{status, "text/plain", absl::StrCat(message, "\n")});
}

// Bodies of at least this size leave the allocator holding memory worth giving back.
constexpr int64_t kTrimBytes = 1 << 20;

}  // namespace

absl::string_view StatusText(int status) {
  switch (status) {
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    default: return "Unknown";
  }
}

const std::string* Request::Header(absl::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (absl::EqualsIgnoreCase(k, name)) return &v;
  }
  return nullptr;
}

bool Connection::Write(absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      if (poll(&p, 1, static_cast<int>(write_timeout_ms_)) > 0 && (p.revents & POLLOUT) != 0) continue;
    }
    return false;  // gone, reset, or no progress within the write timeout
  }
  return true;
}

// The callback runs under mu_, so once OnHangup(nullptr) returns it is not running and will not
// run: the handler may then destroy what it touches.
void Connection::OnHangup(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  if (hung_up_.load()) {
    if (fn) fn();
    return;
  }
  on_hangup_ = std::move(fn);
}

void Connection::HangUp() {
  std::lock_guard<std::mutex> lock(mu_);
  if (hung_up_.exchange(true)) return;
  if (on_hangup_) on_hangup_();
  on_hangup_ = nullptr;
}

struct Server::State {
  enum class Phase { kReading, kDraining, kQueued, kHandling };
  struct Conn {
    int fd = -1;
    std::string peer;
    Clock::time_point deadline;
    Phase phase = Phase::kReading;
    std::string buf;
    size_t header_end = 0;  // bytes of the request line and headers, once complete
    int64_t content_length = 0;
    int64_t reserved = 0;   // body bytes counted against max_buffered_body_bytes until closed
    Request request;
    std::shared_ptr<Connection> connection;  // from dispatch on
  };

  ServerOptions options;
  Handler handler;
  HeadCheck check_head;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  std::thread loop;
  std::vector<std::thread> workers;

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::map<int, std::shared_ptr<Conn>> conns;  // by descriptor
  std::map<std::string, int> per_client;
  std::deque<std::shared_ptr<Conn>> queue;
  int busy = 0;  // handlers running
  int64_t buffered = 0;  // the connections' reserved body bytes
  std::atomic<bool> trim_pending{false};  // a large body was freed: give memory back (Sweep)
  Clock::time_point accept_paused_until{};

  ~State() {
    for (int fd : {listen_fd, epoll_fd, wake_fd}) {
      if (fd >= 0) close(fd);
    }
  }

  // Closes and forgets `c` (mu held).
  void CloseLocked(std::shared_ptr<Conn> c) {  // a copy: `c` may be the map's own entry
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c->fd, nullptr);
    close(c->fd);
    conns.erase(c->fd);
    if (auto it = per_client.find(c->peer); it != per_client.end() && --it->second <= 0) per_client.erase(it);
    buffered -= c->reserved;
    c->reserved = 0;
  }

  // Makes room for one more connection when the table is full: closes the oldest connection
  // that has not sent a complete request (or is being refused), from the address holding the
  // most of those. False when every connection has a request queued or being handled (mu held).
  bool EvictIncompleteLocked() {
    struct Peer {
      int incomplete = 0;
      const std::shared_ptr<Conn>* oldest = nullptr;
    };
    absl::flat_hash_map<absl::string_view, Peer> peers;  // one pass over the table
    absl::string_view top;
    int most = 0;
    for (const auto& [fd, c] : conns) {
      if (c->phase != Phase::kReading && c->phase != Phase::kDraining) continue;
      Peer& p = peers[c->peer];
      ++p.incomplete;
      if (p.oldest == nullptr || c->deadline < (*p.oldest)->deadline) p.oldest = &c;  // conns' nodes stay put
      if (p.incomplete > most) top = c->peer, most = p.incomplete;
    }
    if (most == 0) return false;
    const std::shared_ptr<Conn> oldest = *peers[top].oldest;  // a copy: CloseLocked erases the entry
    if (oldest->phase == Phase::kReading) SendAndForget(oldest->fd, 503, "connection closed to make room for others");
    CloseLocked(oldest);
    return true;
  }

  void Accept() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop polling the listener for a tick rather than spin on it.
          LOG_EVERY_N(WARNING, 100) << options.name << ": accept: " << std::strerror(errno);
          epoll_event ev{};
          epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
          accept_paused_until = Clock::now() + std::chrono::milliseconds(kTickMs);
        }
        return;
      }
      auto c = std::make_shared<Conn>();
      c->fd = fd;
      c->peer = PeerAddress(ss);
      c->deadline = Clock::now() + std::chrono::milliseconds(options.request_timeout_ms);
      std::lock_guard<std::mutex> lock(mu);
      if (per_client[c->peer] >= options.max_per_client ||
          (static_cast<int>(conns.size()) >= options.max_connections && !EvictIncompleteLocked())) {
        SendAndForget(fd, 503, "too many connections");
        close(fd);
        if (per_client[c->peer] == 0) per_client.erase(c->peer);
        continue;
      }
      ++per_client[c->peer];
      conns[fd] = c;
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = fd;
      epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev);
    }
  }

  // Parses the request line and headers of c->buf[0, header_end); an HTTP status on error.
  int ParseHead(Conn& c) {
    const absl::string_view head(c.buf.data(), c.header_end - 4);
    std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
    const std::vector<absl::string_view> first = absl::StrSplit(lines[0], ' ');
    if (first.size() != 3 || first[0].empty() || first[1].empty() || !absl::StartsWith(first[2], "HTTP/1.")) {
      return 400;
    }
    Request& r = c.request;
    r.method = std::string(first[0]);
    r.target = std::string(first[1]);
    r.path = r.target.substr(0, r.target.find('?'));
    r.peer = c.peer;
    bool has_length = false;
    for (size_t i = 1; i < lines.size(); ++i) {
      const absl::string_view line = lines[i];
      const size_t colon = line.find(':');
      if (colon == absl::string_view::npos || colon == 0 || line[0] == ' ' || line[0] == '\t') return 400;
      std::string name = absl::AsciiStrToLower(line.substr(0, colon));
      std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
      if (name == "transfer-encoding") return 501;
      if (name == "content-length") {
        int64_t n = 0;
        if (!absl::SimpleAtoi(value, &n) || n < 0 || (has_length && n != c.content_length)) return 400;
        has_length = true;
        c.content_length = n;
      }
      r.headers.emplace_back(std::move(name), std::move(value));
    }
    if (c.content_length > options.max_body_bytes) return 413;
    return 0;
  }

  void Read(const std::shared_ptr<Conn>& c) {
    char buf[16384];
    for (;;) {
      const ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
      if (n > 0 && c->phase == Phase::kDraining) continue;  // discarded
      if (n > 0) {
        c->buf.append(buf, static_cast<size_t>(n));
        if (c->header_end == 0) {
          const size_t end = c->buf.find("\r\n\r\n");
          if (end == std::string::npos) {
            if (static_cast<int64_t>(c->buf.size()) > options.max_header_bytes) return Refuse(c, 431, "headers too large");
            continue;
          }
          if (static_cast<int64_t>(end) + 4 > options.max_header_bytes) return Refuse(c, 431, "headers too large");
          c->header_end = end + 4;
          if (const int status = ParseHead(*c); status != 0) {
            return Refuse(c, status, status == 413 ? absl::StrCat("request body above ", options.max_body_bytes, " bytes")
                                                   : std::string(StatusText(status)));
          }
          if (check_head) {
            if (std::optional<Refusal> r = check_head(c->request)) return Refuse(c, *r);
          }
          if (!Reserve(*c)) {
            return Refuse(c, 503, "busy: too many request bodies are being received; retry later");
          }
        }
        if (static_cast<int64_t>(c->buf.size()) >= static_cast<int64_t>(c->header_end) + c->content_length) {
          return Dispatch(c);
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      std::lock_guard<std::mutex> lock(mu);  // closed by the client or an error, before a complete request
      CloseLocked(c);
      return;
    }
  }

  // Answers `status` and closes once the client has stopped sending (or after a second), so
  // that a client still sending its body reads the answer instead of a reset.
  void Refuse(const std::shared_ptr<Conn>& c, int status, absl::string_view why) {
    Refuse(c, Refusal{status, "text/plain", absl::StrCat(why, "\n")});
  }
  void Refuse(const std::shared_ptr<Conn>& c, const Refusal& r) {
    SendAndForget(c->fd, r);
    shutdown(c->fd, SHUT_WR);
    std::string().swap(c->buf);
    std::lock_guard<std::mutex> lock(mu);
    c->phase = Phase::kDraining;
    c->deadline = Clock::now() + std::chrono::seconds(1);
    buffered -= c->reserved;
    c->reserved = 0;
  }

  // Counts the announced body against the server-wide budget before any of it is kept.
  bool Reserve(Conn& c) {
    std::lock_guard<std::mutex> lock(mu);
    if (c.content_length > 0 && buffered + c.content_length > options.max_buffered_body_bytes) return false;
    c.reserved = c.content_length;
    buffered += c.reserved;
    return true;
  }

  void Dispatch(const std::shared_ptr<Conn>& c) {
    c->request.body = c->buf.substr(c->header_end, static_cast<size_t>(c->content_length));
    std::string().swap(c->buf);
    c->connection.reset(new Connection(c->fd, std::move(c->request), options.write_timeout_ms));
    // From now on the loop only watches for the client hanging up.
    epoll_event ev{};
    ev.events = EPOLLRDHUP;
    ev.data.fd = c->fd;
    std::lock_guard<std::mutex> lock(mu);
    if (static_cast<int>(queue.size()) + busy >= options.threads + options.queue) {
      SendAndForget(c->fd, 503, "busy: every handler is taken and the queue is full");
      CloseLocked(c);
      return;
    }
    epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c->fd, &ev);
    c->phase = Phase::kQueued;
    queue.push_back(c);
    cv.notify_one();
  }

  void Loop() {
    std::vector<epoll_event> events(256);
    for (;;) {
      const int n = epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), kTickMs);
      {
        std::lock_guard<std::mutex> lock(mu);
        if (stopping) return;
      }
      for (int i = 0; i < n; ++i) {
        const int fd = events[i].data.fd;
        if (fd == listen_fd) {
          Accept();
          continue;
        }
        if (fd == wake_fd) continue;
        std::shared_ptr<Conn> c;
        bool reading = false;
        {
          std::lock_guard<std::mutex> lock(mu);
          auto it = conns.find(fd);
          if (it == conns.end()) continue;
          c = it->second;
          reading = c->phase == Phase::kReading || c->phase == Phase::kDraining;
          if (!reading) {
            // Handled or queued: only a hang-up is of interest, and only once.
            epoll_ctl(epoll_fd, EPOLL_CTL_DEL, fd, nullptr);
          }
        }
        if (reading) {
          Read(c);
        } else {
          c->connection->HangUp();
        }
      }
      Sweep();
    }
  }

  // Closes connections whose request did not arrive in time; resumes accepting after a pause.
  void Sweep() {
    // Large bodies and the parsed documents made of them go back to the system, so that a burst
    // of refused or served large requests does not leave the process holding their memory.
    if (trim_pending.exchange(false)) malloc_trim(0);
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(mu);
    if (accept_paused_until != Clock::time_point{} && now >= accept_paused_until) {
      accept_paused_until = {};
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = listen_fd;
      epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
    }
    std::vector<std::shared_ptr<Conn>> late;
    for (const auto& [fd, c] : conns) {
      if ((c->phase == Phase::kReading || c->phase == Phase::kDraining) && now >= c->deadline) late.push_back(c);
    }
    for (const auto& c : late) {
      if (c->phase == Phase::kReading) SendAndForget(c->fd, 408, "the request did not arrive in time");
      CloseLocked(c);
    }
  }

  void Work() {
    for (;;) {
      std::shared_ptr<Conn> c;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping
        c = queue.front();
        queue.pop_front();
        c->phase = Phase::kHandling;
        ++busy;
      }
      if (!c->connection->hung_up()) handler(*c->connection);
      c->connection->OnHangup(nullptr);
      const bool large = c->reserved >= kTrimBytes;
      {
        std::lock_guard<std::mutex> lock(mu);
        --busy;
        CloseLocked(c);
      }
      c.reset();  // the body goes with the last reference
      if (large) trim_pending = true;
    }
  }
};

Server::Server(std::unique_ptr<State> state) : state_(std::move(state)) {}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options, Handler handler,
                                                     HeadCheck check_head) {
  if (options.threads <= 0 || options.queue < 0 || options.max_connections <= 0 || options.max_per_client <= 0 ||
      options.request_timeout_ms <= 0 || options.write_timeout_ms <= 0 || options.max_header_bytes <= 0 ||
      options.max_body_bytes < 0 || options.max_buffered_body_bytes < options.max_body_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.name, ": every limit must be positive, and the bodies buffered at once at least one largest body"));
  }
  const size_t colon = options.listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(options.name, ": listen address '", options.listen,
                                                   "' is not HOST:PORT"));
  }
  std::string host = options.listen.substr(0, colon);
  const std::string port = options.listen.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port_number = -1;
  if (!absl::SimpleAtoi(port, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(options.name, ": bad port in listen address '", options.listen, "'"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* ai = nullptr;
  if (const int rc = getaddrinfo(host.empty() ? "0.0.0.0" : host.c_str(), port.c_str(), &hints, &ai); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": cannot resolve '", options.listen, "': ", gai_strerror(rc)));
  }
  // Connections are descriptors: let the process use as many as it is allowed (the soft limit is
  // often 1024 against a hard one of tens of thousands).
  if (rlimit rl{}; getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  auto state = std::make_unique<State>();
  state->options = options;
  state->handler = std::move(handler);
  state->check_head = std::move(check_head);
  std::string error = "no address";
  for (addrinfo* a = ai; a != nullptr && state->listen_fd < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      state->listen_fd = fd;
    } else {
      error = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(ai);
  if (state->listen_fd < 0) {
    return absl::UnavailableError(absl::StrCat(options.name, " cannot listen on ", options.listen, ": ", error));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(state->listen_fd, reinterpret_cast<sockaddr*>(&ss), &len);
  const int bound = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6&>(ss).sin6_port
                                                   : reinterpret_cast<sockaddr_in&>(ss).sin_port);
  state->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  state->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (state->epoll_fd < 0 || state->wake_fd < 0) {
    return absl::UnavailableError(absl::StrCat(options.name, ": epoll: ", std::strerror(errno)));
  }
  for (int fd : {state->listen_fd, state->wake_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    epoll_ctl(state->epoll_fd, EPOLL_CTL_ADD, fd, &ev);
  }
  State* s = state.get();
  s->loop = std::thread([s] { s->Loop(); });
  for (int i = 0; i < options.threads; ++i) s->workers.emplace_back([s] { s->Work(); });
  std::unique_ptr<Server> server(new Server(std::move(state)));
  server->port_ = bound;
  return server;
}

Server::~Server() {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stopping = true;
    // Requests not yet handled are dropped; running handlers finish.
    for (const auto& c : s.queue) s.CloseLocked(c);
    s.queue.clear();
  }
  const uint64_t one = 1;
  (void)!write(s.wake_fd, &one, sizeof(one));
  s.cv.notify_all();
  s.loop.join();
  for (std::thread& t : s.workers) t.join();
  std::lock_guard<std::mutex> lock(s.mu);
  while (!s.conns.empty()) s.CloseLocked(s.conns.begin()->second);
}

}  // namespace dd::http
