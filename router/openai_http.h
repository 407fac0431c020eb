// An OpenAI-compatible HTTP front (docs/api.md) for the router and `ddctl serve`:
//   GET  /v1/models                the served models
//   POST /v1/completions           {model, prompt, max_tokens, temperature, top_p, seed, stop, stream}
//   POST /v1/chat/completions      {model, messages: [{role, content}], ...the same}
// `stream: true` answers with server-sent events ("data: {chunk}" lines, then "data: [DONE]").
// Every call goes through the router's own gRPC API on an in-process channel, so admission,
// validation, API keys ("Authorization: Bearer KEY" is passed on) and metrics are the same as for
// gRPC clients. Errors use the API's shape {"error": {"message", "type", "code"}} with the HTTP
// status of the gRPC code. The server is common/http_server.h: idle and slow connections cost
// no handler thread; a request must arrive within 10 s and bodies above `max_body_bytes` are
// refused before they are read; `threads` requests are handled at once (more wait in a queue of
// 4× that, then get 503), at most `max_connections_per_client` connections per client address;
// a client that hangs up cancels its request, streamed or not.
// Before any body byte is kept, the Authorization header is checked: a value gRPC metadata
// cannot carry (a byte outside printable ASCII) gets 400, and with API keys a missing or
// unknown key gets 401, so an unauthenticated client never makes the server buffer or parse a
// body. A body's JSON is bounded in depth and values (common/json_bounds.h) before parsing.
// Browsers are kept out unless allowed (HttpOptions): a request carrying an Origin header not
// on the allow-list gets 403 and no CORS header is ever sent for it; with an open API (no
// keys), only IP-literal or localhost Host headers are answered, so a DNS-rebinding page
// cannot reach it under its own name.
// Differences from OpenAI's API: one choice (n = 1), no logprobs or echo, and temperature
// defaults to 1 as there (the gRPC API's default is greedy).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "router/api_keys.h"

namespace dd::http {
class Server;
}

namespace dd::router {

struct HttpOptions {
  std::string listen;                     // HOST:PORT (port 0 = pick one)
  std::vector<std::string> cors_origins;  // browser origins allowed (exact "scheme://host[:port]")
  // Host header names answered (without port); empty: any with API keys, else IP literals and
  // localhost only.
  std::vector<std::string> allowed_hosts;
  bool open_api = false;  // the router has no API keys
  int threads = 64;       // requests handled at once (a streamed one holds its thread to the end)
  int max_connections_per_client = 256;
  int64_t max_body_bytes = int64_t{8} << 20;   // a larger request body gets 413, unread
  ApiAuth auth;  // the router's keys, checked before a body is read (open: every caller passes)
};

class OpenAiHttp {
 public:
  // Listens on options.listen and forwards to `channel` (the router's public gRPC API;
  // Server::InProcessChannel).
  static absl::StatusOr<std::unique_ptr<OpenAiHttp>> Start(const HttpOptions& options,
                                                          std::shared_ptr<grpc::Channel> channel);
  ~OpenAiHttp();
  int port() const { return port_; }

  struct Handler;

 private:
  OpenAiHttp() = default;
  std::unique_ptr<Handler> handler_;
  std::unique_ptr<http::Server> server_;  // after handler_: destroyed first
  int port_ = 0;
};

}  // namespace dd::router
