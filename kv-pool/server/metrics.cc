#include "kv-pool/server/metrics.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"
#include "common/metrics_server.h"

namespace dd::kvpool {
namespace {

class PoolCollectable : public prometheus::Collectable {
 public:
  PoolCollectable(const Pool& pool, const UcxServer* ucx) : pool_(pool), ucx_(ucx) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    prometheus::MetricFamily bytes{"dd_pool_bytes", "Pool memory by tenant and state", MetricType::Gauge, {}};
    prometheus::MetricFamily seqs{"dd_pool_sequences", "Sequences stored", MetricType::Gauge, {}};
    prometheus::MetricFamily evictions{"dd_pool_evictions_total", "Sequences evicted (LRU, unleased)",
                                       MetricType::Counter, {}};
    prometheus::MetricFamily expired{"dd_pool_expired_leases_total", "Leases that ran out", MetricType::Counter, {}};
    prometheus::MetricFamily hits{"dd_pool_prefix_hits_total", "Prefix lookups that found blocks",
                                  MetricType::Counter, {}};
    for (int t = 0; t < pool_.tenants(); ++t) {
      const PoolStats s = pool_.Stats(t);
      const std::string& name = pool_.tenant_name(t);
      for (auto [state, v] : {std::pair{"quota", s.region_bytes}, {"used", s.used_bytes}, {"leased", s.leased_bytes}}) {
        bytes.metric.push_back(Gauge({{"tenant", name}, {"state", state}}, static_cast<double>(v)));
      }
      seqs.metric.push_back(Gauge({{"tenant", name}}, static_cast<double>(s.sequences)));
      evictions.metric.push_back(Counter({{"tenant", name}}, static_cast<double>(s.evictions)));
      expired.metric.push_back(Counter({{"tenant", name}}, static_cast<double>(s.expired_leases)));
      hits.metric.push_back(Counter({{"tenant", name}}, static_cast<double>(s.prefix_hits)));
    }
    if (ucx_ == nullptr) return {bytes, seqs, evictions, expired, hits};
    const UcxCounters& c = ucx_->counters();
    prometheus::MetricFamily requests{"dd_pool_ucx_requests_total", "UCX active-message requests served or refused",
                                      MetricType::Counter, {}};
    prometheus::MetricFamily moved{"dd_pool_ucx_bytes_total", "Bytes served over UCX active messages",
                                   MetricType::Counter, {}};
    for (auto [op, v] : {std::pair{"get", &c.gets}, {"put", &c.puts}, {"refused", &c.refused}}) {
      requests.metric.push_back(Counter({{"op", op}}, static_cast<double>(v->load(std::memory_order_relaxed))));
    }
    for (auto [op, v] : {std::pair{"get", &c.get_bytes}, {"put", &c.put_bytes}}) {
      moved.metric.push_back(Counter({{"op", op}}, static_cast<double>(v->load(std::memory_order_relaxed))));
    }
    prometheus::MetricFamily eager{"dd_pool_ucx_eager_replies_total",
                                   "Get replies handed to UCX as one eager message (over tcp: no rendezvous round trip)",
                                   MetricType::Counter, {}};
    eager.metric.push_back(Counter({}, static_cast<double>(c.eager_replies.load(std::memory_order_relaxed))));
    prometheus::MetricFamily held{"dd_pool_ucx_reply_bytes_held",
                                  "Bytes of packed get replies in flight, stalled ones included (at most 256 MiB per "
                                  "tenant, one reply more)",
                                  MetricType::Gauge, {}};
    held.metric.push_back(Gauge({}, static_cast<double>(c.reply_bytes_held.load(std::memory_order_relaxed))));
    return {bytes, seqs, evictions, expired, hits, requests, moved, eager, held};
  }

 private:
  static prometheus::ClientMetric Gauge(std::vector<prometheus::ClientMetric::Label> labels, double v) {
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    m.gauge.value = v;
    return m;
  }
  static prometheus::ClientMetric Counter(std::vector<prometheus::ClientMetric::Label> labels, double v) {
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    m.counter.value = v;
    return m;
  }
  const Pool& pool_;
  const UcxServer* ucx_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PoolMetrics>> PoolMetrics::Start(const Pool& pool, const std::string& listen,
                                                                const UcxServer* ucx) {
  std::unique_ptr<PoolMetrics> m(new PoolMetrics());
  auto server = MetricsServer::Start(listen);
  if (!server.ok()) return server.status();
  m->exposer_ = std::move(*server);
  auto collectable = std::make_shared<PoolCollectable>(pool, ucx);
  m->exposer_->RegisterCollectable(collectable);
  m->collectable_ = collectable;
  m->port_ = m->exposer_->port();
  return m;
}

PoolMetrics::~PoolMetrics() = default;

}  // namespace dd::kvpool
