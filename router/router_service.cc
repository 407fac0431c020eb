#include "router/router_service.h"

#include <cmath>
#include <functional>
#include <random>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "common/random.h"
#include "proto/cluster_auth.h"
#include "proto/request_check.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "common/metrics_server.h"
#include "prometheus/family.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace dd::router {
namespace {

using Wall = std::chrono::system_clock;

grpc::Status Err(grpc::StatusCode code, const std::string& msg) { return grpc::Status(code, msg); }

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

// Requests whose prompts start alike get the same key (prefix locality); 0 = none. `scope` is
// the tenant (empty when the API is open or the tenant shares prefixes), so where one tenant's
// request lands says nothing about what another tenant sent.
uint64_t PrefixKey(const dd::v1::GenerateRequest& req, const std::string& scope) {
  std::string head = absl::StrCat(scope.size(), ":", scope, "\n", req.model(), "\n");
  if (req.has_token_ids()) {
    const int n = std::min(req.token_ids().ids_size(), 256);
    head.append(reinterpret_cast<const char*>(req.token_ids().ids().data()), n * sizeof(int32_t));
  } else if (req.text().size() >= 1024) {
    head += req.text().substr(0, 1024);
  } else {
    return 0;  // short prompts gain nothing from locality
  }
  const uint64_t h = std::hash<std::string>()(head);
  return h == 0 ? 1 : h;
}

class RegistryService final : public dd::worker::v1::Registry::Service {
 public:
  RegistryService(WorkerRegistry& registry, std::chrono::milliseconds interval, std::string secret)
      : registry_(registry), interval_(interval), secret_(std::move(secret)) {}
  grpc::Status Register(grpc::ServerContext* ctx, const dd::worker::v1::RegisterRequest* req,
                        dd::worker::v1::RegisterResponse* resp) override {
    if (grpc::Status auth = CheckClusterSecret(ctx, secret_); !auth.ok()) {
      LOG(WARNING) << "refused a registration without the cluster secret from " << ctx->peer();
      return auth;
    }
    absl::StatusOr<std::string> lease = registry_.Register(*req);
    if (!lease.ok()) {
      LOG(WARNING) << "refused worker '" << absl::CHexEscape(req->worker_id()) << "' at '"
                   << absl::CHexEscape(req->address()) << "': " << lease.status();
      return ToGrpc(lease.status());
    }
    resp->set_lease(*lease);
    LOG(INFO) << "worker " << req->worker_id() << " at " << req->address() << " registered (" << req->model() << ", "
              << req->mode() << ")";
    resp->set_heartbeat_interval_ms(interval_.count());
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const dd::worker::v1::HeartbeatRequest* req,
                         dd::worker::v1::HeartbeatResponse* resp) override {
    if (grpc::Status auth = CheckClusterSecret(ctx, secret_); !auth.ok()) return auth;
    resp->set_known(registry_.Heartbeat(*req));
    return grpc::Status::OK;
  }

 private:
  WorkerRegistry& registry_;
  std::chrono::milliseconds interval_;
  std::string secret_;
};

class RouterCollectable : public prometheus::Collectable {
 public:
  RouterCollectable(const RouterService& s, const WorkerRegistry& r, const std::atomic<int64_t>& queued,
                    const std::atomic<int64_t>& inflight, const std::atomic<int64_t>& resumes,
                    const std::atomic<int64_t>& reconnects)
      : s_(s), r_(r), queued_(queued), inflight_(inflight), resumes_(resumes), reconnects_(reconnects) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    auto one = [](const char* name, const char* help, MetricType type, double v) {
      prometheus::MetricFamily f{name, help, type, {}};
      prometheus::ClientMetric m;
      (type == MetricType::Counter ? m.counter.value : m.gauge.value) = v;
      f.metric.push_back(m);
      return f;
    };
    std::vector<prometheus::MetricFamily> out;
    out.push_back(one("dd_queue_depth", "Requests accepted that have no first token yet", MetricType::Gauge,
                      static_cast<double>(queued_.load())));
    out.push_back(one("dd_router_inflight", "Requests the router is serving", MetricType::Gauge,
                      static_cast<double>(inflight_.load())));
    out.push_back(one("dd_router_resumes_total", "Requests moved to another worker after a failure",
                      MetricType::Counter, static_cast<double>(resumes_.load())));
    out.push_back(one("dd_router_reconnects_total",
                      "Streams a client reconnected to (resume_from_index), found on the worker that kept them",
                      MetricType::Counter, static_cast<double>(reconnects_.load())));
    out.push_back(one("dd_router_replicas", "Router replicas registered (etcd registry; 1 otherwise)",
                      MetricType::Gauge, static_cast<double>(s_.replicas())));
    out.push_back(one("dd_registry_pools", "etcd registry: KV pools registered with a valid record", MetricType::Gauge,
                      static_cast<double>(s_.pools())));
    out.push_back(one("dd_registry_lag_seconds",
                      "etcd registry: from a worker writing its record to this router applying it (the latest)",
                      MetricType::Gauge, s_.registry_lag_seconds()));
    out.push_back(one("dd_registry_resyncs_total",
                      "etcd registry: full listings after a watch broke or was compacted away", MetricType::Counter,
                      static_cast<double>(s_.registry_resyncs())));
    prometheus::MetricFamily up{"dd_worker_up", "1 while the worker heartbeats", MetricType::Gauge, {}};
    for (const dd::v1::WorkerInfo& w : r_.Snapshot()) {
      prometheus::ClientMetric m;
      m.label = {{"worker", w.worker_id()}};
      m.gauge.value = w.up() ? 1 : 0;
      up.metric.push_back(m);
    }
    out.push_back(std::move(up));
    return out;
  }

 private:
  const RouterService& s_;
  const WorkerRegistry& r_;
  const std::atomic<int64_t>&queued_, &inflight_, &resumes_, &reconnects_;
};

}  // namespace

RouterService::RouterService(const RouterOptions& options)
    : options_(options),
      registry_(options.heartbeat_timeout, options.max_workers),
      registry_service_(std::make_unique<RegistryService>(registry_, options.heartbeat_interval, options.cluster_secret)),
      metrics_(std::make_shared<prometheus::Registry>()) {
  requests_ = &prometheus::BuildCounter().Name("dd_requests_total").Help("Generate calls by final status code")
                   .Register(*metrics_);
  if (options.worker_credentials) registry_.set_channel_credentials(options.worker_credentials);
  watcher_ = std::thread([this] { WatchCancellations(); });
}

RouterService::~RouterService() {
  {
    std::lock_guard<std::mutex> lk(watch_mu_);
    stop_ = true;
  }
  watch_cv_.notify_all();
  watcher_.join();
}

void RouterService::RegisterMetrics(MetricsServer& exposer) {
  auto c = std::make_shared<RouterCollectable>(*this, registry_, queued_, inflight_, resumes_, reconnects_);
  exposer.RegisterCollectable(c);
  exposer.RegisterCollectable(metrics_);
  collectable_ = c;
}

void RouterService::Count(grpc::StatusCode code) {
  requests_->Add({{"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}}).Increment();
  (code == grpc::StatusCode::OK ? ok_ : failed_)++;
}

void RouterService::WatchCancellations() {
  std::unique_lock<std::mutex> lk(watch_mu_);
  while (!stop_) {
    for (const Watch& w : watches_) {
      if (w.server->IsCancelled()) w.client->TryCancel();
    }
    watch_cv_.wait_for(lk, std::chrono::milliseconds(20));
  }
}

// 128 bits from the OS's random source (std::random_device is getrandom on Linux, not a
// seeded generator whose state other ids would reveal): an id cannot be guessed or claimed
// ahead by another client.
std::string NewRequestId() {
  return "req-" + RandomHex(2);
}

absl::Status RouterService::Validate(const dd::v1::GenerateRequest& req) const {
  return ValidateGenerateRequest(req, options_.max_new_tokens_limit);
}

grpc::Status RouterService::Generate(grpc::ServerContext* ctx, const dd::v1::GenerateRequest* req,
                                     grpc::ServerWriter<dd::v1::GenerateResponse>* writer) {
  std::string tenant;
  grpc::Status st = options_.auth.Tenant(ctx, &tenant);
  const bool reconnect = req->has_resume_from_index();
  if (!st.ok()) {
    // Refused before anything else is looked at.
  } else if (absl::Status v = reconnect ? ValidateReconnect(*req) : Validate(*req); !v.ok()) {
    st = ToGrpc(v);
  } else if (st = Admit(tenant); st.ok()) {
    queued_++;
    st = reconnect ? Reconnect(ctx, *req, tenant, writer) : Relay(ctx, Fresh(*req, tenant), writer);
    Leave(tenant);
  }
  if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) rejected_++;
  Count(st.error_code());
  return st;
}

absl::Status RouterService::ValidateReconnect(const dd::v1::GenerateRequest& req) const {
  if (req.request_id().empty()) {
    return absl::InvalidArgumentError("resume_from_index needs the request_id the stream was started with");
  }
  if (req.resume_from_index() < 0) return absl::InvalidArgumentError("resume_from_index is negative");
  return ValidateRequestId(req.request_id());
}

grpc::Status RouterService::Admit(const std::string& tenant) {
  if (inflight_.fetch_add(1) >= options_.max_inflight) {
    inflight_--;
    return Err(grpc::StatusCode::RESOURCE_EXHAUSTED,
               absl::StrCat("router is full: ", options_.max_inflight, " requests in flight; retry later"));
  }
  grpc::Status st = AdmitTenant(tenant);
  if (!st.ok()) inflight_--;
  return st;
}

void RouterService::Leave(const std::string& tenant) {
  ReleaseTenant(tenant);
  inflight_--;
}

grpc::Status RouterService::AdmitTenant(const std::string& tenant) {
  if (tenant.empty() || tenant == "operator") return grpc::Status::OK;  // an open API; the operator
  int64_t limit = options_.auth.TenantMaxInflight(tenant);
  if (limit == 0) limit = options_.tenant_max_inflight;
  // With several router replicas, each holds its share of the limit: no replica asks another on
  // the request path, and a balancer that spreads clients evenly keeps the total at the limit.
  const int64_t replicas = this->replicas();
  if (limit == 0 && options_.auth.tenant_count() >= 2) {
    // An equal share of what is really behind the router: the workers' slots and queues (each
    // worker refuses beyond its batch + queue), never more than the router's own cap.
    const int64_t capacity = registry_.capacity();
    const int64_t total = capacity > 0 ? std::min(capacity, options_.max_inflight) : options_.max_inflight;
    limit = std::max<int64_t>(1, total / options_.auth.tenant_count());
  }
  if (limit > 0 && replicas > 1) limit = std::max<int64_t>(1, (limit + replicas - 1) / replicas);
  std::lock_guard<std::mutex> lock(tenant_mu_);
  int64_t& n = tenant_inflight_[tenant];
  if (limit > 0 && n >= limit) {
    return Err(grpc::StatusCode::RESOURCE_EXHAUSTED,
               absl::StrCat("tenant '", tenant, "' has ", n, " requests in flight, its limit (max_inflight in the API "
                            "keys file, else --tenant_max_inflight); retry later"));
  }
  ++n;
  return grpc::Status::OK;
}

void RouterService::ReleaseTenant(const std::string& tenant) {
  if (tenant.empty() || tenant == "operator") return;
  std::lock_guard<std::mutex> lock(tenant_mu_);
  if (auto it = tenant_inflight_.find(tenant); it != tenant_inflight_.end() && --it->second <= 0) {
    tenant_inflight_.erase(it);
  }
}

// One worker's stream of a request: its Submit, or an Attach to the stream it kept.
struct RouterService::WorkerStream {
  Placement place;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<dd::v1::GenerateResponse>> submit;
  std::unique_ptr<grpc::ClientReader<dd::worker::v1::AttachResponse>> attach;
  bool Read(dd::v1::GenerateResponse* r) {
    if (submit) return submit->Read(r);
    for (dd::worker::v1::AttachResponse a; attach->Read(&a);) {
      if (a.has_response()) {
        *r = std::move(*a.mutable_response());
        return true;
      }
    }
    return false;
  }
  grpc::Status Finish() { return submit ? submit->Finish() : attach->Finish(); }
};

RouterService::Relayed RouterService::Fresh(const dd::v1::GenerateRequest& in, const std::string& tenant) const {
  Relayed r;
  r.req = in;
  r.tenant = tenant;
  // The client's id names the request to that client only (it comes back in the usage, and a
  // reconnect names it with the tenant). The workers see an id this router makes for this
  // call, so no tenant's id can cancel, squat on or probe another's request, and a call can
  // cancel nothing but its own work.
  r.kept = !in.request_id().empty();
  r.client_id = r.kept ? in.request_id() : NewRequestId();
  r.req.set_request_id(NewRequestId());
  return r;
}

grpc::Status RouterService::Reconnect(grpc::ServerContext* ctx, const dd::v1::GenerateRequest& in,
                                      const std::string& tenant, grpc::ServerWriter<dd::v1::GenerateResponse>* writer) {
  dd::worker::v1::AttachRequest areq;
  areq.set_tenant(tenant);
  areq.set_client_request_id(in.request_id());
  std::string failure;  // a worker that could not be asked
  // Every worker is asked, each with a short deadline so that one that hangs cannot hold the
  // search. Where more than one keeps the stream (it moved after its worker failed, and the
  // first one lived on), the one it moved to last continues it.
  std::optional<Placement> best;
  dd::worker::v1::SubmitRequest submitted;
  const std::vector<Placement> workers = registry_.UpWorkers();
  for (const Placement& w : workers) {
    grpc::ClientContext probe;
    AttachClusterSecret(&probe, options_.cluster_secret);
    probe.set_deadline(Wall::now() + std::chrono::seconds(2));
    auto reader = w.stub->Attach(&probe, areq);
    dd::worker::v1::AttachResponse first;
    const bool found = reader->Read(&first) && first.has_submitted();
    if (found) probe.TryCancel();  // only the answer was wanted
    const grpc::Status st = reader->Finish();
    if (!found) {
      if (st.error_code() != grpc::StatusCode::NOT_FOUND) failure = absl::StrCat(w.worker_id, ": ", st.error_message());
      continue;
    }
    if (!best || first.submitted().resume_tokens_size() > submitted.resume_tokens_size()) {
      best = w;
      submitted = first.submitted();
    }
  }
  if (best) {
    registry_.Hold(best->worker_id);
    Relayed r;
    r.req = submitted.request();
    r.tenant = tenant;
    r.kept = true;
    r.client_id = in.request_id();
    r.client_has = in.resume_from_index();
    r.resumed_tokens.assign(submitted.resume_tokens().begin(), submitted.resume_tokens().end());
    r.resumed_text_bytes = submitted.resume_text_bytes();
    r.attach_to = best;
    reconnects_++;
    return Relay(ctx, std::move(r), writer);
  }
  queued_--;
  // A worker that could not answer, or a router too young to know every worker, may hold it.
  if (workers.empty() || !failure.empty() || Clock::now() - started_ < options_.heartbeat_timeout) {
    return Err(grpc::StatusCode::UNAVAILABLE,
               absl::StrCat("cannot reach every decode worker to find request '", absl::CHexEscape(in.request_id()),
                            "' yet", failure.empty() ? "" : absl::StrCat(" (", failure, ")"), "; retry"));
  }
  return Err(grpc::StatusCode::NOT_FOUND,
             absl::StrCat("no decode worker keeps a stream '", absl::CHexEscape(in.request_id()),
                          "' for this tenant: it ended, or no one reconnected within the workers' grace window"));
}

grpc::Status RouterService::Relay(grpc::ServerContext* ctx, Relayed r,
                                  grpc::ServerWriter<dd::v1::GenerateResponse>* writer) {
  const Clock::time_point arrival = Clock::now();
  const double arrival_unix = std::chrono::duration<double>(Wall::now().time_since_epoch()).count();
  const dd::v1::GenerateRequest& req = r.req;
  const std::string& tenant = r.tenant;
  const uint64_t prefix_key = PrefixKey(req, options_.auth.SharesPrefixes(tenant) ? "" : tenant);
  // Which worker served a request tells a tenant where other tenants' prompts went; only the
  // operator (and an open API, which has no tenants to tell apart) sees it unless exposed.
  const bool show_worker = options_.expose_worker_id || !options_.auth.enabled() || tenant == "operator";
  const bool reattached = r.attach_to.has_value();
  // Every token the request has produced, in order. A kept stream that had moved to its worker
  // after a failure starts after the tokens it was resumed from: they come with it.
  std::vector<int32_t> streamed = r.resumed_tokens;
  int64_t text_bytes = r.resumed_text_bytes;
  if (r.client_has < static_cast<int64_t>(streamed.size())) {
    queued_--;
    registry_.Done(r.attach_to->worker_id);
    return Err(grpc::StatusCode::OUT_OF_RANGE,
               absl::StrCat("the stream moved to another worker after token ", streamed.size(),
                            "; the text of tokens ", r.client_has, " to ", streamed.size(),
                            " is no longer kept: start the request again"));
  }
  bool first = true, told_id = reattached;
  Clock::time_point t_first{}, t_last{};
  std::set<std::string> exclude;
  int32_t resumes = 0;
  std::string refusal;  // the last worker's RESOURCE_EXHAUSTED message, if any refused
  auto unqueue = [&] {
    if (first) queued_--;
    first = false;
  };
  std::optional<Placement> attach_to = std::move(r.attach_to);
  for (;;) {
    auto w = std::make_unique<WorkerStream>();
    dd::worker::v1::SubmitRequest sub;
    if (attach_to) {
      w->place = *std::move(attach_to);
      attach_to.reset();
    } else {
      absl::StatusOr<Placement> place = registry_.Pick(req.model(), exclude, prefix_key);
      if (!place.ok()) {
        unqueue();
        if (!refusal.empty() && absl::IsUnavailable(place.status())) {
          return Err(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     absl::StrCat("every decode worker refused the request; last: ", refusal));
        }
        if (!streamed.empty() && !place.status().message().empty()) {
          return Err(grpc::StatusCode::UNAVAILABLE,
                     absl::StrCat("worker failed after ", streamed.size(),
                                  " tokens and no other worker could resume: ", place.status().message()));
        }
        return ToGrpc(place.status());
      }
      *sub.mutable_request() = req;
      for (int32_t t : streamed) sub.add_resume_tokens(t);
      sub.set_resume_text_bytes(text_bytes);
      sub.set_arrival_unix_seconds(arrival_unix);
      // Tenants that opted into shared prefixes are keyed together, unsalted (a keyed router has
      // no anonymous requests to share that namespace with).
      sub.set_tenant(tenant);
      sub.set_shared_prefixes(options_.auth.SharesPrefixes(tenant));
      sub.set_tenants(static_cast<int32_t>(options_.auth.tenant_count()));
      if (r.kept) sub.set_client_request_id(r.client_id);
      sub.set_prefix_key(prefix_key);
      w->place = *std::move(place);
    }
    AttachClusterSecret(&w->ctx, options_.cluster_secret);
    if (ctx->deadline() != Wall::time_point::max()) w->ctx.set_deadline(ctx->deadline());
    {
      // Watched before the call starts: a client that goes away ends even a call that hangs.
      std::lock_guard<std::mutex> lk(watch_mu_);
      watches_.push_back({ctx, &w->ctx});
    }
    if (sub.has_request()) {
      w->submit = w->place.stub->Submit(&w->ctx, sub);
    } else {
      dd::worker::v1::AttachRequest areq;
      areq.set_tenant(tenant);
      areq.set_client_request_id(r.client_id);
      w->attach = w->place.stub->Attach(&w->ctx, areq);
    }
    dd::v1::GenerateResponse resp;
    bool final = false, client_gone = false;
    grpc::Status relay_error;
    const size_t streamed_before = streamed.size();
    while (!final && w->Read(&resp)) {
      // Drop any token the client already has: a resumed worker starts after the tokens
      // streamed, and a reattached stream starts from its first message.
      dd::v1::GenerateResponse out;
      const int64_t from = resp.first_token_index();
      if (from < r.client_has && from + resp.token_ids_size() > r.client_has) {
        relay_error = Err(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("resume_from_index ", r.client_has, " falls inside a message (tokens ", from,
                                       " to ", from + resp.token_ids_size(), "); resume from a message's end"));
        w->ctx.TryCancel();
        break;
      }
      int64_t idx = from;
      for (int32_t t : resp.token_ids()) {
        if (idx++ >= static_cast<int64_t>(streamed.size())) {
          streamed.push_back(t);
          if (idx > r.client_has) out.add_token_ids(t);
        }
      }
      out.set_first_token_index(static_cast<int64_t>(streamed.size()) - out.token_ids_size());
      text_bytes += static_cast<int64_t>(resp.text().size());
      if (from >= r.client_has) out.set_text(std::move(*resp.mutable_text()));
      const Clock::time_point now = Clock::now();
      if (out.token_ids_size() > 0) {
        if (first) t_first = now;
        unqueue();
        t_last = now;
      }
      if (resp.has_usage()) {
        final = true;
        if (r.client_has > static_cast<int64_t>(streamed.size())) {
          relay_error = Err(grpc::StatusCode::OUT_OF_RANGE,
                            absl::StrCat("resume_from_index ", r.client_has, " is past the stream's end (",
                                         streamed.size(), " tokens)"));
          break;
        }
        *out.mutable_usage() = resp.usage();
        dd::v1::Usage* u = out.mutable_usage();
        u->set_request_id(r.client_id);
        if (!show_worker) u->clear_worker_id();
        u->set_resumes(resumes + (reattached ? 1 : 0));
        u->set_completion_tokens(static_cast<int64_t>(streamed.size()));
        if (!reattached) {  // a reattached stream keeps the worker's times, from the first arrival
          u->set_ttft_seconds(std::chrono::duration<double>(t_first - arrival).count());
          u->set_tpot_seconds(streamed.size() > 1 ? std::chrono::duration<double>(t_last - t_first).count() /
                                                        static_cast<double>(streamed.size() - 1)
                                                  : 0.0);
          if (streamed.empty()) u->set_ttft_seconds(0);
        }
      } else if (out.token_ids_size() == 0 && out.text().empty()) {
        continue;  // all of it the client has
      }
      if (!told_id) out.set_request_id(r.client_id);
      told_id = true;
      if (!writer->Write(out)) {
        client_gone = true;
        w->ctx.TryCancel();
        break;
      }
    }
    grpc::Status st = w->Finish();
    {
      std::lock_guard<std::mutex> lk(watch_mu_);
      for (auto it = watches_.begin(); it != watches_.end(); ++it) {
        if (it->client == &w->ctx) {
          watches_.erase(it);
          break;
        }
      }
    }
    registry_.Done(w->place.worker_id);
    if (!relay_error.ok()) {
      unqueue();
      return relay_error;
    }
    if (final && !client_gone) {
      unqueue();
      return grpc::Status::OK;
    }
    if (client_gone || ctx->IsCancelled()) {
      unqueue();
      // A kept stream decodes on for a reconnect (the worker cancels it after its grace window
      // with no reader); any other is cancelled now.
      if (!r.kept) CancelOn(w->place, req.request_id());
      return Err(grpc::StatusCode::CANCELLED, "request cancelled by the client");
    }
    switch (st.error_code()) {
      case grpc::StatusCode::INVALID_ARGUMENT:
      case grpc::StatusCode::FAILED_PRECONDITION:
      case grpc::StatusCode::OUT_OF_RANGE:
      case grpc::StatusCode::DEADLINE_EXCEEDED:
      case grpc::StatusCode::ALREADY_EXISTS:
      case grpc::StatusCode::CANCELLED:  // the client's Cancel of its named stream, through any replica
        unqueue();
        return st;
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        if (streamed.size() == streamed_before) {  // refused at admission: try another worker
          exclude.insert(w->place.worker_id);
          refusal = st.error_message();
          continue;
        }
        [[fallthrough]];
      default:
        // The worker died or failed mid-request: resume elsewhere from what the client has.
        LOG(WARNING) << "request '" << absl::CHexEscape(r.client_id) << "' (" << req.request_id() << ") lost worker "
                     << w->place.worker_id << " after " << streamed.size() << " tokens (" << st.error_message()
                     << "); resuming";
        if (const auto& trailers = w->ctx.GetServerTrailingMetadata();
            trailers.find(kDrainingTrailer) != trailers.end()) {
          registry_.MarkDraining(w->place.worker_id);  // refused at admission: not a failure
          exclude.insert(w->place.worker_id);
          continue;
        }
        if (streamed.size() < static_cast<size_t>(r.client_has)) {
          unqueue();  // a reattached stream lost its worker before the client's tokens came back
          return Err(grpc::StatusCode::UNAVAILABLE,
                     absl::StrCat("the worker holding the stream failed: ", st.error_message()));
        }
        if (st.error_code() == grpc::StatusCode::UNAVAILABLE) registry_.MarkDown(w->place.worker_id);
        exclude.insert(w->place.worker_id);
        if (r.kept) {
          // A worker that lost only its link to this router would keep the stream decoding for
          // its grace window, a second continuation a reconnect could find: end it there.
          CancelOn(w->place, req.request_id());
        }
        if (++resumes > options_.max_resumes) {
          unqueue();
          return Err(grpc::StatusCode::UNAVAILABLE, absl::StrCat("request failed on ", resumes, " workers; last: ",
                                                                 st.error_message()));
        }
        resumes_++;
    }
  }
}

void RouterService::CancelOn(const Placement& worker, const std::string& request_id) {
  grpc::ClientContext ctx;
  AttachClusterSecret(&ctx, options_.cluster_secret);
  ctx.set_deadline(Wall::now() + std::chrono::seconds(1));
  dd::worker::v1::CancelRequest req;
  req.set_request_id(request_id);
  dd::worker::v1::CancelResponse resp;
  (void)worker.stub->Cancel(&ctx, req, &resp);  // best effort: a worker that is gone ends it anyway
}

grpc::Status RouterService::Cancel(grpc::ServerContext* ctx, const dd::v1::CancelRequest* req,
                                   dd::v1::CancelResponse* resp) {
  std::string tenant;
  grpc::Status st = options_.auth.Tenant(ctx, &tenant);
  if (st.ok() && req->request_id().empty()) {
    st = Err(grpc::StatusCode::INVALID_ARGUMENT, "request_id is required: the id the stream was started with");
  } else if (st.ok()) {
    if (absl::Status v = ValidateRequestId(req->request_id()); !v.ok()) st = ToGrpc(v);
  }
  // A Cancel asks every worker: it counts against the router's and the tenant's in-flight limits
  // as a request does, so a flood of them cannot multiply into unbounded worker calls.
  if (st.ok() && (st = Admit(tenant)).ok()) {
    // Every worker is asked (the stream may have moved), each with a short deadline.
    dd::worker::v1::CancelRequest wreq;
    wreq.set_tenant(tenant);
    wreq.set_client_request_id(req->request_id());
    std::string failure;
    bool found = false;
    for (const Placement& w : registry_.UpWorkers()) {
      grpc::ClientContext c;
      AttachClusterSecret(&c, options_.cluster_secret);
      c.set_deadline(Wall::now() + std::chrono::seconds(2));
      dd::worker::v1::CancelResponse wr;
      const grpc::Status ws = w.stub->Cancel(&c, wreq, &wr);
      if (!ws.ok()) failure = absl::StrCat(w.worker_id, ": ", ws.error_message());
      found |= ws.ok() && wr.found();
    }
    if (!found && !failure.empty()) {
      st = Err(grpc::StatusCode::UNAVAILABLE, absl::StrCat("could not ask every decode worker for request '",
                                                           absl::CHexEscape(req->request_id()), "' (", failure,
                                                           "); retry"));
    }
    resp->set_found(found);
    Leave(tenant);
  }
  return st;
}

grpc::Status RouterService::Health(grpc::ServerContext*, const dd::v1::HealthRequest*, dd::v1::HealthResponse* resp) {
  const int up = registry_.workers_up();
  resp->set_workers_up(up);
  resp->set_serving(up > 0);
  resp->set_message(up > 0 ? absl::StrCat(up, " decode workers up") : "no decode worker is up");
  return grpc::Status::OK;
}

grpc::Status RouterService::ListModels(grpc::ServerContext* ctx, const dd::v1::ListModelsRequest*,
                                       dd::v1::ListModelsResponse* resp) {
  std::string tenant;
  if (grpc::Status auth = options_.auth.Tenant(ctx, &tenant); !auth.ok()) return auth;
  for (dd::v1::ModelInfo& m : registry_.Models()) *resp->add_models() = std::move(m);
  return grpc::Status::OK;
}

grpc::Status RouterService::ListWorkers(grpc::ServerContext* ctx, const dd::v1::ListWorkersRequest*,
                                        dd::v1::ListWorkersResponse* resp) {
  if (grpc::Status auth = options_.auth.Operator(ctx); !auth.ok()) return auth;
  for (dd::v1::WorkerInfo& w : registry_.Snapshot()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status RouterService::Stats(grpc::ServerContext* ctx, const dd::v1::StatsRequest*, dd::v1::StatsResponse* resp) {
  if (grpc::Status auth = options_.auth.Operator(ctx); !auth.ok()) return auth;
  resp->set_inflight(inflight_.load());
  resp->set_requests_ok(ok_.load());
  resp->set_requests_failed(failed_.load());
  resp->set_resumes(resumes_.load());
  resp->set_rejected_overload(rejected_.load());
  for (dd::v1::WorkerInfo& w : registry_.Snapshot()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

}  // namespace dd::router
