#include "decode-worker/service/worker_node.h"

#include <algorithm>

#include "google/protobuf/util/json_util.h"

#include <algorithm>

#include "absl/flags/flag.h"
#include "common/byte_size.h"
#include "common/status_macros.h"
#include "proto/request_check.h"

ABSL_FLAG(int32_t, max_batch, 16, "serve: requests decoded together at most (batch slots)");
ABSL_FLAG(int32_t, max_waiting, 32, "serve: requests queued beyond the batch; more are refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, step_tokens, 512,
          "serve: tokens per scheduler iteration (decode rows + prefill chunk); long prompts are prefilled in "
          "pieces between decode steps");
ABSL_FLAG(int64_t, decode_prefill_tokens, 256,
          "serve: prompt tokens read per scheduler iteration while requests are decoding, so their tokens wait for "
          "a short pass, not a whole --step_tokens one (0 = --step_tokens less the decode rows; "
          "docs/decisions/0046-prefill-budget-while-decoding.md)");
ABSL_FLAG(int64_t, pool_recovery_ms, 30000,
          "serve: how long running requests wait for a lost KV pool to come back (same address) before they "
          "fail; their KV is then rebuilt by prefilling the prompt and (sparse modes) replaying the tokens already "
          "streamed as decode steps");

ABSL_FLAG(std::string, tenant_max_pool_bytes, "auto",
          "serve: KV-pool bytes the running and queued requests of one API tenant may hold on this worker "
          "(their blocks' bytes at full length; RESOURCE_EXHAUSTED past it), so one tenant cannot fill the pool "
          "quota the others share. auto: half of the pool tenant's quota (no limit with the in-process store); "
          "0: no limit; or a size such as 512MiB");

ABSL_FLAG(int32_t, tenant_max_slots, -1,
          "serve: batch slots one API tenant's requests may hold when the router serves two or more tenants, so "
          "the others always find one free; -1 = max_batch minus a quarter of it (at least 1), 0 = no limit");

ABSL_FLAG(std::string, tenant_max_device_bytes, "auto",
          "serve: device bytes (the memory plan's, KV included) one API tenant's requests may hold when the router "
          "serves two or more tenants and --device_memory is set, so the others always find room; auto = three "
          "quarters of what weights and workspace leave, 0 = no limit, or a size such as 4GiB");

namespace dd::worker {

absl::StatusOr<SchedulerOptions> SchedulerOptionsFromFlags() {
  SchedulerOptions o;
  const std::string tenant_bytes = absl::GetFlag(FLAGS_tenant_max_pool_bytes);
  if (tenant_bytes != "auto") {
    ASSIGN_OR_RETURN(o.tenant_max_store_bytes, ParseByteSize(tenant_bytes, "--tenant_max_pool_bytes"));
  }
  o.max_batch = absl::GetFlag(FLAGS_max_batch);
  o.tenant_max_slots = absl::GetFlag(FLAGS_tenant_max_slots);
  if (const std::string device = absl::GetFlag(FLAGS_tenant_max_device_bytes); device != "auto") {
    ASSIGN_OR_RETURN(o.tenant_max_device_bytes, ParseByteSize(device, "--tenant_max_device_bytes"));
  }
  if (o.tenant_max_slots < -1) return absl::InvalidArgumentError("--tenant_max_slots must be -1, 0 or positive");
  o.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  o.step_tokens = absl::GetFlag(FLAGS_step_tokens);
  o.decode_prefill_tokens = absl::GetFlag(FLAGS_decode_prefill_tokens);
  if (o.decode_prefill_tokens < 0) return absl::InvalidArgumentError("--decode_prefill_tokens must be >= 0");
  o.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  o.pool_recovery_timeout = std::chrono::milliseconds(std::max<int64_t>(0, absl::GetFlag(FLAGS_pool_recovery_ms)));
  return o;
}

absl::StatusOr<std::unique_ptr<WorkerNode>> WorkerNode::Create(const model::LoadedModel& model,
                                                               const engine::EngineOptions& engine_options,
                                                               const SchedulerOptions& scheduler_options,
                                                               WorkerIdentity identity) {
  if (scheduler_options.max_batch <= 0 || scheduler_options.max_waiting < 0 || scheduler_options.step_tokens <= 0) {
    return absl::InvalidArgumentError("max_batch and step_tokens must be > 0, max_waiting >= 0");
  }
  std::unique_ptr<WorkerNode> node(new WorkerNode());
  ASSIGN_OR_RETURN(node->engine_, engine::Engine::Create(model, engine_options));
  node->metrics_ = std::make_unique<WorkerMetrics>();
  node->scheduler_ = std::make_unique<Scheduler>(*node->engine_, scheduler_options, node->metrics_.get());
  identity.mode = std::string(engine::DecodeModeName(engine_options.mode));
  identity.kv_dtype = std::string(KvDtypeName(engine_options.kv_dtype));
  identity.kv_store = engine_options.mode == engine::DecodeMode::kFull ? "" : engine_options.kv_store;
  node->service_ = std::make_unique<WorkerService>(*node->scheduler_, std::move(identity), StreamGraceFromFlags());
  node->metrics_->set_keeper(&node->service_->keeper());
  return node;
}

void WorkerNode::StartHeartbeats(const std::string& router, std::chrono::milliseconds interval,
                                 std::shared_ptr<grpc::ChannelCredentials> credentials) {
  heartbeater_ = std::make_unique<Heartbeater>(router, *service_, *scheduler_, interval, std::move(credentials));
}

void WorkerNode::StartMembership(const RegistryConfig& registry, std::chrono::milliseconds interval) {
  const WorkerService& service = *service_;
  const std::string key = registry.prefix + "workers/" + service.identity().worker_id;
  auto record = [&service, key] {
    dd::worker::v1::RegisterRequest r = service.Record();
    r.set_published_unix_seconds(
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
    std::string json;
    (void)google::protobuf::util::MessageToJsonString(r, &json);
    return SignRecord(service.cluster_secret(), key, json);
  };
  // A record (signed with this cluster's secret) at this worker's own address is an earlier run of it (restarted before its lease
  // ran out): it takes the key over. Any other holder keeps it until its lease goes.
  auto may_take = [&service, key](const std::string& held) {
    absl::StatusOr<std::string> record = VerifyRecord(service.cluster_secret(), key, held);
    dd::worker::v1::RegisterRequest r;
    google::protobuf::util::JsonParseOptions o;
    o.ignore_unknown_fields = true;
    return record.ok() && record->size() < (64 << 10) &&
           google::protobuf::util::JsonStringToMessage(*record, &r, o).ok() &&
           r.address() == service.identity().address;
  };
  const int64_t ttl_seconds = std::max<int64_t>(2, (6 * interval.count() + 999) / 1000);
  membership_ = registry.backend->Join(key, record, may_take, interval, ttl_seconds);
}

WorkerNode::~WorkerNode() {
  membership_.reset();  // the key goes at once: routers stop placing here
  heartbeater_.reset();
  if (metrics_) metrics_->StopServing();
  service_.reset();
  scheduler_.reset();  // ends running requests (UNAVAILABLE) and joins its thread
  metrics_.reset();
  engine_.reset();
}

}  // namespace dd::worker
