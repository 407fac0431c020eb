// One decode worker assembled: engine, scheduler, metrics, gRPC service and (optionally)
// heartbeats to a router. dd-decode-worker and the embedded server (`ddctl serve`) wire it
// into their own gRPC servers.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "decode-worker/service/scheduler.h"
#include "decode-worker/service/worker_metrics.h"
#include "decode-worker/service/worker_service.h"
#include "proto/etcd_membership.h"

namespace dd::worker {

// Scheduler options from --max_batch, --max_waiting, --step_tokens, --tenant_max_pool_bytes, ...
absl::StatusOr<SchedulerOptions> SchedulerOptionsFromFlags();  // InvalidArgument names a bad flag

class WorkerNode {
 public:
  // `model` must outlive the node. Fails with the engine's error (bad options, pool unreachable).
  static absl::StatusOr<std::unique_ptr<WorkerNode>> Create(const model::LoadedModel& model,
                                                            const engine::EngineOptions& engine_options,
                                                            const SchedulerOptions& scheduler_options,
                                                            WorkerIdentity identity);
  ~WorkerNode();

  WorkerService& service() { return *service_; }
  WorkerMetrics& metrics() { return *metrics_; }
  Scheduler& scheduler() { return *scheduler_; }
  // Registers at `router` (HOST:PORT) once `service().identity().address` is final.
  void StartHeartbeats(const std::string& router, std::chrono::milliseconds interval,
                       std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials());
  // Registers in etcd instead (proto/etcd_membership.h): the worker's record, refreshed with its
  // load every `interval`, under `registry.prefix` + "workers/" + its id.
  void StartMembership(const RegistryConfig& registry, std::chrono::milliseconds interval);

 private:
  WorkerNode() = default;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<WorkerMetrics> metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<Heartbeater> heartbeater_;
  std::unique_ptr<RegistryMembership> membership_;
};

}  // namespace dd::worker
