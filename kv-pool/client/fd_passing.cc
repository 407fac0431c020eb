#include "kv-pool/client/fd_passing.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace dd::kvpool {
namespace {

constexpr size_t kMaxTokenBytes = 512;

absl::StatusOr<sockaddr_un> Address(const std::string& address, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const bool abstract = !address.empty() && address[0] == '@';
  if (address.size() >= sizeof(a.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("unix socket address too long: ", address));
  }
  std::memcpy(a.sun_path, address.data(), address.size());
  if (abstract) a.sun_path[0] = '\0';
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() + (abstract ? 0 : 1));
  return a;
}

// A one-byte message with room for one descriptor (SCM_RIGHTS), for sendmsg and recvmsg.
struct FdMessage {
  char byte = 'K';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

void SetTimeouts(int fd, int seconds) {
  timeval tv{seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}


}  // namespace

absl::StatusOr<std::unique_ptr<FdServer>> FdServer::Start(const std::string& path, Lookup lookup,
                                                         std::vector<uint32_t> allowed_uids) {
  std::unique_ptr<FdServer> s(new FdServer());
  s->lookup_ = std::move(lookup);
  s->allowed_uids_ = std::move(allowed_uids);
  s->address_ = path.empty() ? absl::StrCat("@dd-kvpool-", getpid(), "-", RandomHex()) : path;
  if (!path.empty()) s->path_ = path;
  socklen_t len = 0;
  auto addr = Address(s->address_, &len);
  if (!addr.ok()) return addr.status();
  // Non-blocking: the serving loop accepts until the backlog is empty.
  s->listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s->listen_fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  if (!s->path_.empty()) unlink(s->path_.c_str());  // a socket file left by an earlier pool
  if (bind(s->listen_fd_, reinterpret_cast<const sockaddr*>(&*addr), len) != 0 || listen(s->listen_fd_, 64) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on unix socket ", s->address_, ": ", std::strerror(errno)));
  }
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (s->wake_fd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  s->thread_ = std::thread([p = s.get()] { p->Serve(); });
  return s;
}

FdServer::~FdServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (!path_.empty()) unlink(path_.c_str());
}

namespace {

// One connection being read: its token so far and when it must be complete.
struct Client {
  int fd = -1;
  std::string token;
  std::chrono::steady_clock::time_point deadline;
};

void SendFd(int c, int fd) {
  FdMessage m;
  msghdr& msg = m.msg;
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  (void)sendmsg(c, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);  // one byte: fits any socket buffer
}

}  // namespace

void FdServer::Serve() {
  using Clock = std::chrono::steady_clock;
  constexpr auto kClientTime = std::chrono::seconds(2);
  std::vector<Client> clients;
  std::vector<pollfd> fds;
  // Accepting pauses briefly when it fails for want of descriptors (EMFILE): the pending
  // connection would otherwise keep the listening socket readable and the loop spinning.
  Clock::time_point accept_paused_until{};
  for (;;) {
    const bool accepting = Clock::now() >= accept_paused_until;
    fds.assign({{accepting ? listen_fd_ : -1, POLLIN, 0}, {wake_fd_, POLLIN, 0}});
    Clock::time_point next = accepting ? Clock::time_point::max() : accept_paused_until;
    for (const Client& cl : clients) {
      fds.push_back({cl.fd, POLLIN, 0});
      next = std::min(next, cl.deadline);
    }
    int timeout_ms = -1;
    if (next != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
      timeout_ms = static_cast<int>(std::max<int64_t>(0, left) + 1);
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) break;
    const Clock::time_point now = Clock::now();
    // Existing clients first (their entries follow the two fixed ones, in order).
    std::vector<Client> kept;
    for (size_t i = 0; i < clients.size(); ++i) {
      Client& cl = clients[i];
      bool done = false;
      if (fds[2 + i].revents != 0) {
        char buf[128];
        const ssize_t n = read(cl.fd, buf, sizeof(buf));
        if (n <= 0 && !(n < 0 && (errno == EAGAIN || errno == EINTR))) {
          done = true;  // closed or failed
        } else if (n > 0) {
          cl.token.append(buf, static_cast<size_t>(n));
          if (cl.token.size() > kMaxTokenBytes) {
            done = true;
          } else if (const size_t nl = cl.token.find('\n'); nl != std::string::npos) {
            const int fd = lookup_(absl::string_view(cl.token).substr(0, nl));
            if (fd >= 0) SendFd(cl.fd, fd);
            done = true;
          }
        }
      }
      if (!done && now >= cl.deadline) done = true;  // idle or dripping: its time is up
      if (done) {
        close(cl.fd);
      } else {
        kept.push_back(std::move(cl));
      }
    }
    clients.swap(kept);
    if (fds[0].revents != 0) {
      for (int accepted = 0; accepted < 64; ++accepted) {
        const int c = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) {
          if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
            accept_paused_until = now + std::chrono::milliseconds(100);
          }
          break;
        }
        ucred cred{};
        socklen_t len = sizeof(cred);
        const bool known = getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 &&
                           (cred.uid == geteuid() || std::find(allowed_uids_.begin(), allowed_uids_.end(),
                                                               cred.uid) != allowed_uids_.end());
        if (!known || static_cast<int>(clients.size()) >= kMaxClients) {
          close(c);  // not a user that may have a region, or too many at once
          continue;
        }
        clients.push_back({c, {}, now + kClientTime});
      }
    }
  }
  for (const Client& cl : clients) close(cl.fd);
}

absl::StatusOr<int> ReceiveRegionFd(const std::string& address, const std::string& token) {
  if (token.empty() || token.size() >= kMaxTokenBytes || token.find('\n') != std::string::npos) {
    return absl::InvalidArgumentError("kv pool token must be 1 to 511 bytes without a newline");
  }
  socklen_t len = 0;
  auto addr = Address(address, &len);
  if (!addr.ok()) return addr.status();
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  SetTimeouts(s, 5);
  if (connect(s, reinterpret_cast<const sockaddr*>(&*addr), len) != 0) {
    const int err = errno;
    close(s);
    return absl::FailedPreconditionError(absl::StrCat("kv pool region socket ", address, " cannot be reached (",
                                                      std::strerror(err), "): shm:// needs the pool on this host"));
  }
  constexpr char kRefused[] =
      "the kv pool refused the region descriptor (unknown token, or this user is not allowed: the pool's "
      "--fd_socket_uids)";
  const std::string line = token + "\n";
  if (send(s, line.data(), line.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(line.size())) {
    const int err = errno;
    close(s);
    // A pool that closed the connection before reading the token refused this user.
    if (err == EPIPE || err == ECONNRESET) return absl::PermissionDeniedError(kRefused);
    return absl::UnavailableError(absl::StrCat("kv pool region socket ", address, ": send failed (",
                                               std::strerror(err), ")"));
  }
  FdMessage m;
  msghdr& msg = m.msg;
  const ssize_t n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  const int err = errno;
  close(s);
  if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK)) {
    return absl::DeadlineExceededError(
        absl::StrCat("kv pool region socket ", address, ": no answer within 5 s (the pool is busy or stuck)"));
  }
  const cmsghdr* cm = n == 1 ? CMSG_FIRSTHDR(&msg) : nullptr;
  if (cm == nullptr || cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) {
    return absl::PermissionDeniedError(kRefused);
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(cm), sizeof(int));
  return fd;
}

}  // namespace dd::kvpool
