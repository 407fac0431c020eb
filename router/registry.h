// The router's view of its decode workers: registration, heartbeats with load, liveness and
// placement (docs/decisions/0028-router-placement-and-resume.md). Thread-safe.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "proto/etcd_client.h"
#include "proto/generate.pb.h"
#include "proto/worker.grpc.pb.h"

namespace dd::router {

using Clock = std::chrono::steady_clock;

struct Placement {
  std::string worker_id;
  std::shared_ptr<dd::worker::v1::Worker::Stub> stub;
};

// A worker's record as the etcd registry holds it (docs/decisions/0051-registry-on-etcd.md):
// at most 64 KiB, held under a lease (so it goes when its worker does), signed with `secret` for
// its key when there is one (proto/etcd_membership.h) and then written within
// kMaxRecordAgeSeconds of `now_unix` (a replayed old record is refused), JSON of a
// RegisterRequest whose fields pass WorkerRegistry::Check, under the key of its own worker id.
// The reason otherwise.
constexpr size_t kMaxWorkerRecordBytes = 64 << 10;
constexpr double kMaxRecordAgeSeconds = 600;  // workers rewrite theirs every heartbeat
absl::Status ParseWorkerRecord(const std::string& secret, const std::string& key, const RegistryRecord& value,
                               double now_unix, dd::worker::v1::RegisterRequest* r);

class WorkerRegistry {
 public:
  // A worker missing heartbeats for `timeout` is down (not placed on) until it reports again;
  // one silent for `forget_after` (default: 10 × timeout, at least a minute) with no request
  // of the router on it is forgotten. At most `max_workers` entries: a registration beyond
  // that, after the forgotten ones are purged, is RESOURCE_EXHAUSTED.
  static constexpr size_t kMaxFieldBytes = 256;  // worker_id, address, model, mode, kv_store
  explicit WorkerRegistry(std::chrono::milliseconds timeout, int max_workers = 256,
                          std::chrono::milliseconds forget_after = std::chrono::milliseconds(0))
      : timeout_(timeout),
        max_workers_(static_cast<size_t>(std::max(max_workers, 1))),
        forget_after_(forget_after.count() > 0 ? forget_after
                                               : std::max<std::chrono::milliseconds>(10 * timeout, std::chrono::minutes(1))) {}

  // How the router dials workers (plaintext unless set; proto/tls.h).
  void set_channel_credentials(std::shared_ptr<grpc::ChannelCredentials> c) { credentials_ = std::move(c); }
  // The registration's lease (heartbeats carry it). ALREADY_EXISTS when the id is held by a
  // worker that is up at another address: an id cannot be taken over while its owner
  // heartbeats (a restarted worker at the same address may register again at once).
  absl::StatusOr<std::string> Register(const dd::worker::v1::RegisterRequest& req);
  // False when the worker is unknown or the lease is not its registration's (it must register
  // again).
  bool Heartbeat(const dd::worker::v1::HeartbeatRequest& req);
  // The etcd registry (docs/decisions/0051-registry-on-etcd.md): a worker's record as it
  // published it; a worker whose key is gone; every record at once (a full listing). With
  // external liveness, a worker is up while its key exists (etcd expires it with its lease),
  // not by the heartbeat timeout, so an etcd outage keeps the last known workers.
  absl::Status Upsert(const dd::worker::v1::RegisterRequest& record);
  void Remove(const std::string& worker_id);
  void Reset(const std::vector<dd::worker::v1::RegisterRequest>& records);
  void set_external_liveness(bool on) { external_liveness_ = on; }
  // Field sizes and ids (INVALID_ARGUMENT naming the field).
  static absl::Status Check(const dd::worker::v1::RegisterRequest& req);
  // A stream to the worker broke: take it out of placement until its next heartbeat.
  void MarkDown(const std::string& worker_id);
  // The worker said it is draining (before its next heartbeat could): pick it no more.
  void MarkDraining(const std::string& worker_id);

  // Picks the worker for a request of `model` (empty = any): the up worker with room and the
  // least load (requests the router has on it, then active tokens, then most free device
  // memory); a worker that recently served a prompt with the same `prefix_key` wins when its
  // load is within one request of the best. Counts the request on it until Done().
  // UNAVAILABLE: no worker is up; INVALID_ARGUMENT: no worker ever served `model`;
  // RESOURCE_EXHAUSTED: every candidate is at capacity (batch + queue).
  absl::StatusOr<Placement> Pick(const std::string& model, const std::set<std::string>& exclude, uint64_t prefix_key);
  void Done(const std::string& worker_id);
  // The workers up, draining ones included (any of them may hold a kept stream); Hold counts
  // a request on one, as Pick does, until Done.
  std::vector<Placement> UpWorkers() const;
  void Hold(const std::string& worker_id);

  std::vector<dd::v1::WorkerInfo> Snapshot() const;
  std::vector<dd::v1::ModelInfo> Models() const;
  int workers_up() const;
  // Requests the workers up and not draining take at once: their batch + queue, summed.
  int64_t capacity() const;

 private:
  struct Entry {
    dd::worker::v1::RegisterRequest info;
    std::string lease;
    dd::worker::v1::WorkerLoad load;
    Clock::time_point last_seen;
    bool marked_down = false;
    int32_t inflight = 0;
    std::shared_ptr<dd::worker::v1::Worker::Stub> stub;
  };
  bool Up(const Entry& e, Clock::time_point now) const {
    return !e.marked_down && (external_liveness_ || now - e.last_seen <= timeout_);
  }
  // A published record into its entry; mu_ held.
  void Apply(const dd::worker::v1::RegisterRequest& record, Entry& e);
  void Affine(uint64_t prefix_key, const std::string& worker_id);  // mu_ held
  std::atomic<bool> external_liveness_{false};
  void Purge(Clock::time_point now);  // forgets long-silent idle workers; mu_ held
  std::chrono::milliseconds timeout_;
  size_t max_workers_;
  std::chrono::milliseconds forget_after_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_ = grpc::InsecureChannelCredentials();
  mutable std::mutex mu_;
  std::map<std::string, Entry> workers_;
  std::map<uint64_t, std::string> affinity_;  // prefix key → worker that last served it
};

}  // namespace dd::router
