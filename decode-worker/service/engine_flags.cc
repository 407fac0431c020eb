#include "decode-worker/service/engine_flags.h"

#include <bitset>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/byte_size.h"
#include "common/kv_dtype.h"
#include "common/status_macros.h"
#include "dd/backend/registry.h"
#include "decode-worker/engine/device_check.h"
#include "glog/logging.h"
#include "decode-worker/model/model_paths.h"

ABSL_FLAG(std::string, model, "", "Model: gemma or smollm2 (fetched by scripts/fetch-model), a .gguf file "
          "or a Hugging Face safetensors directory (default: $DD_MODEL, else gemma)");
ABSL_FLAG(std::string, device, "auto",
          "Compute device: auto (cuda where a CUDA device is usable and passes the start-up check against the cpu, "
          "else cpu; the choice and why are printed at start), cpu (every machine), sim (a simulated device that "
          "checks every wait, for developers) or cuda (GPU 0; refused with the reason where it cannot run or fails "
          "the start-up check); docs/architecture.md, the compute-backend seam");
ABSL_FLAG(bool, allow_incorrect_device, false,
          "Serve on a --device named explicitly (cuda, sim) even when its start-up check finds logits that differ "
          "from the cpu's: its outputs may be wrong. Without it such a device is refused; auto never takes one "
          "(docs/decisions/0044-device-check.md)");
ABSL_FLAG(double, device_check_tolerance, 0.05,
          "Start-up device check: the largest logit difference from the cpu allowed per row, in units of the cpu "
          "row's standard deviation");
ABSL_FLAG(bool, cuda_graphs, false,
          "--device cuda: launch each half of a layer around its attention as one CUDA graph per batch size (the "
          "same kernels, the same bits; off until a GPU run measures it, docs/decisions/0041-cuda-graphs.md)");
ABSL_FLAG(bool, cuda_copy_engine_prefetch, false,
          "--device cuda: prefetch gathers by the copy engines (one batch per gather) instead of the gather kernel, "
          "leaving the SMs to compute; urgent gathers keep the kernel (off until a GPU run measures which is faster "
          "while compute runs: gpu-gather.md)");
ABSL_FLAG(int32_t, threads, 0, "Compute threads (0 = all cores)");
ABSL_FLAG(int64_t, prefill_chunk, 512, "Prefill chunk size in tokens");
ABSL_FLAG(std::string, matmul, "int8",
          "Weight matmul kernels: int8 (fast, activations quantized per 32) or f32 (exact)");
ABSL_FLAG(std::string, mode, "full",
          "Decode mode: full (all KV attended), sparse (top-k chunks fetched on demand), sparse-cached (the same, "
          "chunks kept resident across steps: only misses fetched) or dualdecoder (sparse with speculative-token "
          "prefetch)");
ABSL_FLAG(std::string, kv_dtype, "f32",
          "The type KV is kept in, everywhere it lives (device rows, pool blocks, transfers, prefix cache): f32, or "
          "f16 (half the bytes, widened to f32 in the kernels). docs/decisions/0049-kv-storage-type.md");
ABSL_FLAG(int64_t, budget, 2048, "sparse: tokens selected per step per KV head (multiple of 8)");
ABSL_FLAG(std::string, device_memory, "0",
          "Device-memory budget (e.g. 8GiB, 512MiB; 0 = unlimited): weights, workspace and the request's "
          "projected KV must fit, else the request is refused with the numbers");
ABSL_FLAG(std::string, kv_store, "inproc://",
          "sparse modes: where offloaded KV lives: inproc://, shm://HOST:PORT or ucx://HOST:PORT (a dd-kv-pool; "
          "token from $DD_KV_POOL_TOKEN); dd-decode-worker with --registry etcd://... also takes registry://shm (the "
          "pool registered on its --node) or registry://ucx (that pool, else the largest that serves ucx://)");
ABSL_FLAG(int64_t, prefix_block, -1,
          "Prefix reuse, every mode: key prompts in blocks of this many tokens (a multiple of 8); a prompt starting "
          "with a stored prefix restores it instead of prefilling it. 0 = off; -1 (default) = 8 when serving "
          "(ddctl serve, dd-decode-worker), else off");
ABSL_FLAG(std::string, prefix_cache, "1GiB",
          "Prefix reuse with --kv_store inproc://: bytes of committed prefixes kept after their requests end, "
          "least recently used evicted first (a pool's cache is bounded by its tenant quota)");
ABSL_FLAG(std::string, prefix_cache_per_tenant, "auto",
          "Prefix reuse with --kv_store inproc://: bytes of --prefix_cache one API tenant's prefixes may hold; a "
          "tenant's requests evict only its own prefixes. auto = an equal share when ddctl serve's API keys name "
          "two or more tenants, else all of it");
ABSL_FLAG(std::string, predictor, "speculative",
          "dualdecoder: what predicts the next step's chunks: speculative (default), previous, union, random, "
          "oracle (needs --oracle_tokens); for measuring hit rates, results do not change");
ABSL_FLAG(std::string, spec_head, "auto",
          "dualdecoder: the speculative row's LM head: full (the whole vocabulary), context (score only the "
          "sequence's own tokens) or auto (context where the LM head has more multiply-adds than all the layers, "
          "e.g. Gemma 3 270M; else full); changes the hit rate and speed, never the results");
ABSL_FLAG(int64_t, spec_head_common, 0,
          "dualdecoder, --spec_head context: also score this many of the vocabulary's most frequent tokens");
ABSL_FLAG(bool, spec_resync, true,
          "dualdecoder: after a step whose speculative token missed, speculate the context's continuation of the "
          "last two tokens, else of the last one (where the context has one), instead of the row's output from the "
          "wrong token; "
          "changes the hit rate, never the results");
ABSL_FLAG(int64_t, spec_candidates, -1,
          "dualdecoder: the speculative row scores only the landmarks of the real row's best N x budget chunks "
          "per KV head (and chunks new since) instead of every chunk (0 = every chunk, at most 64; -1 = by the "
          "speculative head: 4 with the full head, 0 with the context head); changes the hit rate and speed, never "
          "the results");
ABSL_FLAG(bool, spec_carry, true,
          "dualdecoder: a real row whose token is the one the last speculative row was fed starts from that row's "
          "state after the layers before the first sparse layer (Gemma 3: 5 of 18); same results, less compute");
ABSL_FLAG(std::string, sparse_layers, "",
          "sparse modes: only these global layers are sparse (comma-separated; empty = all); the others attend "
          "over their whole KV (per-layer fidelity)");
ABSL_FLAG(int64_t, resident_margin, 0,
          "sparse-cached, dualdecoder: resident slots per KV head beyond the budget, in tokens (multiple of 8); "
          "chunks leave least recently used first");
ABSL_FLAG(std::string, key_reconstruction, "off",
          "sparse modes: rebuild keys on the device from a low-rank key cache instead of fetching them, so only "
          "values move: off (default; exact sparse attention), auto (per layer while its next-step hit rate is "
          "low; dualdecoder), all (every sparse layer); changes the results (docs/decisions/"
          "0052-low-rank-key-reconstruction.md)");
ABSL_FLAG(std::string, reconstruct_layers, "",
          "sparse modes: rebuild the keys of these sparse layers (comma-separated), every step; instead of "
          "--key_reconstruction (an offline-profiled list)");
ABSL_FLAG(int64_t, key_rank, 0,
          "key reconstruction: coefficients per position of the low-rank key cache (0 = half the key width, "
          "rounded up to 8, at most 160)");

namespace dd::worker {
namespace {

// "3,9" as a set of layer indices; errors name the flag.
absl::StatusOr<std::bitset<engine::SparseOptions::kMaxLayers>> ParseLayerList(absl::string_view flag,
                                                                               absl::string_view list) {
  std::bitset<engine::SparseOptions::kMaxLayers> layers;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    int64_t l = 0;
    if (!absl::SimpleAtoi(part, &l) || l < 0 || l >= engine::SparseOptions::kMaxLayers) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not a layer index in [0, ",
                                                     engine::SparseOptions::kMaxLayers, ")"));
    }
    if (layers.test(l)) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": layer ", l, " is listed twice"));
    layers.set(l);
  }
  return layers;
}

}  // namespace

std::string ModelPathFromFlags(bool* defaulted) {
  *defaulted = false;
  std::string flag = absl::GetFlag(FLAGS_model);
  if (!flag.empty()) {
    // A short name (gemma, smollm2) is a fetched model: a missing file names fetch-model.
    *defaulted = model::KnownModelPath(flag).has_value();
    return model::ResolveModelArg(flag);
  }
  if (const char* env = std::getenv("DD_MODEL"); env != nullptr && *env != '\0') return model::ResolveModelArg(env);
  *defaulted = true;
  return *model::KnownModelPath(model::kDefaultModelName);
}

absl::StatusOr<std::unique_ptr<model::LoadedModel>> LoadModelFromFlags() {
  bool defaulted = false;
  const std::string path = ModelPathFromFlags(&defaulted);
  auto m = model::LoadModel(path);
  if (!m.ok() && m.status().code() == absl::StatusCode::kNotFound && defaulted) {
    return absl::NotFoundError(absl::StrCat(m.status().message(),
                                            "\n  this model is not fetched yet: run scripts/fetch-model"
                                            " (or pass --model PATH)"));
  }
  return m;
}

absl::StatusOr<engine::EngineOptions> EngineOptionsFromFlags(bool serving) {
  engine::EngineOptions o;
  o.device = backend::ResolveDeviceName(absl::GetFlag(FLAGS_device), &o.device_why);
  o.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  o.cuda_copy_engine_prefetch = absl::GetFlag(FLAGS_cuda_copy_engine_prefetch);
  for (auto [flag, set] : {std::pair{"--cuda_graphs", o.cuda_graphs},
                           std::pair{"--cuda_copy_engine_prefetch", o.cuda_copy_engine_prefetch}}) {
    if (set && o.device != "cuda" && o.device_why == "requested") {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " needs --device cuda (or auto on a GPU machine), not --device ", o.device));
    }
  }
  if (const double t = absl::GetFlag(FLAGS_device_check_tolerance); !(t > 0) || t > 1) {
    return absl::InvalidArgumentError(absl::StrCat("--device_check_tolerance must be in (0, 1], got ", t));
  }
  o.threads = absl::GetFlag(FLAGS_threads);
  o.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  const std::string matmul = absl::GetFlag(FLAGS_matmul);
  if (matmul == "int8") {
    o.matmul = model::Transformer::MatMulKind::kInt8;
  } else if (matmul == "f32") {
    o.matmul = model::Transformer::MatMulKind::kF32;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--matmul must be int8 or f32, got '", matmul, "'"));
  }
  auto mode = engine::ParseDecodeMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return absl::InvalidArgumentError(absl::StrCat("--mode: ", mode.status().message()));
  o.mode = *mode;
  auto kv_dtype = ParseKvDtype(absl::GetFlag(FLAGS_kv_dtype), "kv_dtype");
  if (!kv_dtype.ok()) return kv_dtype.status();
  o.kv_dtype = *kv_dtype;
  o.sparse.budget_tokens = absl::GetFlag(FLAGS_budget);
  auto device_memory = engine::ParseByteSize(absl::GetFlag(FLAGS_device_memory), "device_memory");
  if (!device_memory.ok()) return device_memory.status();
  o.device_memory_bytes = *device_memory;
  o.kv_store = absl::GetFlag(FLAGS_kv_store);
  o.prefix_block_tokens = absl::GetFlag(FLAGS_prefix_block);
  if (o.prefix_block_tokens == -1) o.prefix_block_tokens = serving ? kServingPrefixBlock : 0;
  auto prefix_cache = engine::ParseByteSize(absl::GetFlag(FLAGS_prefix_cache), "prefix_cache");
  if (!prefix_cache.ok()) return prefix_cache.status();
  o.prefix_cache_bytes = *prefix_cache;
  if (const std::string share = absl::GetFlag(FLAGS_prefix_cache_per_tenant); share != "auto") {
    auto bytes = engine::ParseByteSize(share, "prefix_cache_per_tenant");
    if (!bytes.ok()) return bytes.status();
    o.prefix_cache_tenant_bytes = *bytes;
  }
  auto predictor = engine::ParsePredictor(absl::GetFlag(FLAGS_predictor));
  if (!predictor.ok()) return absl::InvalidArgumentError(absl::StrCat("--predictor: ", predictor.status().message()));
  o.sparse.predictor = *predictor;
  auto spec_head = engine::ParseSpecHead(absl::GetFlag(FLAGS_spec_head));
  if (!spec_head.ok()) return absl::InvalidArgumentError(absl::StrCat("--spec_head: ", spec_head.status().message()));
  o.spec_head = *spec_head;
  o.spec_head_common = absl::GetFlag(FLAGS_spec_head_common);
  if (o.spec_head_common < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--spec_head_common must be >= 0, got ", o.spec_head_common));
  }
  o.spec_resync = absl::GetFlag(FLAGS_spec_resync);
  o.spec_carry = absl::GetFlag(FLAGS_spec_carry);
  o.sparse.spec_candidates = absl::GetFlag(FLAGS_spec_candidates);
  o.sparse.resident_margin_tokens = absl::GetFlag(FLAGS_resident_margin);
  ASSIGN_OR_RETURN(o.sparse.sparse_layers, ParseLayerList("sparse_layers", absl::GetFlag(FLAGS_sparse_layers)));
  engine::KeyReconstructionOptions& kr = o.sparse.key_reconstruction;
  auto recon = engine::ParseKeyReconstruction(absl::GetFlag(FLAGS_key_reconstruction));
  if (!recon.ok() || *recon == engine::KeyReconstructionMode::kLayers) {
    return absl::InvalidArgumentError(absl::StrCat("--key_reconstruction: '", absl::GetFlag(FLAGS_key_reconstruction),
                                                   "' is not off, auto or all (a layer list: --reconstruct_layers)"));
  }
  kr.mode = *recon;
  ASSIGN_OR_RETURN(kr.layers, ParseLayerList("reconstruct_layers", absl::GetFlag(FLAGS_reconstruct_layers)));
  if (kr.layers.any()) {
    if (kr.mode != engine::KeyReconstructionMode::kOff) {
      return absl::InvalidArgumentError("--reconstruct_layers and --key_reconstruction: give one of them");
    }
    kr.mode = engine::KeyReconstructionMode::kLayers;
  }
  kr.rank = absl::GetFlag(FLAGS_key_rank);
  // The serving default steps aside for --sparse_layers (layers kept dense are not offloaded).
  if (o.prefix_block_tokens < -1) {
    return absl::InvalidArgumentError(absl::StrCat("--prefix_block must be >= 0 (or -1, the default), got ",
                                                   o.prefix_block_tokens));
  }
  if (const char* token = std::getenv("DD_KV_POOL_TOKEN"); token != nullptr) o.kv_store_token = token;
  return o;
}

engine::DeviceCheckOptions DeviceCheckOptionsFromFlags() {
  return {.tolerance = absl::GetFlag(FLAGS_device_check_tolerance)};
}

absl::Status ApplyDeviceCheck(const model::LoadedModel& model, engine::EngineOptions* o) {
  if (o->device == "cpu") return absl::OkStatus();
  const std::string device = o->device;
  const bool chosen_by_auto = o->device_why != "requested";
  std::fprintf(stderr, "device check: %s against cpu (%s mode)...\n", device.c_str(),
               std::string(engine::DecodeModeName(o->mode)).c_str());
  const auto t0 = std::chrono::steady_clock::now();
  auto report = engine::CheckDevice(model, *o, DeviceCheckOptionsFromFlags());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A device that cannot even run: its own error when it was named; auto's reason when not.
  if (!report.ok() && !chosen_by_auto) return report.status();
  const bool passed = report.ok() && report->passed;
  const std::string verdict = report.ok() ? report->Summary()
                                          : absl::StrCat("device check could not run on ", device, ": ",
                                                         report.status().message());
  o->checked_device = device;
  o->device_check_passed = passed;
  o->device_check_seconds = seconds;
  if (passed) {
    std::fprintf(stderr, "%s\n", verdict.c_str());
    LOG(INFO) << verdict;
    return absl::OkStatus();
  }
  LOG(WARNING) << verdict;
  std::fprintf(stderr, "%s\n", verdict.c_str());
  if (chosen_by_auto) {
    o->device = "cpu";
    o->cuda_graphs = o->cuda_copy_engine_prefetch = false;
    o->device_why = absl::StrCat("auto: ", device, " failed its start-up check, so the cpu serves; `ddctl "
                                 "device-check --device ", device, "` prints the comparison");
    return absl::OkStatus();
  }
  if (absl::GetFlag(FLAGS_allow_incorrect_device)) {
    o->device_why = absl::StrCat("requested; it FAILED its start-up check and serves only because of "
                                 "--allow_incorrect_device: outputs may be wrong");
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "--device ", device, " failed its start-up check against the cpu, so it will not serve (", verdict,
      "). `ddctl device-check --device ", device, "` prints the comparison; --allow_incorrect_device serves on "
      "it anyway, with outputs that may be wrong"));
}

}  // namespace dd::worker
