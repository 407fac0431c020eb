// A small HTTP/1.1 server for the project's endpoints (the OpenAI-compatible API, /metrics),
// built to survive idle and slow clients:
//
//   - one event-loop thread accepts and reads requests without blocking, so a connection that
//     sends nothing, or drips a byte at a time, costs a descriptor and a few bytes, never a
//     thread: a request line, headers and body must all arrive within `request_timeout_ms`;
//   - open connections are capped per client address; when the table is full, a new connection
//     takes the place of the oldest one that has not sent a complete request, from the address
//     holding the most such connections, so a few addresses of idle clients cannot lock others out;
//   - headers and bodies are bounded before they are buffered (431, 413), and so are the body
//     bytes being received on all connections together (503 beyond);
//   - `check_head` (authentication) runs once the headers are in, before any body byte is kept,
//     so an unauthenticated client cannot make the server buffer a body;
//   - only complete requests reach the handler threads; when all are busy and the queue is full
//     a request gets 503 at once;
//   - while a handler runs, the loop watches its connection, so a client that hangs up is
//     noticed within the loop's tick (Connection::OnHangup), whether or not anything is
//     written to it.
//
// One request per connection (every response is sent with "Connection: close"); request bodies
// need Content-Length (chunked ones get 501). Thread-safe; handlers run on the worker threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd::http {

struct ServerOptions {
  std::string listen;  // HOST:PORT ([V6]:PORT; an empty HOST is every address); port 0 picks one
  int threads = 16;                  // requests handled at once
  int queue = 64;                    // complete requests waiting for a thread (beyond: 503)
  int max_connections = 4096;        // open connections in all (beyond: the oldest incomplete one goes)
  int max_per_client = 256;          // open connections per client address (beyond: closed at accept)
  int64_t request_timeout_ms = 10000;  // for the whole request to arrive (then: closed)
  int64_t write_timeout_ms = 30000;    // for each write of a response to make progress
  int64_t max_header_bytes = 16 << 10;
  int64_t max_body_bytes = 8 << 20;
  int64_t max_buffered_body_bytes = 256 << 20;  // bodies being received, all connections together
  std::string name = "http";         // in log lines
};

// An answer the server sends for a request it does not hand to the handler.
struct Refusal {
  int status = 400;
  std::string content_type = "text/plain";
  std::string body;
};

struct Request {
  std::string method, target, path;  // path: target without the query
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-case
  std::string body;
  std::string peer;  // the client's address
  // The first header of that name (case-insensitive), or nullptr.
  const std::string* Header(absl::string_view name) const;
};

// Runs on the server's loop thread once a request's line and headers are parsed (the body is
// empty then), before any byte of the body is kept: a refusal is answered at once and the body
// is discarded unread. Must be quick (a key comparison); it must not block.
using HeadCheck = std::function<std::optional<Refusal>(const Request& head)>;

class Connection {
 public:
  const Request& request() const { return request_; }
  // Sends all of `data`; false when the client is gone or a write made no progress for
  // write_timeout_ms (nothing more should be written then).
  bool Write(absl::string_view data);
  // `fn` runs once, on the server's loop thread, when the client hangs up before the handler
  // returns (at once, on this thread, if it already has). It must be quick and must not call
  // back into the connection. Once OnHangup(nullptr) returns, `fn` is not running and will not
  // run (so what it touches may be destroyed); cleared when the handler returns. A client that
  // half-closes its side after the request counts as hung up.
  void OnHangup(std::function<void()> fn);
  bool hung_up() const { return hung_up_.load(); }

 private:
  friend class Server;
  Connection(int fd, Request request, int64_t write_timeout_ms)
      : fd_(fd), request_(std::move(request)), write_timeout_ms_(write_timeout_ms) {}
  void HangUp();  // from the loop

  int fd_;
  Request request_;
  int64_t write_timeout_ms_;
  std::atomic<bool> hung_up_{false};
  std::mutex mu_;
  std::function<void()> on_hangup_;
};

using Handler = std::function<void(Connection&)>;

// The reason phrase of a status code ("OK", "Not Found", ...).
absl::string_view StatusText(int status);

class Server {
 public:
  // Listens and starts the loop and the threads (and raises the process's soft descriptor limit
  // to its hard limit). UNAVAILABLE naming the address when it cannot listen; INVALID_ARGUMENT
  // for a malformed address or option.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options, Handler handler,
                                                       HeadCheck check_head = nullptr);
  // Stops accepting, closes connections waiting or being read, and waits for running handlers.
  ~Server();
  int port() const { return port_; }

  struct State;  // the loop's and the workers' shared state (http_server.cc)

 private:
  explicit Server(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
  int port_ = 0;
};

}  // namespace dd::http
