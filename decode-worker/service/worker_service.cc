#include "decode-worker/service/worker_service.h"

#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "decode-worker/model/chat_template.h"
#include "kv-pool/client/prefix_key.h"
#include "proto/cluster_auth.h"
#include "proto/request_check.h"
#include "proto/standard_services.h"

ABSL_FLAG(int64_t, drain_grace_ms, 30000,
          "On SIGTERM, how long running requests may take to finish before the server stops (new ones are "
          "refused and go to other workers meanwhile)");

namespace dd::worker {

grpc::Status ToGrpc(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

absl::Status FromGrpc(const grpc::Status& st) {
  if (st.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
}

void FillLoad(const Scheduler& scheduler, dd::worker::v1::WorkerLoad* load) {
  const SchedulerStats s = scheduler.Stats();
  load->set_active_requests(s.active);
  load->set_waiting_requests(s.waiting);
  load->set_active_tokens(s.active_tokens);
  load->set_device_memory_bytes(scheduler.engine().device_memory_bytes());
  load->set_free_device_memory_bytes(s.free_bytes);
  load->set_max_batch(scheduler.options().max_batch);
  load->set_max_waiting(scheduler.options().max_waiting);
}

absl::StatusOr<RequestSpec> WorkerService::ToSpec(const dd::worker::v1::SubmitRequest& sub) const {
  const dd::v1::GenerateRequest& req = sub.request();
  const engine::Engine& engine = scheduler_.engine();
  // The same checks as the router's: the worker may be reached without it.
  RETURN_IF_ERROR(ValidateGenerateRequest(req, scheduler_.options().max_new_tokens_limit));
  RequestSpec spec;
  spec.id = req.request_id();
  if (spec.id.empty()) return absl::InvalidArgumentError("request_id is empty");
  if (sub.tenant().size() > 256) return absl::InvalidArgumentError("tenant is longer than 256 bytes");
  spec.tenant = sub.tenant();
  if (sub.tenants() < 0) return absl::InvalidArgumentError("tenants is negative");
  spec.tenants = sub.tenants();
  spec.prefix_salt = kvpool::TenantSalt(sub.shared_prefixes() ? "" : sub.tenant());
  if (!req.model().empty() && req.model() != identity_.model) {
    return absl::InvalidArgumentError(absl::StrCat("model '", req.model(), "' is not served here (", identity_.model, ")"));
  }
  switch (req.prompt_case()) {
    case dd::v1::GenerateRequest::kText: {
      if (req.text().empty()) return absl::InvalidArgumentError("prompt: text is empty");
      const model::Tokenizer& tok = engine.tokenizer();
      spec.prompt = tok.Encode(req.text(), tok.add_bos() && !req.raw_prompt(), /*parse_special=*/true);
      break;
    }
    case dd::v1::GenerateRequest::kTokenIds:
      spec.prompt.assign(req.token_ids().ids().begin(), req.token_ids().ids().end());
      break;
    case dd::v1::GenerateRequest::kMessages: {
      ASSIGN_OR_RETURN(const model::ChatTemplate chat, model::ChatTemplateFor(engine.model()));
      std::vector<model::ChatMessage> messages;
      for (const auto& m : req.messages().messages()) messages.push_back({m.role(), m.content()});
      ASSIGN_OR_RETURN(spec.prompt, model::RenderChat(chat, engine.tokenizer(), messages));
      break;
    }
    default:
      return absl::InvalidArgumentError("prompt: give text or token_ids");
  }
  if (spec.prompt.empty()) return absl::InvalidArgumentError("prompt: no tokens");
  for (int32_t t : sub.resume_tokens()) {
    spec.prompt.push_back(t);
    spec.resumed.push_back(t);
  }
  spec.resumed_text_bytes = sub.resume_text_bytes();
  spec.max_new_tokens = req.has_max_new_tokens() ? req.max_new_tokens() : 128;
  spec.sampling.temperature = req.sampling().temperature();
  spec.sampling.top_k = req.sampling().top_k();
  spec.sampling.top_p = req.sampling().top_p() == 0 ? 1.0f : req.sampling().top_p();
  spec.sampling.seed = req.sampling().seed();
  spec.sampling.min_p = req.sampling().min_p();
  spec.sampling.repetition_penalty = req.sampling().repetition_penalty() == 0 ? 1.0f : req.sampling().repetition_penalty();
  spec.sampling.frequency_penalty = req.sampling().frequency_penalty();
  spec.sampling.presence_penalty = req.sampling().presence_penalty();
  spec.stop_strings.assign(req.stop().begin(), req.stop().end());
  spec.stop_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
  spec.stop_at_eos = !req.ignore_eos();
  if (sub.arrival_unix_seconds() > 0) {
    const double ago = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
                       sub.arrival_unix_seconds();
    if (ago > 0 && ago < 3600) {
      spec.arrival = Clock::now() - std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(ago));
    }
  }
  return spec;
}

namespace {

dd::v1::GenerateResponse ToResponse(StreamEvent& e, const std::string& id, const WorkerIdentity& identity) {
  dd::v1::GenerateResponse resp;
  for (int32_t t : e.tokens) resp.add_token_ids(t);
  resp.set_text(std::move(e.text));
  resp.set_first_token_index(e.first_index);
  if (e.final) {
    dd::v1::Usage* u = resp.mutable_usage();
    u->set_request_id(id);
    u->set_prompt_tokens(e.prompt_tokens);
    u->set_completion_tokens(e.completion_tokens);
    u->set_stop_reason(e.stop_reason);
    u->set_ttft_seconds(e.ttft_s);
    u->set_tpot_seconds(e.tpot_s);
    u->set_prefetch_hit_rate(e.hit_rate);
    u->set_worker_id(identity.worker_id);
    u->set_prefix_reused_tokens(e.prefix_reused_tokens);
    u->set_mode(identity.mode);
    u->set_kv_dtype(identity.kv_dtype);
    u->set_kv_prefetch_bytes(e.kv_prefetch_bytes);
    u->set_kv_urgent_bytes(e.kv_urgent_bytes);
    u->set_kv_wasted_bytes(e.kv_wasted_bytes);
    u->set_kv_device_bytes(e.kv_device_bytes);
    u->set_full_kv_device_bytes(e.full_kv_device_bytes);
    u->set_kv_reconstructed_chunks(e.kv_reconstructed_chunks);
    u->set_kv_key_bytes_saved(e.kv_key_bytes_saved);
    u->set_landmark_device_bytes(e.landmark_device_bytes);
    u->set_low_rank_key_device_bytes(e.low_rank_key_device_bytes);
  }
  return resp;
}

// The caller's deadline passed: the request ends with it, kept or not.
bool PastDeadline(const grpc::ServerContext* ctx) {
  return ctx->deadline() != std::chrono::system_clock::time_point::max() &&
         std::chrono::system_clock::now() >= ctx->deadline();
}

}  // namespace

grpc::Status WorkerService::Submit(grpc::ServerContext* ctx, const dd::worker::v1::SubmitRequest* req,
                                   grpc::ServerWriter<dd::v1::GenerateResponse>* writer) {
  if (grpc::Status auth = CheckClusterSecret(ctx, secret_); !auth.ok()) return auth;
  if (draining()) {
    ctx->AddTrailingMetadata(kDrainingTrailer, "1");  // the router picks another worker
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker is draining (shutting down); retry elsewhere");
  }
  if (req->client_request_id().size() > kMaxClientRequestIdBytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "client_request_id is longer than 256 bytes");
  }
  absl::StatusOr<RequestSpec> spec = ToSpec(*req);
  if (!spec.ok()) return ToGrpc(spec.status());
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    spec->deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(deadline - std::chrono::system_clock::now());
  }
  const std::string id = spec->id;
  absl::StatusOr<std::shared_ptr<RequestStream>> stream = scheduler_.Submit(*std::move(spec));
  if (!stream.ok()) return ToGrpc(stream.status());
  if (req->prefix_key() != 0) {
    std::lock_guard<std::mutex> lk(keys_mu_);
    recent_keys_.erase(std::remove(recent_keys_.begin(), recent_keys_.end(), req->prefix_key()), recent_keys_.end());
    recent_keys_.push_back(req->prefix_key());
    if (recent_keys_.size() > 64) recent_keys_.pop_front();
  }
  // Kept: the output is logged and the request outlives its caller for the grace window.
  std::shared_ptr<KeptStream> kept;
  if (keeper_.enabled() && !req->client_request_id().empty()) {
    kept = std::make_shared<KeptStream>(*req);
    kept->AddReader();
    keeper_.Keep(req->tenant(), req->client_request_id(), kept);
  }
  bool caller = true;  // the caller still reads this call
  auto end = [&](const grpc::Status& st) {
    if (kept) kept->Finish(st);
    return caller ? st : grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
  };
  auto lose_caller = [&] {
    caller = false;
    if (kept && !PastDeadline(ctx)) {
      kept->RemoveReader();
      return false;
    }
    scheduler_.Cancel(id);
    return true;
  };
  for (;;) {
    if (caller && ctx->IsCancelled() && lose_caller()) {
      return end(grpc::Status(grpc::StatusCode::CANCELLED, "request cancelled by the caller"));
    }
    if (!caller && !kept->Wanted(keeper_.grace())) {  // nobody came back within the grace
      scheduler_.Cancel(id);
      keeper_.Forget(req->tenant(), req->client_request_id(), kept.get());
      return end(grpc::Status(grpc::StatusCode::CANCELLED, "no caller came back within --stream_grace_ms"));
    }
    for (StreamEvent& e : (*stream)->Wait(std::chrono::milliseconds(50))) {
      if (e.final && !e.status.ok()) {
        // Cancelled on purpose (Worker.Cancel: the router moved the stream elsewhere, or its
        // deadline passed): nothing to reconnect to here.
        if (kept && absl::IsCancelled(e.status)) keeper_.Forget(req->tenant(), req->client_request_id(), kept.get());
        return end(ToGrpc(e.status));
      }
      const bool final = e.final;
      dd::v1::GenerateResponse resp = ToResponse(e, id, identity_);
      if (kept) kept->Append(resp);
      if (caller && !writer->Write(resp) && lose_caller()) {
        return end(grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away"));
      }
      if (final) return end(grpc::Status::OK);
    }
  }
}

void WorkerService::AddRecentPrefixKeys(dd::worker::v1::WorkerLoad* load) const {
  std::lock_guard<std::mutex> lk(keys_mu_);
  for (uint64_t k : recent_keys_) load->add_recent_prefix_keys(k);
}

dd::worker::v1::RegisterRequest WorkerService::Record() const {
  dd::worker::v1::RegisterRequest req;
  req.set_worker_id(identity_.worker_id);
  req.set_address(identity_.address);
  req.set_model(identity_.model);
  req.set_mode(identity_.mode);
  req.set_context_tokens(scheduler_.engine().config().n_ctx_train);
  req.set_kv_store(identity_.kv_store);
  FillLoad(scheduler_, req.mutable_load());
  req.mutable_load()->set_draining(draining());
  AddRecentPrefixKeys(req.mutable_load());
  return req;
}

grpc::Status WorkerService::Attach(grpc::ServerContext* ctx, const dd::worker::v1::AttachRequest* req,
                                   grpc::ServerWriter<dd::worker::v1::AttachResponse>* writer) {
  if (grpc::Status auth = CheckClusterSecret(ctx, secret_); !auth.ok()) return auth;
  std::shared_ptr<KeptStream> kept = keeper_.Find(req->tenant(), req->client_request_id());
  if (!kept) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "this worker keeps no stream with that request id for the tenant");
  }
  kept->AddReader();
  struct Leave {
    KeptStream& s;
    ~Leave() { s.RemoveReader(); }
  } leave{*kept};
  dd::worker::v1::AttachResponse first;
  *first.mutable_submitted() = kept->submitted();
  if (!writer->Write(first)) return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
  for (size_t i = 0;;) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
    dd::worker::v1::AttachResponse out;
    grpc::Status end;
    switch (kept->Wait(i, std::chrono::milliseconds(50), out.mutable_response(), &end)) {
      case KeptStream::Next::kTimeout:
        continue;
      case KeptStream::Next::kEnd:
        return end;
      case KeptStream::Next::kMessage:
        ++i;
        if (!writer->Write(out)) return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
    }
  }
}

grpc::Status WorkerService::Cancel(grpc::ServerContext* ctx, const dd::worker::v1::CancelRequest* req,
                                   dd::worker::v1::CancelResponse* resp) {
  if (grpc::Status auth = CheckClusterSecret(ctx, secret_); !auth.ok()) return auth;
  if (req->client_request_id().empty()) {
    resp->set_found(scheduler_.Cancel(req->request_id()));
    return grpc::Status::OK;
  }
  // A client's named stream: cancelled if it still runs, and its log forgotten either way.
  std::shared_ptr<KeptStream> kept = keeper_.Find(req->tenant(), req->client_request_id());
  if (kept != nullptr) {
    (void)scheduler_.Cancel(kept->submitted().request().request_id());
    keeper_.Forget(req->tenant(), req->client_request_id(), kept.get());
  }
  resp->set_found(kept != nullptr);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Stats(grpc::ServerContext* ctx, const dd::worker::v1::WorkerStatsRequest*,
                                  dd::worker::v1::WorkerStats* resp) {
  if (grpc::Status auth = CheckClusterSecret(ctx, secret_); !auth.ok()) return auth;
  const SchedulerStats s = scheduler_.Stats();
  resp->set_worker_id(identity_.worker_id);
  FillLoad(scheduler_, resp->mutable_load());
  resp->set_reserved_device_bytes(s.reserved_bytes);
  resp->set_kv_bytes(s.kv_bytes);
  resp->set_decode_tokens_total(s.decode_tokens);
  resp->set_requests_finished(s.finished);
  resp->set_requests_cancelled(s.cancelled);
  resp->set_requests_failed(s.failed);
  resp->set_requests_rebuilt(s.rebuilt);
  resp->set_prefetch_hit_rate(s.hit_rate);
  resp->set_steps(s.steps);
  return grpc::Status::OK;
}

Heartbeater::Heartbeater(const std::string& router, const WorkerService& service, const Scheduler& scheduler,
                         std::chrono::milliseconds interval, std::shared_ptr<grpc::ChannelCredentials> credentials)
    : stub_(dd::worker::v1::Registry::NewStub(grpc::CreateChannel(router, std::move(credentials)))),
      service_(service),
      scheduler_(scheduler),
      interval_(interval) {
  thread_ = std::thread([this] { Loop(); });
}

Heartbeater::~Heartbeater() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Heartbeater::Loop() {
  bool registered = false;
  bool warned = false;
  std::string lease;  // this registration's (RegisterResponse.lease)
  for (;;) {
    const WorkerIdentity& id = service_.identity();
    grpc::ClientContext ctx;
    AttachClusterSecret(&ctx, service_.cluster_secret());
    ctx.set_deadline(std::chrono::system_clock::now() + std::max(interval_, std::chrono::milliseconds(1000)));
    grpc::Status st;
    if (!registered) {
      const dd::worker::v1::RegisterRequest req = service_.Record();
      dd::worker::v1::RegisterResponse resp;
      st = stub_->Register(&ctx, req, &resp);
      registered = st.ok();
      if (st.ok()) {
        lease = resp.lease();
        LOG(INFO) << "registered with the router as " << id.worker_id;
        warned = false;
      }
    } else {
      dd::worker::v1::HeartbeatRequest req;
      req.set_worker_id(id.worker_id);
      req.set_lease(lease);
      FillLoad(scheduler_, req.mutable_load());
      req.mutable_load()->set_draining(service_.draining());
      service_.AddRecentPrefixKeys(req.mutable_load());
      dd::worker::v1::HeartbeatResponse resp;
      st = stub_->Heartbeat(&ctx, req, &resp);
      if (st.ok() && !resp.known()) registered = false;  // the router restarted: register again
      if (!st.ok()) registered = false;
    }
    if (!st.ok() && !warned) {
      if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
        LOG(ERROR) << "the router refused this worker (UNAUTHENTICATED: " << st.error_message()
                   << "); check --cluster_secret_file; retrying every " << interval_.count() << " ms";
      } else if (st.error_code() == grpc::StatusCode::ALREADY_EXISTS) {
        LOG(ERROR) << "the router refused this worker: " << st.error_message() << "; retrying every "
                   << interval_.count() << " ms";
      } else {
        LOG(WARNING) << "router unreachable (" << st.error_message() << "); retrying every " << interval_.count()
                     << " ms";
      }
      warned = true;
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (cv_.wait_for(lk, interval_, [&] { return stop_; })) return;
  }
}

int DrainWorker(WorkerService& service, const Scheduler& scheduler, grpc::Server& server,
                std::chrono::milliseconds grace) {
  service.StartDrain();
  MarkNotServing(server);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (;;) {
    const SchedulerStats s = scheduler.Stats();
    const int left = s.active + s.waiting;
    if (left == 0 || std::chrono::steady_clock::now() >= deadline) return left;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::chrono::milliseconds DrainGraceFromFlags() {
  return std::chrono::milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_drain_grace_ms)));
}

}  // namespace dd::worker
