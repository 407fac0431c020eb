// RouterService's side of the etcd registry (docs/decisions/0051-registry-on-etcd.md): it
// follows the workers' records and the router replicas, and registers this replica.
#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "common/random.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "router/router_service.h"

namespace dd::router {

using Wall = std::chrono::system_clock;

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
  auto parse = [this, refused](const std::string& key, const EtcdClient::Held& value,
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
  EtcdFollower::Handler w;
  w.reset = [this, parse](const std::map<std::string, EtcdClient::Held>& values) {
    std::vector<dd::worker::v1::RegisterRequest> records;
    for (const auto& [key, value] : values) {
      dd::worker::v1::RegisterRequest r;
      if (parse(key, value, &r)) records.push_back(std::move(r));
    }
    registry_.Reset(records);
    LOG(INFO) << "registry: " << records.size() << " workers listed in etcd";
  };
  w.put = [this, note_lag, parse](const std::string& key, const EtcdClient::Held& value) {
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
  workers_follower_ = std::make_unique<EtcdFollower>(registry.client, workers, std::move(w));
  auto routers = std::make_shared<std::pair<std::mutex, std::set<std::string>>>();
  EtcdFollower::Handler r;
  const std::string secret = options_.cluster_secret;
  // A replica counts when its record is signed for its key and held under a lease.
  auto valid = [secret](const std::string& key, const EtcdClient::Held& v) {
    return v.lease != 0 && v.value.size() <= 4096 && VerifyRecord(secret, key, v.value).ok();
  };
  r.reset = [this, routers, valid](const std::map<std::string, EtcdClient::Held>& values) {
    std::lock_guard<std::mutex> lk(routers->first);
    routers->second.clear();
    for (const auto& [key, value] : values) {
      if (valid(key, value) && routers->second.size() < 1024) routers->second.insert(key);
    }
    replicas_ = static_cast<int64_t>(routers->second.size());
  };
  r.put = [this, routers, valid](const std::string& key, const EtcdClient::Held& value) {
    std::lock_guard<std::mutex> lk(routers->first);
    if (valid(key, value) && routers->second.size() < 1024) routers->second.insert(key);
    else routers->second.erase(key);
    replicas_ = static_cast<int64_t>(routers->second.size());
  };
  r.erase = [this, routers](const std::string& key) {
    std::lock_guard<std::mutex> lk(routers->first);
    routers->second.erase(key);
    replicas_ = static_cast<int64_t>(routers->second.size());
  };
  routers_follower_ = std::make_unique<EtcdFollower>(registry.client, registry.prefix + "routers/", std::move(r));
  const std::string key = registry.prefix + "routers/" + RandomHex(1);
  const std::string record = SignRecord(options_.cluster_secret, key, nlohmann::json({{"address", address}}).dump());
  const int64_t ttl_seconds = std::max<int64_t>(2, (6 * options_.heartbeat_interval.count() + 999) / 1000);
  membership_ = std::make_unique<EtcdMembership>(
      registry.client, key, [record] { return record; },
      [](const std::string&) { return false; }, options_.heartbeat_interval, ttl_seconds);
}

int64_t RouterService::registry_resyncs() const {
  return workers_follower_ ? workers_follower_->resyncs() + routers_follower_->resyncs() : 0;
}

}  // namespace dd::router
