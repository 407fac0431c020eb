// The pool's /metrics (DESIGN §9), computed from Pool::Stats at scrape time:
//   dd_pool_bytes{tenant, state="quota|used|leased"}, dd_pool_sequences{tenant},
//   dd_pool_evictions_total{tenant}, dd_pool_expired_leases_total{tenant},
//   dd_pool_prefix_hits_total{tenant}.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kv-pool/server/pool.h"

namespace prometheus {
class Exposer;
}

namespace dd::kvpool {

// Serves the pool's metrics over HTTP at `listen` (port 0 picks one); keep it alive.
class PoolMetrics {
 public:
  static absl::StatusOr<std::unique_ptr<PoolMetrics>> Start(const Pool& pool, const std::string& listen);
  ~PoolMetrics();
  int port() const { return port_; }

 private:
  PoolMetrics() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<void> collectable_;
  int port_ = 0;
};

}  // namespace dd::kvpool
