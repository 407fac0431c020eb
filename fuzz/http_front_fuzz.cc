// The OpenAI HTTP front's request -> gRPC call path with arbitrary header bytes: a real router
// (no workers) behind its real HTTP front on loopback, one keyed and one open. Each input picks
// a front and an endpoint; its bytes become the request's header lines (after "Authorization:
// Bearer " when the first byte says so). What must hold: the process survives (a value gRPC
// metadata cannot carry once aborted it), every answer is an HTTP status line, and the keyed
// front never answers 200 to a request without its key.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_util.h"
#include "grpcpp/grpcpp.h"
#include "router/openai_http.h"
#include "router/router_service.h"

namespace {

constexpr char kKey[] = "fuzz-key-0123456789abcdef0123456789abcdef";

struct Front {
  std::unique_ptr<dd::router::RouterService> router;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<dd::router::OpenAiHttp> http;
};

Front* StartFront(bool keyed) {
  auto* f = new Front();
  dd::router::RouterOptions o;
  if (keyed) o.auth = dd::router::ApiAuth({{"fuzz", kKey}}, "");
  f->router = std::make_unique<dd::router::RouterService>(o);
  grpc::ServerBuilder b;
  b.RegisterService(f->router.get());
  f->server = b.BuildAndStart();
  dd::router::HttpOptions h;
  h.listen = "127.0.0.1:0";
  h.auth = o.auth;
  h.open_api = !keyed;
  h.threads = 4;
  auto started = dd::router::OpenAiHttp::Start(h, f->server->InProcessChannel(grpc::ChannelArguments()));
  dd::fuzz::Require(started.ok(), "the front starts");
  f->http = std::move(*started);
  return f;
}

// The answer to `request`, up to the server's close; "" when none came within a second (the
// server still waits for body bytes that a fuzzed Content-Length announced).
std::string Exchange(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  // The server closes first, so each exchange leaves a TIME_WAIT behind for a minute: spread
  // them over 64 loopback source addresses, or a smoke run's 20000 would use up the ports.
  static uint32_t next = 0;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  from.sin_addr.s_addr = htonl(0x7f000100u + 1 + (next++ % 64));  // 127.0.1.1 .. 127.0.1.64
  dd::fuzz::Require(bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) == 0, "bind a loopback source");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  dd::fuzz::Require(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0, "connect to the front");
  (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 1000) <= 0) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Front* keyed = StartFront(true);
  static Front* open = StartFront(false);
  if (size == 0) return 0;
  const uint8_t how = data[0];
  std::string headers(reinterpret_cast<const char*>(data + 1), size - 1);
  // The front would wait for a body that a fuzzed Content-Length announces: keep that header ours.
  for (size_t at = absl::AsciiStrToLower(headers).find("content-length"); at != std::string::npos;
       at = absl::AsciiStrToLower(headers).find("content-length")) {
    headers[at] = 'x';
  }
  Front* front = (how & 1) ? keyed : open;
  static const char* const kTargets[] = {"GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions",
                                         "OPTIONS /v1/completions"};
  const std::string target = kTargets[(how >> 1) & 3];
  const std::string body = absl::StartsWith(target, "POST") ? R"({"prompt": "hi", "messages": [], "max_tokens": 1})" : "";
  const std::string request =
      absl::StrCat(target, " HTTP/1.1\r\nHost: 127.0.0.1\r\n", (how & 8) ? "Authorization: Bearer " : "", headers,
                   "\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  const std::string answer = Exchange(front->http->port(), request);
  if (answer.empty()) return 0;
  dd::fuzz::Require(answer.size() >= 12 && absl::StartsWith(answer, "HTTP/1.1 ") &&
                        absl::ascii_isdigit(static_cast<unsigned char>(answer[9])),
                    "every answer starts with a status line");
  if (front == keyed && !absl::StrContains(headers, kKey)) {
    dd::fuzz::Require(!absl::StartsWith(answer, "HTTP/1.1 200"), "no 200 without the key");
  }
  return 0;
}
