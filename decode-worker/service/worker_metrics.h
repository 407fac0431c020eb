// The worker's /metrics (docs/operations.md, "Metrics"; docs/decisions/0030-metrics.md). Histograms
// are fed by the scheduler as it runs:
//   dd_step_seconds{phase="decode|prefill"}, dd_ttft_seconds, dd_tpot_seconds,
//   dd_worker_requests_total{outcome="ok|cancelled|failed"}.
// Gauges and counters are read from the scheduler at scrape time: dd_decode_tokens_total,
// dd_prefill_tokens_total, dd_batch_size, dd_requests_waiting, dd_prefetch_hit_ratio,
// dd_transfer_wait_seconds, dd_spec_resyncs_total, dd_kv_bytes_total{path="prefetch|urgent|wasted"},
// dd_device_memory_bytes{kind="budget|weights|workspace|reserved|kv"}, and where a start-up device
// check ran, dd_device_check_passed{device,serving_on} and dd_device_check_seconds; with a stream
// keeper, dd_kept_streams and dd_kept_stream_bytes.
#pragma once

#include <memory>
#include <string>

#include "common/metrics_server.h"
#include "absl/status/statusor.h"
#include "decode-worker/service/scheduler.h"
#include "decode-worker/service/stream_keeper.h"

namespace prometheus {
class Registry;
class Histogram;
template <typename T>
class Family;
class Counter;
}  // namespace prometheus

namespace dd::worker {

class WorkerMetrics : public SchedulerObserver {
 public:
  WorkerMetrics();
  ~WorkerMetrics() override;
  // Serves the metrics over HTTP at `listen` (port 0 picks one); the scheduler must outlive
  // this object.
  absl::Status Serve(const std::string& listen, const Scheduler& scheduler);
  // For an embedded server that already has an exposer: add these metrics to it.
  void RegisterWith(MetricsServer& exposer, const Scheduler& scheduler);
  int port() const { return port_; }
  // dd_kept_streams and dd_kept_stream_bytes from `keeper` (set before serving; outlives this).
  void set_keeper(const StreamKeeper* keeper) { keeper_ = keeper; }
  // Stops serving (before the scheduler it reads goes away).
  void StopServing();

  void OnStep(bool decode, int rows, int64_t tokens, double seconds) override;
  void OnFirstToken(double ttft_s) override;
  void OnFinished(const StreamEvent& final_event) override;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram *decode_step_ = nullptr, *prefill_step_ = nullptr, *ttft_ = nullptr, *tpot_ = nullptr;
  prometheus::Counter *ok_ = nullptr, *cancelled_ = nullptr, *failed_ = nullptr;
  std::unique_ptr<MetricsServer> exposer_;
  std::shared_ptr<void> collectable_;
  int port_ = 0;
  const StreamKeeper* keeper_ = nullptr;
};

}  // namespace dd::worker
