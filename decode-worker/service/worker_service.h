// The decode worker's gRPC face (proto/worker.proto): Submit streams one request through the
// Scheduler, Cancel ends one by id, Stats reports load. A Heartbeater registers the worker
// with a router and reports its load; it re-registers when the router forgets it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "decode-worker/service/scheduler.h"
#include "decode-worker/service/stream_keeper.h"
#include "grpcpp/grpcpp.h"
#include "proto/worker.grpc.pb.h"

namespace dd::worker {

struct WorkerIdentity {
  std::string worker_id{};
  std::string address{};   // where the router reaches this worker
  std::string model{};     // served model name
  std::string mode{};      // decode mode
  std::string kv_dtype{};  // the KV type (KvDtypeName)
  std::string kv_store{};  // where offloaded KV lives
};

grpc::Status ToGrpc(const absl::Status& st);
absl::Status FromGrpc(const grpc::Status& st);

// Fills `load` from the scheduler.
void FillLoad(const Scheduler& scheduler, dd::worker::v1::WorkerLoad* load);

class WorkerService final : public dd::worker::v1::Worker::Service {
 public:
  static constexpr size_t kMaxClientRequestIdBytes = 256;
  // `stream_grace`: how long a request submitted with the client's id outlives its caller
  // (stream_keeper.h); 0 = not at all.
  WorkerService(Scheduler& scheduler, WorkerIdentity identity,
                std::chrono::milliseconds stream_grace = std::chrono::milliseconds(0))
      : scheduler_(scheduler),
        identity_(std::move(identity)),
        keeper_(stream_grace, static_cast<size_t>(4 * (scheduler.options().max_batch +
                                                       scheduler.options().max_waiting) + 16)) {}
  void set_address(std::string address) { identity_.address = std::move(address); }
  // Required on Submit/Cancel/Stats and shown to the router (proto/cluster_auth.h); "" = off.
  void set_cluster_secret(std::string secret) { secret_ = std::move(secret); }
  const std::string& cluster_secret() const { return secret_; }
  const WorkerIdentity& identity() const { return identity_; }
  const StreamKeeper& keeper() const { return keeper_; }
  // The prefix keys of the latest requests (SubmitRequest.prefix_key, at most 64, newest last),
  // published with the load so that every router replica places a repeated prompt here.
  void AddRecentPrefixKeys(dd::worker::v1::WorkerLoad* load) const;
  // This worker's record for a registry: identity, load, recent prefix keys.
  dd::worker::v1::RegisterRequest Record() const;
  // Draining: Submit refuses new requests (UNAVAILABLE, so the router retries elsewhere) and
  // heartbeats tell the router; requests already running finish.
  void StartDrain() { draining_.store(true, std::memory_order_release); }
  bool draining() const { return draining_.load(std::memory_order_acquire); }

  grpc::Status Submit(grpc::ServerContext* ctx, const dd::worker::v1::SubmitRequest* req,
                      grpc::ServerWriter<dd::v1::GenerateResponse>* writer) override;
  grpc::Status Attach(grpc::ServerContext* ctx, const dd::worker::v1::AttachRequest* req,
                      grpc::ServerWriter<dd::worker::v1::AttachResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* ctx, const dd::worker::v1::CancelRequest* req,
                      dd::worker::v1::CancelResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const dd::worker::v1::WorkerStatsRequest* req,
                     dd::worker::v1::WorkerStats* resp) override;

  // Turns a public request (+ resume state) into a scheduler request; INVALID_ARGUMENT names
  // the field.
  absl::StatusOr<RequestSpec> ToSpec(const dd::worker::v1::SubmitRequest& req) const;

 private:
  Scheduler& scheduler_;
  WorkerIdentity identity_;
  std::string secret_;
  std::atomic<bool> draining_{false};
  StreamKeeper keeper_;
  mutable std::mutex keys_mu_;
  std::deque<uint64_t> recent_keys_;
};

// Graceful shutdown (SIGTERM): marks the service draining and the server NOT_SERVING, then
// waits until the scheduler has no active or waiting request or `grace` passes. Returns how
// many requests were still running when it gave up (0 = drained).
int DrainWorker(WorkerService& service, const Scheduler& scheduler, grpc::Server& server,
                std::chrono::milliseconds grace);
// --drain_grace_ms (default 30 s).
std::chrono::milliseconds DrainGraceFromFlags();

// Registers with the router at `router` and sends a heartbeat with the load every interval.
class Heartbeater {
 public:
  Heartbeater(const std::string& router, const WorkerService& service, const Scheduler& scheduler,
              std::chrono::milliseconds interval,
              std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials());
  ~Heartbeater();

 private:
  void Loop();
  std::unique_ptr<dd::worker::v1::Registry::Stub> stub_;
  const WorkerService& service_;
  const Scheduler& scheduler_;
  std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dd::worker
