// The HTTP server against real sockets: requests served, and idle, dripping, oversized, too
// many and departing clients handled as http_server.h promises.
#include "common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace dd::http {
namespace {

using Clock = std::chrono::steady_clock;

// A TCP connection to 127.0.0.1:port from `from` (another loopback address is another client).
int Connect(int port, const char* from = "127.0.0.1") {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  inet_pton(AF_INET, from, &local.sin_addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)), 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  return fd;
}

void Send(int fd, const std::string& s) { ASSERT_EQ(send(fd, s.data(), s.size(), MSG_NOSIGNAL), static_cast<ssize_t>(s.size())); }

// Everything the server sends until it closes, waiting at most `timeout_ms`.
std::string ReadAll(int fd, int timeout_ms = 5000) {
  std::string out;
  const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[4096];
  for (;;) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, left) <= 0) return out + "<timeout>";
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

std::string Get(int port, const std::string& path, const char* from = "127.0.0.1") {
  const int fd = Connect(port, from);
  Send(fd, absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n\r\n"));
  std::string r = ReadAll(fd);
  close(fd);
  return r;
}

// Echoes method, path, a header and the body.
void Echo(Connection& c) {
  const Request& r = c.request();
  const std::string* h = r.Header("X-Test");
  const std::string body = absl::StrCat(r.method, " ", r.path, " ", h ? *h : "-", " ", r.body);
  c.Write(absl::StrCat("HTTP/1.1 200 OK\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body));
}

std::unique_ptr<Server> StartEcho(ServerOptions o = {}) {
  o.listen = "127.0.0.1:0";
  auto s = Server::Start(o, Echo);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(HttpServerTest, ServesRequestsWithHeadersAndBodies) {
  auto s = StartEcho();
  ASSERT_NE(s, nullptr);
  EXPECT_NE(Get(s->port(), "/a?b=1").find("\r\n\r\nGET /a - "), std::string::npos);
  const int fd = Connect(s->port());
  Send(fd, "POST /v1/x HTTP/1.1\r\nx-test: yes\r\nContent-Length: 5\r\n\r\nhel");
  Send(fd, "lo");  // the body in two pieces
  EXPECT_NE(ReadAll(fd).find("\r\n\r\nPOST /v1/x yes hello"), std::string::npos);
  close(fd);
}

TEST(HttpServerTest, BadAndOversizedRequestsAreRefusedWithTheirStatus) {
  ServerOptions o;
  o.max_header_bytes = 1024;
  o.max_body_bytes = 100;
  auto s = StartEcho(o);
  ASSERT_NE(s, nullptr);
  auto send_raw = [&](const std::string& req) {
    const int fd = Connect(s->port());
    Send(fd, req);
    std::string r = ReadAll(fd);
    close(fd);
    return r.substr(0, r.find("\r\n"));
  };
  EXPECT_EQ(send_raw("GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n"),
            "HTTP/1.1 431 Request Header Fields Too Large");
  EXPECT_EQ(send_raw("POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n"), "HTTP/1.1 413 Content Too Large");
  EXPECT_EQ(send_raw("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"), "HTTP/1.1 501 Not Implemented");
  EXPECT_EQ(send_raw("POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n"), "HTTP/1.1 400 Bad Request");
  EXPECT_EQ(send_raw("GARBAGE\r\n\r\n"), "HTTP/1.1 400 Bad Request");
}

TEST(HttpServerTest, AThousandIdleConnectionsDoNotDelayARequest) {
  ServerOptions o;
  o.threads = 4;
  o.max_per_client = 2000;
  auto s = StartEcho(o);
  ASSERT_NE(s, nullptr);
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) idle.push_back(Connect(s->port()));
  for (int i = 0; i < 100; ++i) Send(idle[i], "GET / HT");  // some send half a request line
  const auto t0 = Clock::now();
  const std::string r = Get(s->port(), "/ok");
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_NE(r.find("GET /ok"), std::string::npos) << r;
  EXPECT_LT(ms, 1000.0);
  for (int fd : idle) close(fd);
}

TEST(HttpServerTest, OneClientAddressCannotTakeEveryConnection) {
  ServerOptions o;
  o.max_per_client = 8;
  auto s = StartEcho(o);
  ASSERT_NE(s, nullptr);
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(Connect(s->port()));
  // A ninth from the same address is turned away at once; another address is served.
  const std::string refused = Get(s->port(), "/x");
  EXPECT_NE(refused.find("503"), std::string::npos) << refused;
  EXPECT_NE(Get(s->port(), "/y", "127.0.0.2").find("GET /y"), std::string::npos);
  for (int fd : idle) close(fd);
}

// True when the server has closed `fd` (after whatever it sent), within `timeout_ms`.
bool ClosedByServer(int fd, int timeout_ms) { return ReadAll(fd, timeout_ms).find("<timeout>") == std::string::npos; }

TEST(HttpServerTest, AFullTableMakesRoomFromTheAddressHoldingTheMostIncompleteConnections) {
  ServerOptions o;
  o.max_connections = 20;
  o.max_per_client = 100;
  auto s = StartEcho(o);
  ASSERT_NE(s, nullptr);
  std::vector<int> many, few;
  for (int i = 0; i < 15; ++i) many.push_back(Connect(s->port(), "127.0.0.5"));
  for (int i = 0; i < 5; ++i) few.push_back(Connect(s->port(), "127.0.0.6"));
  Send(many[0], "GET / HT");  // half a request counts as incomplete too
  // Before the change that evicts, this address got "503 too many connections".
  for (int round = 0; round < 3; ++round) {
    if (round > 0) few.push_back(Connect(s->port(), "127.0.0.6"));  // full again
    const std::string r = Get(s->port(), absl::StrCat("/new", round), "127.0.0.7");
    EXPECT_NE(r.find(absl::StrCat("GET /new", round)), std::string::npos) << r;
  }
  // Each new connection took the place of the oldest of the address holding the most.
  for (int i = 0; i < 3; ++i) {
    const std::string r = ReadAll(many[i], 2000);
    EXPECT_NE(r.find("503"), std::string::npos) << i << ": " << r;
  }
  EXPECT_FALSE(ClosedByServer(many[3], 200));
  for (int fd : few) EXPECT_FALSE(ClosedByServer(fd, 50));
  for (int fd : many) close(fd);
  for (int fd : few) close(fd);
}

TEST(HttpServerTest, AHeadCheckRefusesBeforeAnyBodyByteIsRead) {
  ServerOptions o;
  o.max_body_bytes = 1 << 20;
  o.listen = "127.0.0.1:0";
  int checked = 0;
  auto s = Server::Start(o, Echo, [&checked](const Request& head) -> std::optional<Refusal> {
    ++checked;  // the loop thread only
    EXPECT_TRUE(head.body.empty());
    const std::string* key = head.Header("X-Key");
    if (key != nullptr && *key == "good") return std::nullopt;
    return Refusal{401, "application/json", R"({"error": "no key"})"};
  });
  ASSERT_TRUE(s.ok()) << s.status();
  // The body is announced but never sent: the answer cannot wait for it.
  const int fd = Connect((*s)->port());
  Send(fd, "POST /x HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n");
  const std::string r = ReadAll(fd, 3000);
  close(fd);
  EXPECT_EQ(r.substr(0, r.find("\r\n")), "HTTP/1.1 401 Unauthorized") << r;
  EXPECT_NE(r.find("Content-Type: application/json"), std::string::npos) << r;
  EXPECT_NE(r.find(R"({"error": "no key"})"), std::string::npos) << r;
  const int ok = Connect((*s)->port());
  Send(ok, "POST /y HTTP/1.1\r\nX-Key: good\r\nContent-Length: 4\r\n\r\nbody");
  EXPECT_NE(ReadAll(ok).find("POST /y - body"), std::string::npos);
  close(ok);
  s->reset();
  EXPECT_EQ(checked, 2);
}

TEST(HttpServerTest, BodiesBeingReceivedShareOneBudget) {
  ServerOptions o;
  o.max_body_bytes = 100;
  o.max_buffered_body_bytes = 150;
  auto s = StartEcho(o);
  ASSERT_NE(s, nullptr);
  const int a = Connect(s->port());
  Send(a, "POST /a HTTP/1.1\r\nContent-Length: 100\r\n\r\n");  // 100 of 150 reserved, body pending
  const int b = Connect(s->port(), "127.0.0.2");
  Send(b, "POST /b HTTP/1.1\r\nContent-Length: 100\r\n\r\n");
  const std::string rb = ReadAll(b, 3000);
  close(b);
  EXPECT_EQ(rb.substr(0, rb.find("\r\n")), "HTTP/1.1 503 Service Unavailable") << rb;
  EXPECT_NE(Get(s->port(), "/small", "127.0.0.3").find("GET /small"), std::string::npos);  // no body: served
  Send(a, std::string(100, 'x'));
  EXPECT_NE(ReadAll(a).find("POST /a - xxx"), std::string::npos);
  close(a);
  // The budget is back once the first request is done.
  const int c = Connect(s->port(), "127.0.0.2");
  Send(c, "POST /c HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + std::string(100, 'y'));
  EXPECT_NE(ReadAll(c).find("POST /c - yyy"), std::string::npos);
  close(c);
}

TEST(HttpServerTest, ARequestThatDoesNotArriveInTimeIsClosed) {
  ServerOptions o;
  o.request_timeout_ms = 300;
  auto s = StartEcho(o);
  ASSERT_NE(s, nullptr);
  const int fd = Connect(s->port());
  const auto t0 = Clock::now();
  Send(fd, "GET / HTTP/1.1\r\n");  // then nothing: the headers never end
  const std::string r = ReadAll(fd, 3000);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_NE(r.find("408"), std::string::npos) << r;
  EXPECT_GE(ms, 250.0);
  EXPECT_LT(ms, 1500.0);
  close(fd);
}

TEST(HttpServerTest, AHandlerLearnsThatItsClientLeftWithoutWriting) {
  std::mutex mu;
  std::condition_variable cv;
  bool gone = false, started = false;
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  auto s = Server::Start(o, [&](Connection& c) {
    c.OnHangup([&] {  // (not under mu: the callback takes it)
      std::lock_guard<std::mutex> l(mu);
      gone = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(mu);
    started = true;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds(5), [&] { return gone; });
    lock.unlock();
    c.OnHangup(nullptr);
  });
  ASSERT_TRUE(s.ok()) << s.status();
  const int fd = Connect((*s)->port());
  Send(fd, "POST /slow HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return started; }));
  }
  const auto t0 = Clock::now();
  close(fd);
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(1), [&] { return gone; })) << "no hang-up within 1 s";
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 1.0);
}

TEST(HttpServerTest, BusyHandlersAnswer503InsteadOfQueueingForever) {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false, release = false;
  ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.threads = 1;
  o.queue = 0;
  auto s = Server::Start(o, [&](Connection& c) {
    std::unique_lock<std::mutex> lock(mu);
    started = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
    c.Write("HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  });
  ASSERT_TRUE(s.ok());
  const int first = Connect((*s)->port());
  Send(first, "GET /1 HTTP/1.1\r\n\r\n");
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return started; }));
  }
  EXPECT_NE(Get((*s)->port(), "/2").find("503"), std::string::npos);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  EXPECT_NE(ReadAll(first).find("200 OK"), std::string::npos);
  close(first);
}

TEST(HttpServerTest, BadListenAddressesAreClearErrors) {
  EXPECT_EQ(Server::Start({.listen = "nonsense"}, Echo).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Server::Start({.listen = "127.0.0.1:99999"}, Echo).status().code(), absl::StatusCode::kInvalidArgument);
  auto a = StartEcho();
  ASSERT_NE(a, nullptr);
  const auto taken = Server::Start({.listen = absl::StrCat("127.0.0.1:", a->port())}, Echo);
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kUnavailable) << taken.status();
}

}  // namespace
}  // namespace dd::http
