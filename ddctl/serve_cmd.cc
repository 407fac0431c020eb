// ddctl's service commands: `serve` (the embedded server: router + one worker + in-process
// pool in one process, one port), and the clients of a router: `generate --server`, `health`,
// `stats`, `workers`.
#include <cstdio>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/random.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "ddctl/commands.h"
#include "decode-worker/service/engine_flags.h"
#include "decode-worker/service/worker_node.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "common/metrics_server.h"
#include "proto/cluster_auth.h"
#include "proto/standard_services.h"
#include "proto/tls.h"
#include "proto/generate.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "router/openai_http.h"
#include "router/router_flags.h"

namespace dd::ddctl {
namespace {

absl::Status FromGrpc(const grpc::Status& st, absl::string_view what) {
  if (st.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(st.error_code());
  return absl::Status(code, absl::StrCat(what, ": ", absl::StatusCodeToString(code), ": ", st.error_message()));
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.always_print_primitive_fields = true;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::shared_ptr<grpc::Channel> Dial(const CliConfig& cfg, const std::string& addr) {
  return grpc::CreateChannel(addr, ChannelCredentials(cfg.tls));
}

// The API key of router calls (--api_key_file or $DD_API_KEY), when there is one.
void AttachApiKey(grpc::ClientContext* ctx, const CliConfig& cfg) {
  if (!cfg.api_key.empty()) ctx->AddMetadata("authorization", "Bearer " + cfg.api_key);
}

void SetDeadline(grpc::ClientContext* ctx, int64_t ms) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms > 0 ? ms : 10000));
}

}  // namespace

absl::Status RunRemoteGenerate(const CliConfig& cfg) {
  // The server validates the request (an empty prompt goes out as is and comes back
  // INVALID_ARGUMENT); --tokens sends token ids instead of text.
  dd::v1::GenerateRequest req;
  if (!cfg.tokens.empty()) {
    for (absl::string_view part : absl::StrSplit(cfg.tokens, ',', absl::SkipWhitespace())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(part, &id)) return absl::InvalidArgumentError(absl::StrCat("--tokens: '", part, "' is not an integer"));
      req.mutable_token_ids()->add_ids(id);
    }
  } else if (cfg.prompt.empty() && cfg.prompt_file.empty()) {
    req.set_text("");
  } else if (cfg.chat) {
    ASSIGN_OR_RETURN(std::string prompt, ReadPrompt(cfg));
    if (!cfg.system.empty()) {
      auto* m = req.mutable_messages()->add_messages();
      m->set_role("system");
      m->set_content(cfg.system);
    }
    auto* m = req.mutable_messages()->add_messages();
    m->set_role("user");
    m->set_content(prompt);
  } else {
    ASSIGN_OR_RETURN(std::string prompt, ReadPrompt(cfg));
    req.set_text(prompt);
  }
  req.set_model(cfg.model_name);
  req.set_request_id(cfg.request_id);
  req.set_max_new_tokens(cfg.generate.max_new_tokens);
  req.mutable_sampling()->set_temperature(cfg.generate.sampling.temperature);
  req.mutable_sampling()->set_top_k(cfg.generate.sampling.top_k);
  req.mutable_sampling()->set_top_p(cfg.generate.sampling.top_p);
  req.mutable_sampling()->set_seed(cfg.generate.sampling.seed);
  req.mutable_sampling()->set_min_p(cfg.generate.sampling.min_p);
  req.mutable_sampling()->set_repetition_penalty(cfg.generate.sampling.repetition_penalty);
  req.mutable_sampling()->set_frequency_penalty(cfg.generate.sampling.frequency_penalty);
  req.mutable_sampling()->set_presence_penalty(cfg.generate.sampling.presence_penalty);
  for (const std::string& s : cfg.generate.stop_strings) req.add_stop(s);
  for (int32_t id : cfg.generate.stop_ids) req.add_stop_token_ids(id);
  req.set_ignore_eos(!cfg.generate.stop_at_eos);
  req.set_raw_prompt(cfg.raw_prompt);
  // Several routers (HOST:PORT,HOST:PORT): when the stream breaks, reconnect to the next and
  // resume after the tokens already printed. Only a request the client names is kept by its
  // worker for a reconnect (docs/decisions/0050-resumable-streams.md), so with several routers
  // ddctl names each one; with one router, a named request (--request_id) reconnects to it.
  const std::vector<std::string> servers = absl::StrSplit(cfg.server, ',', absl::SkipWhitespace());
  if (servers.empty()) return absl::InvalidArgumentError("--server: no HOST:PORT given");
  if (req.request_id().empty() && servers.size() > 1) req.set_request_id(absl::StrCat("ddctl-", RandomHex(2)));
  const bool resumable = !req.request_id().empty();
  std::vector<int32_t> tokens;
  std::string text;
  dd::v1::Usage usage;
  // --reconnect_ms counts from the first break with no progress since: a long stream that breaks
  // late gets the whole window, and one that keeps breaking after progress starts afresh.
  auto give_up = std::chrono::steady_clock::time_point::max();
  size_t tokens_at_break = 0;
  bool reconnecting = false;
  for (size_t attempt = 0;; ++attempt) {
    const std::string& server = servers[attempt % servers.size()];
    auto stub = dd::v1::DualDecoder::NewStub(Dial(cfg, server));
    grpc::ClientContext ctx;
    if (cfg.deadline_ms > 0) SetDeadline(&ctx, cfg.deadline_ms);
    AttachApiKey(&ctx, cfg);
    if (reconnecting) req.set_resume_from_index(static_cast<int64_t>(tokens.size()));
    auto reader = stub->Generate(&ctx, req);
    dd::v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
      for (int32_t t : resp.token_ids()) tokens.push_back(t);
      text += resp.text();
      if (resp.has_usage()) usage = resp.usage();
      if (cfg.events) {
        std::printf("%s\n", Json(resp).c_str());
        std::fflush(stdout);
      } else if (!cfg.json) {
        std::fwrite(resp.text().data(), 1, resp.text().size(), stdout);
        std::fflush(stdout);
      }
    }
    const grpc::Status st = reader->Finish();
    if (st.ok()) break;
    if (give_up == std::chrono::steady_clock::time_point::max() || tokens.size() > tokens_at_break) {
      give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(cfg.reconnect_ms);
      tokens_at_break = tokens.size();
    }
    // A first submission no worker took can be sent again as new.
    if (reconnecting && tokens.empty() && st.error_code() == grpc::StatusCode::NOT_FOUND) {
      reconnecting = false;
      req.clear_resume_from_index();
      continue;
    }
    const bool retry = resumable &&
                       (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                        st.error_code() == grpc::StatusCode::UNKNOWN) &&
                       (servers.size() > 1 || (cfg.reconnect_ms > 0 && !tokens.empty())) &&
                       std::chrono::steady_clock::now() < give_up;
    if (!retry) return FromGrpc(st, absl::StrCat("generate via ", server));
    const std::string& next = servers[(attempt + 1) % servers.size()];
    std::fprintf(stderr, "\n[ddctl] the stream from %s broke (%s: %s); reconnecting to %s after %zu tokens\n",
                 server.c_str(), absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())).c_str(),
                 st.error_message().c_str(), next.c_str(), tokens.size());
    reconnecting = true;
    // Back off once every router was tried (a restarted one needs a moment to know its workers).
    if ((attempt + 1) % servers.size() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(1000, 100 << std::min<size_t>(attempt / servers.size(), 3))));
    }
  }
  if (cfg.json || cfg.events) {
    nlohmann::json j;
    j["tokens"] = tokens;
    j["text"] = text;
    j["generated_tokens"] = tokens.size();
    j["stop_reason"] = usage.stop_reason();
    j["usage"] = nlohmann::json::parse(Json(usage));
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("\n");
    const double tps = usage.tpot_seconds() > 0 ? 1.0 / usage.tpot_seconds() : 0;
    std::fprintf(stderr, "[ddctl] %lld tokens (%s) from %s (%s), TTFT %.3f s, decode %.2f tokens/s (TPOT %.1f ms)%s\n",
                 static_cast<long long>(tokens.size()), usage.stop_reason().c_str(), usage.worker_id().c_str(),
                 usage.mode().c_str(), usage.ttft_seconds(), tps, usage.tpot_seconds() * 1e3,
                 usage.resumes() ? absl::StrCat(", resumed ", usage.resumes(), "x").c_str() : "");
    const auto mib = [](int64_t b) { return static_cast<double>(b) / (1 << 20); };
    if (usage.kv_prefetch_bytes() + usage.kv_urgent_bytes() > 0) {
      std::fprintf(stderr, "[ddctl] prefetch hit rate %.1f%%; KV moved: %.1f MiB prefetched, %.1f MiB urgent, "
                   "%.1f MiB wasted\n", usage.prefetch_hit_rate() * 100, mib(usage.kv_prefetch_bytes()),
                   mib(usage.kv_urgent_bytes()), mib(usage.kv_wasted_bytes()));
    }
    if (usage.full_kv_device_bytes() > 0) {
      std::fprintf(stderr, "[ddctl] device memory for this request's KV: %.1f MiB (full attention: %.1f MiB, %.1fx)\n",
                   mib(usage.kv_device_bytes()), mib(usage.full_kv_device_bytes()),
                   static_cast<double>(usage.full_kv_device_bytes()) / std::max<int64_t>(1, usage.kv_device_bytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status RunHealth(const CliConfig& cfg) {
  if (cfg.server.empty()) return absl::InvalidArgumentError("health needs --server HOST:PORT (a router)");
  auto stub = dd::v1::DualDecoder::NewStub(Dial(cfg, cfg.server));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, cfg.deadline_ms);
  dd::v1::HealthResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub->Health(&ctx, {}, &resp), absl::StrCat("health of ", cfg.server)));
  std::printf("%s\n", cfg.json ? Json(resp).c_str() : resp.message().c_str());
  return resp.serving() ? absl::OkStatus() : absl::UnavailableError(resp.message());
}

absl::Status RunCancel(const CliConfig& cfg) {
  if (cfg.server.empty()) return absl::InvalidArgumentError("cancel needs --server HOST:PORT (a router)");
  if (cfg.request_id.empty()) {
    return absl::InvalidArgumentError("cancel needs --request_id: the id the stream was started with");
  }
  const std::vector<std::string> servers = absl::StrSplit(cfg.server, ',', absl::SkipEmpty());
  absl::Status last;
  for (const std::string& server : servers) {  // any replica will do
    auto stub = dd::v1::DualDecoder::NewStub(Dial(cfg, server));
    grpc::ClientContext ctx;
    SetDeadline(&ctx, cfg.deadline_ms);
    AttachApiKey(&ctx, cfg);
    dd::v1::CancelRequest req;
    req.set_request_id(cfg.request_id);
    dd::v1::CancelResponse resp;
    last = FromGrpc(stub->Cancel(&ctx, req, &resp), absl::StrCat("cancel via ", server));
    if (!last.ok() && last.code() == absl::StatusCode::kUnavailable) continue;
    RETURN_IF_ERROR(last);
    std::printf("%s\n", cfg.json ? Json(resp).c_str()
                                  : (resp.found() ? "cancelled" : "no worker holds a stream with this id"));
    return resp.found() ? absl::OkStatus()
                        : absl::NotFoundError(absl::StrCat("no stream '", cfg.request_id, "' for this tenant"));
  }
  return last;
}

absl::Status RunGrpcHealth(const CliConfig& cfg) {
  if (cfg.server.empty()) return absl::InvalidArgumentError("grpc-health needs --server HOST:PORT");
  auto stub = grpc::health::v1::Health::NewStub(Dial(cfg, cfg.server));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, cfg.deadline_ms);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(cfg.service);
  grpc::health::v1::HealthCheckResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub->Check(&ctx, req, &resp), absl::StrCat("grpc health of ", cfg.server)));
  const std::string status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  std::printf("%s\n", status.c_str());
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING
             ? absl::OkStatus()
             : absl::UnavailableError(absl::StrCat(cfg.server, " is ", status));
}

absl::Status RunStats(const CliConfig& cfg) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, cfg.deadline_ms);
  if (!cfg.worker.empty()) {
    auto stub = dd::worker::v1::Worker::NewStub(Dial(cfg, cfg.worker));
    AttachClusterSecret(&ctx, cfg.cluster_secret);
    dd::worker::v1::WorkerStats resp;
    RETURN_IF_ERROR(FromGrpc(stub->Stats(&ctx, {}, &resp), absl::StrCat("stats of worker ", cfg.worker)));
    std::printf("%s\n", Json(resp).c_str());
    return absl::OkStatus();
  }
  if (cfg.server.empty()) return absl::InvalidArgumentError("stats needs --server HOST:PORT (router) or --worker HOST:PORT");
  auto stub = dd::v1::DualDecoder::NewStub(Dial(cfg, cfg.server));
  AttachApiKey(&ctx, cfg);
  dd::v1::StatsResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub->Stats(&ctx, {}, &resp), absl::StrCat("stats of ", cfg.server)));
  std::printf("%s\n", Json(resp).c_str());
  return absl::OkStatus();
}

absl::Status RunWorkers(const CliConfig& cfg) {
  if (cfg.server.empty()) return absl::InvalidArgumentError("workers needs --server HOST:PORT (a router)");
  auto stub = dd::v1::DualDecoder::NewStub(Dial(cfg, cfg.server));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, cfg.deadline_ms);
  AttachApiKey(&ctx, cfg);
  dd::v1::ListWorkersResponse resp;
  RETURN_IF_ERROR(FromGrpc(stub->ListWorkers(&ctx, {}, &resp), absl::StrCat("workers of ", cfg.server)));
  if (cfg.json) {
    std::printf("%s\n", Json(resp).c_str());
    return absl::OkStatus();
  }
  std::printf("%-24s %-22s %-5s %-12s %7s %7s %10s %9s\n", "WORKER", "ADDRESS", "UP", "MODE", "ACTIVE", "WAITING",
              "TOKENS", "CAPACITY");
  for (const auto& w : resp.workers()) {
    std::printf("%-24s %-22s %-5s %-12s %7d %7d %10lld %9d\n", w.worker_id().c_str(), w.address().c_str(),
                w.up() ? "yes" : "no", w.mode().c_str(), w.active_requests(), w.waiting_requests(),
                static_cast<long long>(w.active_tokens()), w.capacity());
  }
  return absl::OkStatus();
}

absl::Status RunServe(const CliConfig& cfg) {
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  BlockTermSignals();
  // The router and the worker share this process: without a configured secret they share a
  // random one, so the internal port answers nobody else.
  const std::string secret = cfg.cluster_secret.empty() ? RandomClusterSecret() : cfg.cluster_secret;
  router::RouterOptions options = router::RouterOptionsFromFlags();
  options.cluster_secret = secret;
  options.worker_credentials = ChannelCredentials(cfg.tls);
  ASSIGN_OR_RETURN(options.auth, router::ApiAuthFromFlags());
  router::RouterService router(options);
  worker::WorkerIdentity id{.worker_id = "embedded", .address = "", .model = model->config.name};
  ASSIGN_OR_RETURN(const worker::SchedulerOptions sched, worker::SchedulerOptionsFromFlags());
  ASSIGN_OR_RETURN(engine::EngineOptions engine_options, CheckedEngineOptions(*model, cfg));
  // Each API tenant gets an equal share of the in-process prefix cache unless one is set.
  if (engine_options.prefix_cache_tenant_bytes < 0 && options.auth.tenant_count() >= 2) {
    engine_options.prefix_cache_tenant_bytes = engine_options.prefix_cache_bytes / options.auth.tenant_count();
  }
  ASSIGN_OR_RETURN(auto node, worker::WorkerNode::Create(*model, engine_options, sched, id));
  node->service().set_cluster_secret(secret);
  // The public API alone on --listen; the registry and the worker service on --internal_listen.
  EnableStandardServices();
  grpc::ServerBuilder builder;
  int port = 0;
  ListenOn(builder, cfg.listen, ServerCredentials(cfg.tls), &port);
  builder.RegisterService(&router);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", cfg.listen));
  grpc::ServerBuilder internal_builder;
  int internal_port = 0;
  ListenOn(internal_builder, cfg.internal_listen, ServerCredentials(cfg.tls), &internal_port);
  internal_builder.RegisterService(router.registry_service());
  internal_builder.RegisterService(&node->service());
  std::unique_ptr<grpc::Server> internal = internal_builder.BuildAndStart();
  if (!internal || internal_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", cfg.internal_listen, " (--internal_listen)"));
  }
  MarkServing(*server, {v1::DualDecoder::service_full_name()});
  MarkServing(*internal, {worker::v1::Registry::service_full_name(), worker::v1::Worker::service_full_name()});
  const std::string self = absl::StrCat(cfg.listen.substr(0, cfg.listen.rfind(':')), ":", port);
  const std::string inside =
      absl::StrCat(cfg.internal_listen.substr(0, cfg.internal_listen.rfind(':')), ":", internal_port);
  node->service().set_address(inside);
  std::unique_ptr<MetricsServer> exposer;
  std::string metrics_at = "off";
  if (!cfg.metrics_listen.empty()) {
    auto server = MetricsServer::Start(cfg.metrics_listen);
    if (!server.ok()) return server.status();
    exposer = std::move(*server);
    router.RegisterMetrics(*exposer);
    node->metrics().RegisterWith(*exposer, node->scheduler());
    metrics_at = absl::StrCat(cfg.metrics_listen.substr(0, cfg.metrics_listen.rfind(':')), ":",
                              exposer->port());
  }
  std::unique_ptr<router::OpenAiHttp> http;
  std::string http_at;
  ASSIGN_OR_RETURN(const router::HttpOptions http_options, router::HttpOptionsFromFlags(options.auth));
  if (!http_options.listen.empty()) {
    const std::string& h = http_options.listen;
    ASSIGN_OR_RETURN(http, router::OpenAiHttp::Start(http_options, server->InProcessChannel(grpc::ChannelArguments())));
    http_at = absl::StrCat(" http ", h.substr(0, h.rfind(':')), ":", http->port());
  }
  node->StartHeartbeats(inside, std::chrono::milliseconds(500), ChannelCredentials(cfg.tls));
  // Ready once the worker has registered with the in-process router.
  for (int i = 0; i < 500 && router.registry().workers_up() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (router.registry().workers_up() == 0) return absl::InternalError("the embedded worker did not register");
  std::fprintf(stderr, "[ddctl] serving %s (%s mode, device %s%s) with the embedded router, worker and in-process pool\n",
               model->config.name.c_str(), std::string(engine::DecodeModeName(cfg.engine.mode)).c_str(),
               engine_options.device.c_str(), DeviceWhy(engine_options).c_str());
  std::printf("ddctl serve: listening on %s metrics %s internal %s%s\n", self.c_str(), metrics_at.c_str(),
              inside.c_str(), http_at.c_str());
  std::fflush(stdout);
  const int sig = WaitForTermSignal();
  // Drain: the router sends nothing new to a draining worker (and this is the only one), so new
  // requests get UNAVAILABLE while the running ones finish.
  const auto grace = worker::DrainGraceFromFlags();
  std::fprintf(stderr, "ddctl serve: signal %d, draining (up to %lld ms)\n", sig, static_cast<long long>(grace.count()));
  MarkNotServing(*server);
  const int left = worker::DrainWorker(node->service(), node->scheduler(), *internal, grace);
  std::fprintf(stderr, "ddctl serve: %s, shutting down\n",
               left == 0 ? "drained" : absl::StrCat(left, " requests still running").c_str());
  http.reset();  // its requests have drained with the worker's
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  internal->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  exposer.reset();
  node.reset();
  return absl::OkStatus();
}

}  // namespace dd::ddctl
