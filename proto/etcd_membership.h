// Cluster membership on etcd (docs/decisions/0051-registry-on-etcd.md). A member (a worker, a
// router replica, a pool) holds one key under a lease that it keeps alive, with its current
// record as the value; when the member dies, etcd drops the key once the lease runs out. A
// follower (the router) mirrors every key under a prefix: a full listing, then a watch from
// that listing's revision, and after any watch error or compaction a full listing again, so
// its view never rests on deltas alone. When etcd is unreachable both keep trying, and the
// follower keeps its last view.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "proto/cluster_registry.h"
#include "proto/etcd_client.h"

namespace dd {

// --registry (memory | etcd://HOST:PORT[,...]), --registry_prefix, --etcd_user,
// --etcd_password_file. `backend` is null for the in-memory registry (workers heartbeat one
// router).
struct RegistryConfig {
  std::string url = "memory";
  std::string prefix = "/dualdecoder/";
  std::shared_ptr<ClusterRegistry> backend;
  bool shared() const { return backend != nullptr; }
};
absl::StatusOr<RegistryConfig> RegistryFromFlags();

// Records in etcd are signed with the cluster secret (HMAC-SHA256 of the key and the record), so
// that a process that can write to etcd but does not hold the secret can neither register a
// worker (and have routers send it prompts and the secret) or a router, nor copy a member's
// record to another key: "hmac-sha256:HEX RECORD"; with no secret, RECORD alone.
std::string SignRecord(const std::string& secret, const std::string& key, const std::string& record);
// The record of `value` at `key`: PERMISSION_DENIED when `secret` is set and `value` is unsigned
// or its signature does not match. With no secret, a signed value's record is taken as is.
absl::StatusOr<std::string> VerifyRecord(const std::string& secret, const std::string& key, const std::string& value);
// How long ago a record was written, in words for an error: "700 s ago", "30 s ahead of this
// clock", or "at no valid time".
std::string RecordAge(double age_seconds);

class EtcdMembership : public RegistryMembership {
 public:
  // `value` gives the record to publish (called every interval). `may_take(held)`: whether the
  // key, when another lease holds it with the value `held`, may be taken over (a restart of the
  // same member); otherwise the member waits until that key is gone.
  EtcdMembership(std::shared_ptr<EtcdClient> client, std::string key, std::function<std::string()> value,
                 std::function<bool(const std::string& held)> may_take, std::chrono::milliseconds interval,
                 int64_t ttl_seconds);
  ~EtcdMembership() override;  // revokes the lease: the key goes at once

 private:
  void Loop();
  std::shared_ptr<EtcdClient> client_;
  std::string key_;
  std::function<std::string()> value_;
  std::function<bool(const std::string&)> may_take_;
  std::chrono::milliseconds interval_;
  int64_t ttl_seconds_;
  bool registered_ = false;  // the loop thread's own
  int64_t lease_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

class EtcdFollower : public RegistryFollower {
 public:
  // Values come with the lease they are held under (0: none; such a key never expires).
  EtcdFollower(std::shared_ptr<EtcdClient> client, std::string prefix, Handler handler);
  ~EtcdFollower() override;
  int64_t resyncs() const override { return resyncs_.load(); }

 private:
  void Loop();
  std::shared_ptr<EtcdClient> client_;
  std::string prefix_;
  Handler handler_;
  std::atomic<int64_t> resyncs_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  EtcdClient::Watch* watch_ = nullptr;  // mu_; cancelled on stop
  std::thread thread_;
};

// The registry on etcd: members under leases, followers by listing and watching.
class EtcdRegistry : public ClusterRegistry {
 public:
  explicit EtcdRegistry(std::shared_ptr<EtcdClient> client) : client_(std::move(client)) {}
  std::unique_ptr<RegistryMembership> Join(std::string key, std::function<std::string()> value,
                                           std::function<bool(const std::string& held)> may_take,
                                           std::chrono::milliseconds interval, int64_t ttl_seconds) override {
    return std::make_unique<EtcdMembership>(client_, std::move(key), std::move(value), std::move(may_take), interval,
                                            ttl_seconds);
  }
  std::unique_ptr<RegistryFollower> Follow(std::string prefix, RegistryFollower::Handler handler) override {
    return std::make_unique<EtcdFollower>(client_, std::move(prefix), std::move(handler));
  }

 private:
  std::shared_ptr<EtcdClient> client_;
};

}  // namespace dd
