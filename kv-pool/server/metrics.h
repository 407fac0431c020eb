// The pool's /metrics (docs/operations.md, "Metrics"; docs/decisions/0030-metrics.md), computed
// from Pool::Stats at scrape time:
//   dd_pool_bytes{tenant, state="quota|used|leased"}, dd_pool_sequences{tenant},
//   dd_pool_evictions_total{tenant}, dd_pool_expired_leases_total{tenant},
//   dd_pool_prefix_hits_total{tenant}; with UCX, dd_pool_ucx_requests_total{op="get|put|refused"}
//   dd_pool_ucx_bytes_total{op="get|put"} (the active-message data path) and
//   dd_pool_ucx_eager_replies_total (get replies sent as one eager message, over tcp) and the
//   gauge dd_pool_ucx_reply_bytes_held (packed copies of replies in flight).
#pragma once

#include <memory>
#include <string>

#include "common/metrics_server.h"
#include "absl/status/statusor.h"
#include "kv-pool/server/pool.h"
#include "kv-pool/server/ucx_server.h"

namespace prometheus {
}

namespace dd::kvpool {

// Serves the pool's metrics over HTTP at `listen` (port 0 picks one); keep it alive.
class PoolMetrics {
 public:
  // `ucx` may be null (the pool runs without UCX); it must outlive this.
  static absl::StatusOr<std::unique_ptr<PoolMetrics>> Start(const Pool& pool, const std::string& listen,
                                                           const UcxServer* ucx = nullptr);
  ~PoolMetrics();
  int port() const { return port_; }

 private:
  PoolMetrics() = default;
  std::unique_ptr<MetricsServer> exposer_;
  std::shared_ptr<void> collectable_;
  int port_ = 0;
};

}  // namespace dd::kvpool
