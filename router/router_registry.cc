// RouterService's side of the etcd registry (docs/decisions/0051-registry-on-etcd.md): it
// follows the workers' records and the router replicas, and registers this replica.
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "common/random.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "proto/pool_record.h"
#include "router/router_service.h"

namespace dd::router {

using Wall = std::chrono::system_clock;

namespace {

// Follows `prefix` and keeps in `count` how many of its keys hold a record `valid` accepts.
std::unique_ptr<RegistryFollower> CountingFollower(ClusterRegistry& registry, const std::string& prefix,
                                                   std::atomic<int64_t>* count,
                                                   std::function<bool(const std::string&, const RegistryRecord&)> valid) {
  auto keys = std::make_shared<std::pair<std::mutex, std::set<std::string>>>();
  RegistryFollower::Handler h;
  h.reset = [keys, valid, count](const std::map<std::string, RegistryRecord>& values) {
    std::lock_guard<std::mutex> lk(keys->first);
    keys->second.clear();
    for (const auto& [key, value] : values) {
      if (valid(key, value) && keys->second.size() < 1024) keys->second.insert(key);
    }
    *count = static_cast<int64_t>(keys->second.size());
  };
  h.put = [keys, valid, count](const std::string& key, const RegistryRecord& value) {
    std::lock_guard<std::mutex> lk(keys->first);
    if (valid(key, value) && keys->second.size() < 1024) keys->second.insert(key);
    else keys->second.erase(key);
    *count = static_cast<int64_t>(keys->second.size());
  };
  h.erase = [keys, count](const std::string& key) {
    std::lock_guard<std::mutex> lk(keys->first);
    keys->second.erase(key);
    *count = static_cast<int64_t>(keys->second.size());
  };
  return registry.Follow(prefix, std::move(h));
}

}  // namespace

void RouterService::FollowRegistry(const RegistryConfig& registry, const std::string& address) {
  registry_.set_external_liveness(true);
  const std::string workers = registry.prefix + "workers/";
  auto note_lag = [this](const dd::worker::v1::RegisterRequest& r) {
    if (r.published_unix_seconds() <= 0) return;
    const double now = std::chrono::duration<double>(Wall::now().time_since_epoch()).count();
    registry_lag_ms_ = std::max<int64_t>(0, static_cast<int64_t>((now - r.published_unix_seconds()) * 1e3));
  };
  // A bad record is logged once per key (workers rewrite theirs every heartbeat).
  auto refused = std::make_shared<std::pair<std::mutex, std::set<std::string>>>();
  auto parse = [this, refused](const std::string& key, const RegistryRecord& value,
                               dd::worker::v1::RegisterRequest* r) {
    const double now = std::chrono::duration<double>(Wall::now().time_since_epoch()).count();
    const absl::Status st = ParseWorkerRecord(options_.cluster_secret, key, value, now, r);
    std::lock_guard<std::mutex> lk(refused->first);
    if (st.ok()) {
      refused->second.erase(key);
    } else if (refused->second.size() < 4096 && refused->second.insert(key).second) {
      LOG(WARNING) << "registry: ignoring the worker record at " << absl::CHexEscape(key) << ": " << st.message();
    }
    return st.ok();
  };
  RegistryFollower::Handler w;
  w.reset = [this, parse](const std::map<std::string, RegistryRecord>& values) {
    std::vector<dd::worker::v1::RegisterRequest> records;
    for (const auto& [key, value] : values) {
      dd::worker::v1::RegisterRequest r;
      if (parse(key, value, &r)) records.push_back(std::move(r));
    }
    registry_.Reset(records);
    LOG(INFO) << "registry: " << records.size() << " workers listed in etcd";
  };
  w.put = [this, note_lag, parse](const std::string& key, const RegistryRecord& value) {
    dd::worker::v1::RegisterRequest r;
    if (!parse(key, value, &r)) {
      registry_.Remove(key.substr(key.rfind('/') + 1));  // a bad record replaces a good one: the worker is gone
      return;
    }
    note_lag(r);
    if (absl::Status st = registry_.Upsert(r); !st.ok()) {
      LOG(WARNING) << "registry: refused the record at " << absl::CHexEscape(key) << ": " << st;
    }
  };
  w.erase = [this, workers](const std::string& key) {
    if (key.size() > workers.size()) registry_.Remove(key.substr(workers.size()));
  };
  workers_follower_ = registry.backend->Follow(workers, std::move(w));
  const std::string secret = options_.cluster_secret;
  // A replica counts when its record is signed for its key and held under a lease.
  routers_follower_ = CountingFollower(*registry.backend, registry.prefix + "routers/", &replicas_,
                                       [secret](const std::string& key, const RegistryRecord& v) {
                                         return v.lease != 0 && v.value.size() <= 4096 &&
                                                VerifyRecord(secret, key, v.value).ok();
                                       });
  // KV pools (proto/pool_record.h) are counted; workers find theirs themselves.
  pools_follower_ = CountingFollower(*registry.backend, registry.prefix + "pools/", &pools_,
                                     [secret](const std::string& key, const RegistryRecord& v) {
                                       const double now =
                                           std::chrono::duration<double>(Wall::now().time_since_epoch()).count();
                                       return ParsePoolRecord(secret, key, v, now).ok();
                                     });
  const std::string key = registry.prefix + "routers/" + RandomHex(1);
  const std::string record = SignRecord(options_.cluster_secret, key, nlohmann::json({{"address", address}}).dump());
  const int64_t ttl_seconds = std::max<int64_t>(2, (6 * options_.heartbeat_interval.count() + 999) / 1000);
  membership_ = registry.backend->Join(
      key, [record] { return record; }, [](const std::string&) { return false; }, options_.heartbeat_interval,
      ttl_seconds);
}

int64_t RouterService::registry_resyncs() const {
  return workers_follower_ ? workers_follower_->resyncs() + routers_follower_->resyncs() + pools_follower_->resyncs() : 0;
}

}  // namespace dd::router
