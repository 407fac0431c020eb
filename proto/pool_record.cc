#include "proto/pool_record.h"

#include <cmath>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"

namespace dd {

namespace {

constexpr double kMaxRecordAgeSeconds = 600;
constexpr size_t kMaxFieldBytes = 256;

double NowUnix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string PoolRecordJson(const PoolRecord& r) {
  return nlohmann::json({{"pool_id", r.pool_id},
                         {"address", r.address},
                         {"node", r.node},
                         {"ucx", r.ucx},
                         {"capacity_bytes", r.capacity_bytes},
                         {"published_unix_seconds", r.published_unix_seconds}})
      .dump();
}

absl::StatusOr<PoolRecord> ParsePoolRecord(const std::string& secret, const std::string& key,
                                           const RegistryRecord& value, double now_unix) {
  if (value.value.size() > kMaxPoolRecordBytes) return absl::InvalidArgumentError("larger than 4 KiB");
  absl::StatusOr<std::string> text = VerifyRecord(secret, key, value.value);
  if (!text.ok()) return text.status();
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  PoolRecord r;
  for (auto [name, out] : {std::pair{"pool_id", &r.pool_id}, {"address", &r.address}, {"node", &r.node}}) {
    auto it = j.find(name);
    if (it == j.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is missing or not a non-empty string"));
    }
    *out = it->get<std::string>();
    if (out->size() > kMaxFieldBytes) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", out->size(), " bytes (at most ", kMaxFieldBytes, ")"));
    }
  }
  if (auto it = j.find("ucx"); it != j.end()) {
    if (!it->is_boolean()) return absl::InvalidArgumentError("ucx is not a boolean");
    r.ucx = it->get<bool>();
  }
  if (auto it = j.find("capacity_bytes"); it != j.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return absl::InvalidArgumentError("capacity_bytes is not a non-negative integer");
    }
    r.capacity_bytes = it->get<int64_t>();
  }
  if (auto it = j.find("published_unix_seconds"); it != j.end() && it->is_number()) {
    r.published_unix_seconds = it->get<double>();
  }
  if (!absl::EndsWith(key, "/" + r.pool_id)) {
    return absl::InvalidArgumentError(absl::StrCat("names pool '", r.pool_id, "' under another key"));
  }
  if (!secret.empty() && !(std::abs(now_unix - r.published_unix_seconds) <= kMaxRecordAgeSeconds)) {
    return absl::PermissionDeniedError(absl::StrCat("written ", RecordAge(now_unix - r.published_unix_seconds),
                                                    " (a replayed record, or clocks apart)"));
  }
  if (value.lease == 0) return absl::InvalidArgumentError("held under no lease (it would never expire)");
  return r;
}

bool IsRegistryKvStore(const std::string& uri) { return absl::StartsWith(uri, "registry://"); }

absl::StatusOr<PoolReach> ParseRegistryKvStore(const std::string& uri) {
  if (uri == "registry://shm") return PoolReach::kShm;
  if (uri == "registry://ucx") return PoolReach::kUcx;
  return absl::InvalidArgumentError(
      absl::StrCat("kv store '", uri, "': expected registry://shm (the pool on this node) or registry://ucx"));
}

absl::StatusOr<PoolRecord> PickPool(const std::map<std::string, PoolRecord>& pools, const std::string& node,
                                    PoolReach reach) {
  const PoolRecord* local = nullptr;
  const PoolRecord* remote = nullptr;
  for (const auto& [key, r] : pools) {
    if (r.node == node) {
      if (reach == PoolReach::kUcx && !r.ucx) continue;
      if (!local || std::tie(r.published_unix_seconds, r.pool_id) > std::tie(local->published_unix_seconds, local->pool_id)) {
        local = &r;
      }
    } else if (reach == PoolReach::kUcx && r.ucx) {
      if (!remote || r.capacity_bytes > remote->capacity_bytes ||
          (r.capacity_bytes == remote->capacity_bytes && r.pool_id < remote->pool_id)) {
        remote = &r;
      }
    }
  }
  if (local) return *local;
  if (remote) return *remote;
  return absl::NotFoundError(absl::StrCat(pools.size(), " pools registered, none ",
                                          reach == PoolReach::kShm ? "on node '" + node + "' (shm:// reaches only those)"
                                                                   : "that serves ucx://"));
}

PoolLocator::PoolLocator(const RegistryConfig& registry, std::string secret, std::string node, PoolReach reach)
    : secret_(std::move(secret)), node_(std::move(node)), reach_(reach) {
  RegistryFollower::Handler h;
  h.reset = [this](const std::map<std::string, RegistryRecord>& values) {
    std::lock_guard<std::mutex> lk(mu_);
    pools_.clear();
    refused_.clear();
    for (const auto& [key, value] : values) ApplyLocked(key, value);
    cv_.notify_all();
  };
  h.put = [this](const std::string& key, const RegistryRecord& value) {
    std::lock_guard<std::mutex> lk(mu_);
    ApplyLocked(key, value);
    cv_.notify_all();
  };
  h.erase = [this](const std::string& key) {
    std::lock_guard<std::mutex> lk(mu_);
    pools_.erase(key);
    refused_.erase(key);
  };
  follower_ = registry.backend->Follow(registry.prefix + "pools/", std::move(h));
}

PoolLocator::~PoolLocator() { follower_.reset(); }

void PoolLocator::ApplyLocked(const std::string& key, const RegistryRecord& value) {
  constexpr size_t kMaxKeys = 4096;  // records under the prefix that are kept (or remembered as refused)
  absl::StatusOr<PoolRecord> r = ParsePoolRecord(secret_, key, value, NowUnix());
  if (r.ok()) {
    refused_.erase(key);
    if (pools_.size() < kMaxKeys || pools_.count(key)) pools_[key] = *std::move(r);
    return;
  }
  pools_.erase(key);
  // Records are rewritten every interval: a bad one is logged when it first appears or changes.
  auto it = refused_.find(key);
  if (it != refused_.end() && it->second == r.status().message()) return;
  if (it == refused_.end() && refused_.size() >= kMaxKeys) return;
  LOG(WARNING) << "registry: ignoring the pool record at " << absl::CHexEscape(key) << ": " << r.status().message();
  refused_[key] = std::string(r.status().message());
}

absl::StatusOr<std::string> PoolLocator::LocateLocked() const {
  absl::StatusOr<PoolRecord> r = PickPool(pools_, node_, reach_);
  if (!r.ok()) {
    if (refused_.empty()) return r.status();
    const auto& [key, why] = *refused_.begin();
    return absl::Status(r.status().code(), absl::StrCat(r.status().message(), "; ", refused_.size(),
                                                        " records refused, such as ", absl::CHexEscape(key), ": ", why));
  }
  return absl::StrCat(reach_ == PoolReach::kShm ? "shm://" : "ucx://", r->address);
}

absl::StatusOr<std::string> PoolLocator::Locate() const {
  std::lock_guard<std::mutex> lk(mu_);
  return LocateLocked();
}

absl::StatusOr<std::string> PoolLocator::Wait(std::chrono::milliseconds wait,
                                              const std::function<void(int64_t)>& progress) const {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + wait;
  auto next_note = start + std::chrono::seconds(5);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    absl::StatusOr<std::string> at = LocateLocked();
    const auto now = std::chrono::steady_clock::now();
    if (at.ok() || now >= deadline) return at;
    if (now >= next_note) {
      lk.unlock();
      progress(std::chrono::duration_cast<std::chrono::seconds>(now - start).count());
      lk.lock();
      next_note = now + std::chrono::seconds(5);
      continue;
    }
    cv_.wait_until(lk, std::min(deadline, next_note));
  }
}

}  // namespace dd
