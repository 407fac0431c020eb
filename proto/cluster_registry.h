// The cluster registry's seam (docs/decisions/0051-registry-on-etcd.md): where workers, pools and
// router replicas find each other. A member holds one key with its record while it lives; a
// follower mirrors every key under a prefix. etcd implements it (proto/etcd_membership.h); a
// Kubernetes-native backend (EndpointSlices, Leases) would implement the same two calls, and
// nothing above them (the router's view, the workers' and pools' records, their signatures and
// checks) would change.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace dd {

// A key's value and the liveness grant it is held under (an etcd lease id; 0: none, so it would
// never expire: members' records always have one, and readers refuse those that do not).
struct RegistryRecord {
  std::string value;
  int64_t lease = 0;
};

// Holds its key until destroyed; then the key goes at once (a crashed member's goes when its
// grant runs out).
class RegistryMembership {
 public:
  virtual ~RegistryMembership() = default;
};

class RegistryFollower {
 public:
  struct Handler {
    std::function<void(const std::map<std::string, RegistryRecord>&)> reset;  // a full listing
    std::function<void(const std::string& key, const RegistryRecord& value)> put;
    std::function<void(const std::string& key)> erase;
  };
  virtual ~RegistryFollower() = default;
  virtual int64_t resyncs() const = 0;  // full listings after the first
};

class ClusterRegistry {
 public:
  virtual ~ClusterRegistry() = default;
  // Holds `key` with the record `value` gives (asked again every `interval`, under a grant of
  // `ttl_seconds`). `may_take(held)`: whether the key, when another member holds it with the
  // value `held`, may be taken over (a restart of the same member); otherwise it waits until
  // that key is gone. Keeps trying while the registry is unreachable.
  virtual std::unique_ptr<RegistryMembership> Join(std::string key, std::function<std::string()> value,
                                                   std::function<bool(const std::string& held)> may_take,
                                                   std::chrono::milliseconds interval, int64_t ttl_seconds) = 0;
  // Mirrors every key under `prefix` into `handler`: a full listing first, and after any break a
  // full listing again (never from deltas alone); the last view stays while it is unreachable.
  virtual std::unique_ptr<RegistryFollower> Follow(std::string prefix, RegistryFollower::Handler handler) = 0;
};

}  // namespace dd
