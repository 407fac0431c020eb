// KV pools in the etcd registry (docs/decisions/0051-registry-on-etcd.md, "Pools"). A dd-kv-pool
// run with --registry etcd://... holds PREFIX/pools/ID under a lease, signed with the cluster
// secret like every record; a decode worker run with --kv_store registry://shm (or ://ucx) finds
// its pool there instead of naming an address, and looks again whenever its pool is lost, so a
// pool replaced at another address (a new pod) is found without restarting the worker.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "proto/etcd_membership.h"

namespace dd {

struct PoolRecord {
  std::string pool_id;   // the last part of its key
  std::string address;   // HOST:PORT of the pool's gRPC endpoint
  std::string node;      // the machine it runs on: workers there reach it over shm://
  bool ucx = false;      // serves ucx://
  int64_t capacity_bytes = 0;  // the sum of its tenants' quotas
  double published_unix_seconds = 0;
};

inline constexpr size_t kMaxPoolRecordBytes = 4096;

std::string PoolRecordJson(const PoolRecord& r);
// The record held at `key` (PREFIX/pools/ID): signed with `secret` for that key (when a secret is
// set), naming the key's own id, written within the last 10 minutes (no replay), held under a
// lease, with an address, a node and fields of bounded size.
absl::StatusOr<PoolRecord> ParsePoolRecord(const std::string& secret, const std::string& key,
                                           const RegistryRecord& value, double now_unix);

// How a worker reaches its pool: shm:// only to a pool on its own node; ucx:// to the pool on its
// own node when there is one, else to any pool that serves ucx://.
enum class PoolReach { kShm, kUcx };
// "registry://shm" or "registry://ucx" (the --kv_store values that find the pool in etcd).
absl::StatusOr<PoolReach> ParseRegistryKvStore(const std::string& uri);
bool IsRegistryKvStore(const std::string& uri);

// The pool a worker on `node` uses, among `pools` (valid records by key). On one node the most
// recently published record wins: a replaced pool's key outlives it by its lease's TTL. Off the
// node (ucx:// only) the largest pool, then the smallest id. NOT_FOUND says what is missing.
absl::StatusOr<PoolRecord> PickPool(const std::map<std::string, PoolRecord>& pools, const std::string& node,
                                    PoolReach reach);

// Follows PREFIX/pools/ and answers which pool a worker on `node` uses now.
class PoolLocator {
 public:
  PoolLocator(const RegistryConfig& registry, std::string secret, std::string node, PoolReach reach);
  ~PoolLocator();
  // The chosen pool's store URI (shm://HOST:PORT or ucx://HOST:PORT) from the current view.
  absl::StatusOr<std::string> Locate() const;
  // Locate(), waiting up to `wait` for a pool to register; `progress` is called about every 5 s
  // with the seconds waited so far.
  absl::StatusOr<std::string> Wait(std::chrono::milliseconds wait, const std::function<void(int64_t)>& progress) const;

 private:
  void ApplyLocked(const std::string& key, const RegistryRecord& value);  // mu_ held
  absl::StatusOr<std::string> LocateLocked() const;                          // mu_ held
  const std::string secret_, node_;
  const PoolReach reach_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::map<std::string, PoolRecord> pools_;    // mu_: the valid records
  std::map<std::string, std::string> refused_;  // mu_: the others, with the reason
  std::unique_ptr<RegistryFollower> follower_;
};

}  // namespace dd
