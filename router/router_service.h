// dd-router's services: the public API (proto/generate.proto) and the worker registry
// (proto/worker.proto Registry). Generate validates the request, places it on a worker,
// relays the worker's stream and, when the worker fails mid-stream, resumes the request on
// another worker from its prompt plus the tokens already streamed; tokens are numbered, so
// the client sees none twice and none missing.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics_server.h"
#include "grpcpp/grpcpp.h"
#include "proto/generate.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "proto/etcd_membership.h"
#include "router/api_keys.h"
#include "router/registry.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
template <typename T>
class Family;
}  // namespace prometheus

namespace dd::router {

// A fresh request id: "req-" and 32 hex digits of OS randomness.
std::string NewRequestId();

struct RouterOptions {
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds heartbeat_timeout{3000};
  int64_t max_new_tokens_limit = 8192;
  int64_t max_inflight = 256;   // requests the router holds at once; more → RESOURCE_EXHAUSTED
  int32_t max_resumes = 3;      // moves to another worker per request after failures
  int32_t max_workers = 256;    // registry entries; long-silent idle workers are forgotten
  std::string cluster_secret;   // shown to and required from workers (proto/cluster_auth.h); "" = off
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;  // dialing workers; null = plaintext
  ApiAuth auth;                 // tenant API keys and the operator key (api_keys.h); default: open
  // Requests one API tenant may have in flight (a key's own max_inflight wins). 0: when the keys
  // name two or more tenants, an equal share of the capacity of the workers up (their batch +
  // queue, at most max_inflight), else no per-tenant limit.
  int64_t tenant_max_inflight = 0;
  // Usage names the worker that served a request to every caller; off, only to the operator key
  // and on an open API (a tenant could otherwise learn where other tenants' prompts went).
  bool expose_worker_id = false;
};

class RouterService final : public dd::v1::DualDecoder::Service {
 public:
  explicit RouterService(const RouterOptions& options);
  ~RouterService() override;

  WorkerRegistry& registry() { return registry_; }
  // The etcd registry (docs/decisions/0051-registry-on-etcd.md): follows the workers' records
  // and the router replicas under `registry.prefix`, and registers this replica (reachable at
  // `address`) among them. Per-tenant in-flight limits become this replica's share.
  void FollowRegistry(const RegistryConfig& registry, const std::string& address);
  int64_t replicas() const { return std::max<int64_t>(1, replicas_.load()); }
  int64_t pools() const { return pools_.load(); }  // KV pools registered (etcd registry)
  double registry_lag_seconds() const { return registry_lag_ms_.load() / 1e3; }
  int64_t registry_resyncs() const;
  dd::worker::v1::Registry::Service* registry_service() { return registry_service_.get(); }
  // Adds the router metrics (dd_requests_total{code}, dd_queue_depth, dd_router_inflight,
  // dd_router_resumes_total, dd_router_reconnects_total, dd_worker_up{worker}) to an exposer.
  void RegisterMetrics(MetricsServer& exposer);

  grpc::Status Generate(grpc::ServerContext* ctx, const dd::v1::GenerateRequest* req,
                        grpc::ServerWriter<dd::v1::GenerateResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* ctx, const dd::v1::CancelRequest* req,
                      dd::v1::CancelResponse* resp) override;
  grpc::Status Health(grpc::ServerContext*, const dd::v1::HealthRequest*, dd::v1::HealthResponse*) override;
  grpc::Status ListModels(grpc::ServerContext*, const dd::v1::ListModelsRequest*, dd::v1::ListModelsResponse*) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const dd::v1::ListWorkersRequest*,
                           dd::v1::ListWorkersResponse*) override;
  grpc::Status Stats(grpc::ServerContext*, const dd::v1::StatsRequest*, dd::v1::StatsResponse*) override;

  // INVALID_ARGUMENT naming the field for a request no worker should see.
  absl::Status Validate(const dd::v1::GenerateRequest& req) const;
  // INVALID_ARGUMENT naming the field for a bad reconnect (resume_from_index set).
  absl::Status ValidateReconnect(const dd::v1::GenerateRequest& req) const;

 private:
  struct WorkerStream;
  // What one Generate call relays.
  struct Relayed {
    dd::v1::GenerateRequest req;  // request_id: the id the workers know it by
    std::string client_id;        // the id the client knows it by
    bool kept = false;            // the client named it: workers keep its stream for a reconnect
    std::string tenant;           // the authenticated API tenant ("" when open); scopes prefixes
    int64_t client_has = 0;       // tokens the client already has (a reconnect)
    // A reconnect: the worker keeping the stream, and the tokens (and their text's bytes) the
    // kept stream was itself resumed from after an earlier failure.
    std::optional<Placement> attach_to;
    std::vector<int32_t> resumed_tokens;
    int64_t resumed_text_bytes = 0;
  };
  Relayed Fresh(const dd::v1::GenerateRequest& req, const std::string& tenant) const;
  // Places and streams one request, resuming it on another worker when its worker fails.
  grpc::Status Relay(grpc::ServerContext* ctx, Relayed r, grpc::ServerWriter<dd::v1::GenerateResponse>* writer);
  // A reconnect: finds the worker that keeps the stream and relays it from the client's index.
  grpc::Status Reconnect(grpc::ServerContext* ctx, const dd::v1::GenerateRequest& req, const std::string& tenant,
                         grpc::ServerWriter<dd::v1::GenerateResponse>* writer);
  void Count(grpc::StatusCode code);
  // Worker.Cancel of `request_id` on `worker`, waiting at most a second.
  void CancelOn(const Placement& worker, const std::string& request_id);
  // Takes one of the router's in-flight places and one of the tenant's (Admit; OK means the
  // caller calls Leave when done), or says whose limit is reached.
  grpc::Status Admit(const std::string& tenant);
  void Leave(const std::string& tenant);
  // The tenant's place alone (Admit's second half).
  grpc::Status AdmitTenant(const std::string& tenant);
  void ReleaseTenant(const std::string& tenant);
  void WatchCancellations();

  RouterOptions options_;
  const Clock::time_point started_ = Clock::now();
  WorkerRegistry registry_;
  std::unique_ptr<dd::worker::v1::Registry::Service> registry_service_;
  std::atomic<int64_t> inflight_{0}, queued_{0}, ok_{0}, failed_{0}, resumes_{0}, rejected_{0}, reconnects_{0};
  std::mutex tenant_mu_;
  std::map<std::string, int64_t> tenant_inflight_;
  // Worker calls to cancel when their client goes away.
  struct Watch {
    grpc::ServerContext* server;
    grpc::ClientContext* client;
  };
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::vector<Watch> watches_;
  bool stop_ = false;
  std::thread watcher_;
  std::shared_ptr<prometheus::Registry> metrics_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  std::shared_ptr<void> collectable_;
  std::atomic<int64_t> replicas_{1}, registry_lag_ms_{0}, pools_{0};
  std::unique_ptr<RegistryFollower> workers_follower_, routers_follower_, pools_follower_;
  std::unique_ptr<RegistryMembership> membership_;
};

}  // namespace dd::router
