#include "decode-worker/service/worker_metrics.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "common/metrics_server.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace dd::worker {
namespace {

prometheus::ClientMetric Value(std::vector<prometheus::ClientMetric::Label> labels, double v, bool counter) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (counter) {
    m.counter.value = v;
  } else {
    m.gauge.value = v;
  }
  return m;
}

class SchedulerCollectable : public prometheus::Collectable {
 public:
  SchedulerCollectable(const Scheduler& s, const StreamKeeper* keeper) : s_(s), keeper_(keeper) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const SchedulerStats st = s_.Stats();
    const engine::Engine& e = s_.engine();
    auto family = [](const char* name, const char* help, MetricType type, double v) {
      prometheus::MetricFamily f{name, help, type, {}};
      f.metric.push_back(Value({}, v, type == MetricType::Counter));
      return f;
    };
    std::vector<prometheus::MetricFamily> out;
    out.push_back(family("dd_decode_tokens_total", "Tokens decoded", MetricType::Counter, st.decode_tokens));
    out.push_back(family("dd_prefill_tokens_total", "Prompt tokens prefilled", MetricType::Counter, st.prefill_tokens));
    out.push_back(family("dd_batch_size", "Requests in the batch", MetricType::Gauge, st.active));
    out.push_back(family("dd_requests_waiting", "Requests queued for a slot or memory", MetricType::Gauge, st.waiting));
    out.push_back(family("dd_prefetch_hit_ratio", "Predicted chunks that the next step selected / selected",
                         MetricType::Gauge, st.hit_rate));
    out.push_back(family("dd_transfer_wait_seconds", "Compute time spent waiting for KV transfers",
                         MetricType::Counter, st.transfer_wait_ns * 1e-9));
    out.push_back(family("dd_spec_resyncs_total",
                         "Speculative tokens replaced by the context's continuation after a speculative miss",
                         MetricType::Counter, static_cast<double>(st.spec_resyncs)));
    out.push_back(family("dd_requests_rebuilt_total",
                         "Requests whose KV was rebuilt (prompt prefilled again, streamed tokens replayed as decode "
                         "steps in the sparse modes) after the KV pool was lost",
                         MetricType::Counter, static_cast<double>(st.rebuilt)));
    if (keeper_ != nullptr) {
      out.push_back(family("dd_kept_streams", "Streams kept for a reconnect (requests named by their client)",
                           MetricType::Gauge, static_cast<double>(keeper_->kept())));
      out.push_back(family("dd_kept_stream_bytes", "Bytes of output the kept streams hold for a reconnect",
                           MetricType::Gauge, static_cast<double>(keeper_->bytes())));
    }
    prometheus::MetricFamily kv{"dd_kv_bytes_total", "KV bytes gathered from the store by path", MetricType::Counter, {}};
    for (auto [path, v] : {std::pair{"prefetch", st.kv_prefetch_bytes}, {"urgent", st.kv_urgent_bytes},
                           {"wasted", st.kv_wasted_bytes}}) {
      kv.metric.push_back(Value({{"path", path}}, static_cast<double>(v), true));
    }
    out.push_back(std::move(kv));
    out.push_back(family("dd_kv_key_bytes_saved_total",
                         "Key bytes not moved from the store because their keys were rebuilt on the device",
                         MetricType::Counter, static_cast<double>(st.kv_key_bytes_saved)));
    out.push_back(family("dd_key_reconstructing_layers",
                         "Sparse layers rebuilding their keys from the low-rank key cache at the last step",
                         MetricType::Gauge, static_cast<double>(st.reconstructing_layers)));
    prometheus::MetricFamily chunks{"dd_kv_chunks_total",
                                    "KV chunks per sparse layer: selected, reused (resident from earlier steps), "
                                    "urgent (misses fetched on the critical path), prefetched, prefetch_hit "
                                    "(predicted and selected), wasted (prefetched, not selected), evicted, "
                                    "reconstructed (attended with keys rebuilt on the device), rebuilt (keys computed; "
                                    "a resident slot keeps them), values_only (moved without keys)",
                                    MetricType::Counter, {}};
    for (size_t l = 0; l < st.kv_layers.size(); ++l) {
      const auto& ls = st.kv_layers[l];
      if (ls.selected == 0 && ls.prefetched == 0) continue;
      for (auto [event, v] : {std::pair{"selected", ls.selected}, {"reused", ls.reused}, {"urgent", ls.urgent},
                              {"prefetched", ls.prefetched}, {"prefetch_hit", ls.hits}, {"wasted", ls.wasted},
                              {"evicted", ls.evictions}, {"reconstructed", ls.reconstructed}, {"rebuilt", ls.rebuilt},
                              {"values_only", ls.urgent_values + ls.prefetched_values}}) {
        chunks.metric.push_back(Value({{"layer", std::to_string(l)}, {"event", event}}, static_cast<double>(v), true));
      }
    }
    out.push_back(std::move(chunks));
    prometheus::MetricFamily mem{"dd_device_memory_bytes", "Device memory by kind", MetricType::Gauge, {}};
    for (auto [kind, v] : {std::pair{"budget", e.device_memory_bytes()}, {"weights", e.memory_plan().weight_bytes()},
                           {"workspace", e.memory_plan().shared_workspace_bytes()}, {"reserved", st.reserved_bytes},
                           {"kv", st.kv_bytes}}) {
      mem.metric.push_back(Value({{"kind", kind}}, static_cast<double>(v), false));
    }
    out.push_back(std::move(mem));
    prometheus::MetricFamily kv_type{"dd_kv_dtype", "The type KV is kept in (1 for the one in use)",
                                     MetricType::Gauge, {}};
    kv_type.metric.push_back(Value({{"dtype", std::string(KvDtypeName(e.options().kv_dtype))}}, 1, false));
    out.push_back(std::move(kv_type));
    out.push_back(family("dd_kv_saturated_values_total",
                         "K and V values beyond f16's range stored as ±65504 (an f16 KV type; 0 otherwise)",
                         MetricType::Counter, static_cast<double>(e.kv_saturated_values())));
    // The start-up device check, when one ran: which device, its verdict, the device in use.
    if (const engine::EngineOptions& eo = e.options(); !eo.checked_device.empty()) {
      prometheus::MetricFamily check{"dd_device_check_passed",
                                     "Start-up check of a device against the cpu: 1 passed, 0 failed (serving_on: "
                                     "the device in use)",
                                     MetricType::Gauge, {}};
      check.metric.push_back(Value({{"device", eo.checked_device}, {"serving_on", std::string(e.device_name())}},
                                   eo.device_check_passed ? 1 : 0, false));
      out.push_back(std::move(check));
      out.push_back(family("dd_device_check_seconds", "Time the start-up device check took", MetricType::Gauge,
                           eo.device_check_seconds));
    }
    return out;
  }

 private:
  const Scheduler& s_;
  const StreamKeeper* keeper_;
};

const prometheus::Histogram::BucketBoundaries& TimeBuckets() {
  static const prometheus::Histogram::BucketBoundaries b{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                         0.5,   1,      2.5,   5,    10,    30,   60};
  return b;
}

}  // namespace

WorkerMetrics::WorkerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& step = prometheus::BuildHistogram().Name("dd_step_seconds").Help("Engine step time by phase").Register(*registry_);
  decode_step_ = &step.Add({{"phase", "decode"}}, TimeBuckets());
  prefill_step_ = &step.Add({{"phase", "prefill"}}, TimeBuckets());
  ttft_ = &prometheus::BuildHistogram().Name("dd_ttft_seconds").Help("Arrival to first token").Register(*registry_).Add(
      {}, TimeBuckets());
  tpot_ = &prometheus::BuildHistogram().Name("dd_tpot_seconds").Help("Mean time per output token after the first")
               .Register(*registry_).Add({}, TimeBuckets());
  auto& done = prometheus::BuildCounter().Name("dd_worker_requests_total").Help("Requests ended, by outcome")
                   .Register(*registry_);
  ok_ = &done.Add({{"outcome", "ok"}});
  cancelled_ = &done.Add({{"outcome", "cancelled"}});
  failed_ = &done.Add({{"outcome", "failed"}});
}

WorkerMetrics::~WorkerMetrics() = default;

void WorkerMetrics::StopServing() { exposer_.reset(); }

absl::Status WorkerMetrics::Serve(const std::string& listen, const Scheduler& scheduler) {
  auto server = MetricsServer::Start(listen);
  if (!server.ok()) return server.status();
  exposer_ = std::move(*server);
  RegisterWith(*exposer_, scheduler);
  port_ = exposer_->port();
  return absl::OkStatus();
}

void WorkerMetrics::RegisterWith(MetricsServer& exposer, const Scheduler& scheduler) {
  auto c = std::make_shared<SchedulerCollectable>(scheduler, keeper_);
  exposer.RegisterCollectable(c);
  exposer.RegisterCollectable(registry_);
  collectable_ = c;
}

void WorkerMetrics::OnStep(bool decode, int rows, int64_t tokens, double seconds) {
  (decode ? decode_step_ : prefill_step_)->Observe(seconds);
}

void WorkerMetrics::OnFirstToken(double ttft_s) { ttft_->Observe(ttft_s); }

void WorkerMetrics::OnFinished(const StreamEvent& e) {
  if (e.status.ok()) {
    ok_->Increment();
    if (e.tpot_s > 0) tpot_->Observe(e.tpot_s);
  } else if (absl::IsCancelled(e.status)) {
    cancelled_->Increment();
  } else {
    failed_->Increment();
  }
}

}  // namespace dd::worker
