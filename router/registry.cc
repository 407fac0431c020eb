#include "router/registry.h"

#include <cmath>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/random.h"
#include "common/secrets.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "proto/etcd_membership.h"

namespace dd::router {

absl::Status ParseWorkerRecord(const std::string& secret, const std::string& key, const RegistryRecord& value,
                               double now_unix, dd::worker::v1::RegisterRequest* r) {
  if (value.value.size() > kMaxWorkerRecordBytes) return absl::InvalidArgumentError("larger than 64 KiB");
  absl::StatusOr<std::string> json = VerifyRecord(secret, key, value.value);
  if (!json.ok()) return json.status();
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(*json, r, o).ok()) return absl::InvalidArgumentError("not JSON");
  if (absl::Status st = WorkerRegistry::Check(*r); !st.ok()) return st;
  if (!absl::EndsWith(key, "/" + r->worker_id())) {
    return absl::InvalidArgumentError(absl::StrCat("names worker '", r->worker_id(), "' under another key"));
  }
  if (!secret.empty() && !(std::abs(now_unix - r->published_unix_seconds()) <= kMaxRecordAgeSeconds)) {
    return absl::PermissionDeniedError(absl::StrCat("written ", RecordAge(now_unix - r->published_unix_seconds()),
                                                    " (a replayed record, or clocks apart)"));
  }
  if (value.lease == 0) return absl::InvalidArgumentError("held under no lease (it would never expire)");
  return absl::OkStatus();
}

absl::Status WorkerRegistry::Check(const dd::worker::v1::RegisterRequest& req) {
  if (req.worker_id().empty()) return absl::InvalidArgumentError("worker_id is empty");
  if (req.address().empty()) return absl::InvalidArgumentError("address is empty");
  for (const auto& [name, value] : {std::pair<const char*, const std::string*>{"worker_id", &req.worker_id()},
                                    {"address", &req.address()},
                                    {"model", &req.model()},
                                    {"mode", &req.mode()},
                                    {"kv_store", &req.kv_store()}}) {
    if (value->size() > kMaxFieldBytes) {
      return absl::InvalidArgumentError(absl::StrCat(name, " is ", value->size(), " bytes (at most ", kMaxFieldBytes, ")"));
    }
  }
  if (req.load().recent_prefix_keys_size() > 1024) {
    return absl::InvalidArgumentError("load.recent_prefix_keys holds more than 1024 keys");
  }
  return absl::OkStatus();
}

void WorkerRegistry::Apply(const dd::worker::v1::RegisterRequest& req, Entry& e) {
  if (e.info.address() != req.address() || !e.stub) {
    e.stub = dd::worker::v1::Worker::NewStub(grpc::CreateChannel(req.address(), credentials_));
  }
  e.info = req;
  e.load = req.load();
  e.last_seen = Clock::now();
  e.marked_down = false;
  for (uint64_t key : req.load().recent_prefix_keys()) Affine(key, req.worker_id());
}

void WorkerRegistry::Affine(uint64_t prefix_key, const std::string& worker_id) {
  if (prefix_key == 0) return;
  if (affinity_.size() > 4096 && !affinity_.count(prefix_key)) affinity_.erase(affinity_.begin());
  affinity_[prefix_key] = worker_id;
}

absl::Status WorkerRegistry::Upsert(const dd::worker::v1::RegisterRequest& record) {
  if (absl::Status st = Check(record); !st.ok()) return st;
  std::lock_guard<std::mutex> lk(mu_);
  if (workers_.count(record.worker_id()) == 0 && workers_.size() >= max_workers_) {
    return absl::ResourceExhaustedError(absl::StrCat("the router already knows ", workers_.size(), " workers"));
  }
  Apply(record, workers_[record.worker_id()]);
  return absl::OkStatus();
}

void WorkerRegistry::Remove(const std::string& worker_id) {
  std::lock_guard<std::mutex> lk(mu_);
  workers_.erase(worker_id);
}

void WorkerRegistry::Reset(const std::vector<dd::worker::v1::RegisterRequest>& records) {
  std::lock_guard<std::mutex> lk(mu_);
  std::set<std::string> listed;
  for (const auto& r : records) {
    if (!Check(r).ok() || (workers_.count(r.worker_id()) == 0 && workers_.size() >= max_workers_)) continue;
    listed.insert(r.worker_id());
    Apply(r, workers_[r.worker_id()]);
  }
  for (auto it = workers_.begin(); it != workers_.end();) {
    it = listed.count(it->first) ? std::next(it) : workers_.erase(it);
  }
}

absl::StatusOr<std::string> WorkerRegistry::Register(const dd::worker::v1::RegisterRequest& req) {
  if (absl::Status st = Check(req); !st.ok()) return st;
  std::lock_guard<std::mutex> lk(mu_);
  if (workers_.count(req.worker_id()) == 0) {
    Purge(Clock::now());
    if (workers_.size() >= max_workers_) {
      return absl::ResourceExhaustedError(absl::StrCat("the router already knows ", workers_.size(),
                                                       " workers (its limit); none has been silent long enough to forget"));
    }
  }
  Entry& e = workers_[req.worker_id()];
  if (e.stub && Up(e, Clock::now()) && e.info.address() != req.address()) {
    return absl::AlreadyExistsError(absl::StrCat("worker id '", req.worker_id(), "' is held by a worker at ",
                                                 e.info.address(), " that is up; pick another --worker_id"));
  }
  Apply(req, e);
  e.lease = RandomHex(2);
  return e.lease;
}

void WorkerRegistry::Purge(Clock::time_point now) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->second.inflight == 0 && now - it->second.last_seen > forget_after_) {
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

bool WorkerRegistry::Heartbeat(const dd::worker::v1::HeartbeatRequest& req) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = workers_.find(req.worker_id());
  if (it == workers_.end() || !SecretEquals(it->second.lease, req.lease())) return false;
  if (req.load().recent_prefix_keys_size() > 1024) return false;
  it->second.load = req.load();
  for (uint64_t key : req.load().recent_prefix_keys()) Affine(key, req.worker_id());
  it->second.last_seen = Clock::now();
  it->second.marked_down = false;
  return true;
}

void WorkerRegistry::MarkDown(const std::string& worker_id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) it->second.marked_down = true;
}

void WorkerRegistry::MarkDraining(const std::string& worker_id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) it->second.load.set_draining(true);
}

absl::StatusOr<Placement> WorkerRegistry::Pick(const std::string& model, const std::set<std::string>& exclude,
                                               uint64_t prefix_key) {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  bool any_up = false, model_known = model.empty(), any_candidate = false, any_draining = false;
  Entry* best = nullptr;
  std::string best_id;
  auto key = [](const Entry& e) {
    return std::make_tuple(e.inflight, e.load.active_tokens(), -e.load.free_device_memory_bytes());
  };
  for (auto& [id, e] : workers_) {
    model_known |= e.info.model() == model;
    if (!Up(e, now)) continue;
    any_up = true;
    if (!model.empty() && e.info.model() != model) continue;
    if (e.load.draining()) {  // shutting down: finishing its requests, taking no new ones
      any_draining = true;
      continue;
    }
    if (exclude.count(id)) continue;
    any_candidate = true;
    const int32_t capacity = e.load.max_batch() + e.load.max_waiting();
    if (e.inflight >= capacity) continue;
    if (best == nullptr || key(e) < key(*best)) {
      best = &e;
      best_id = id;
    }
  }
  if (!any_up) return absl::UnavailableError("no decode worker is up");
  if (!model_known) {
    std::set<std::string> served;
    for (const auto& [id, e] : workers_) served.insert(e.info.model());
    return absl::InvalidArgumentError(
        absl::StrCat("model: unknown model '", model, "' (served: ", absl::StrJoin(served, ", "), ")"));
  }
  if (!any_candidate && any_draining) {
    return absl::UnavailableError("every decode worker for this model is draining (shutting down); retry later");
  }
  if (!any_candidate) return absl::UnavailableError(absl::StrCat("no live decode worker serves model '", model, "'"));
  if (best == nullptr) {
    return absl::ResourceExhaustedError("every decode worker is at capacity (batch and queue full); retry later");
  }
  // Prefix locality: the worker that served the same prefix keeps it if it is nearly as idle.
  if (auto it = affinity_.find(prefix_key); prefix_key != 0 && it != affinity_.end() && it->second != best_id) {
    auto w = workers_.find(it->second);
    if (w != workers_.end() && Up(w->second, now) && !exclude.count(w->first) && !w->second.load.draining() &&
        (model.empty() || w->second.info.model() == model) &&
        w->second.inflight < w->second.load.max_batch() + w->second.load.max_waiting() &&
        w->second.inflight <= best->inflight + 1) {
      best = &w->second;
      best_id = w->first;
    }
  }
  Affine(prefix_key, best_id);
  ++best->inflight;
  return Placement{best_id, best->stub};
}

void WorkerRegistry::Done(const std::string& worker_id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end() && it->second.inflight > 0) --it->second.inflight;
}

std::vector<Placement> WorkerRegistry::UpWorkers() const {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  std::vector<Placement> out;
  for (const auto& [id, e] : workers_) {
    if (Up(e, now)) out.push_back({id, e.stub});
  }
  return out;
}

void WorkerRegistry::Hold(const std::string& worker_id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) ++it->second.inflight;
}

std::vector<dd::v1::WorkerInfo> WorkerRegistry::Snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  std::vector<dd::v1::WorkerInfo> out;
  for (const auto& [id, e] : workers_) {
    dd::v1::WorkerInfo w;
    w.set_worker_id(id);
    w.set_address(e.info.address());
    w.set_model(e.info.model());
    w.set_mode(e.info.mode());
    w.set_up(Up(e, now));
    w.set_seconds_since_heartbeat(std::chrono::duration<double>(now - e.last_seen).count());
    w.set_active_requests(e.load.active_requests());
    w.set_waiting_requests(e.load.waiting_requests());
    w.set_active_tokens(e.load.active_tokens());
    w.set_free_device_memory_bytes(e.load.free_device_memory_bytes());
    w.set_capacity(e.load.max_batch() + e.load.max_waiting());
    w.set_router_inflight(e.inflight);
    w.set_kv_store(e.info.kv_store());
    out.push_back(std::move(w));
  }
  return out;
}

std::vector<dd::v1::ModelInfo> WorkerRegistry::Models() const {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  std::map<std::string, dd::v1::ModelInfo> models;
  for (const auto& [id, e] : workers_) {
    if (!Up(e, now)) continue;
    dd::v1::ModelInfo& m = models[e.info.model()];
    m.set_name(e.info.model());
    m.set_context_tokens(e.info.context_tokens());
    m.set_workers(m.workers() + 1);
    bool have = false;
    for (const std::string& mode : m.modes()) have |= mode == e.info.mode();
    if (!have) m.add_modes(e.info.mode());
  }
  std::vector<dd::v1::ModelInfo> out;
  for (auto& [name, m] : models) out.push_back(std::move(m));
  return out;
}

int WorkerRegistry::workers_up() const {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  int n = 0;
  for (const auto& [id, e] : workers_) n += Up(e, now) ? 1 : 0;
  return n;
}

int64_t WorkerRegistry::capacity() const {
  std::lock_guard<std::mutex> lk(mu_);
  const Clock::time_point now = Clock::now();
  int64_t n = 0;
  for (const auto& [id, e] : workers_) {
    if (Up(e, now) && !e.load.draining()) n += int64_t{e.load.max_batch()} + e.load.max_waiting();
  }
  return n;
}

}  // namespace dd::router
