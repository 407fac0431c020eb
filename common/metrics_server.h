// The Prometheus scrape endpoint (GET /metrics, text format 0.0.4) on the project's HTTP server
// (common/http_server.h), so a scrape is answered beside any number of idle connections. It
// takes what prometheus::Exposer took: collectables (registries) registered by their owners.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/http_server.h"
#include "prometheus/collectable.h"

namespace dd {

class MetricsServer {
 public:
  // Listens on HOST:PORT (port 0 = pick one); UNAVAILABLE naming the address when it cannot.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen);
  ~MetricsServer();
  // Collected at every scrape while the owner keeps it alive.
  void RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& c);
  int port() const { return server_->port(); }

 private:
  MetricsServer() = default;
  void Handle(http::Connection& c);

  std::mutex mu_;
  std::vector<std::weak_ptr<prometheus::Collectable>> collectables_;
  std::unique_ptr<http::Server> server_;  // last: stopped before the rest goes
};

}  // namespace dd
