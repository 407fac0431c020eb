// Command-line flags that configure a model and an engine, shared by every binary that runs
// one (ddctl, dd-decode-worker): --model, --mode, --budget, --device_memory, --kv_store,
// --prefix_block, --predictor, --allow_incorrect_device, --spec_head, --resident_margin, --threads, --prefill_chunk, --matmul.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "decode-worker/engine/device_check.h"
#include "decode-worker/engine/engine.h"

namespace dd::worker {

// The model path: --model, else $DD_MODEL, else the fetched default (gemma); a short name
// (gemma, smollm2) maps to its file in the model cache (model_paths.h). *defaulted = true when
// the path is a fetched model's, so a missing file can name scripts/fetch-model.
std::string ModelPathFromFlags(bool* defaulted);
// Loads it; a missing default model names scripts/fetch-model.
absl::StatusOr<std::unique_ptr<model::LoadedModel>> LoadModelFromFlags();
// Engine options from the flags; INVALID_ARGUMENT names the flag. The pool token comes from
// $DD_KV_POOL_TOKEN.
// `serving` (ddctl serve, dd-decode-worker): prefix reuse on unless --prefix_block says
// otherwise (kServingPrefixBlock tokens per key: one chunk, so a repeated prompt restores all but
// its last chunk; bench/results/cached-ttft.md), and off with --sparse_layers.
constexpr int64_t kServingPrefixBlock = 8;
absl::StatusOr<engine::EngineOptions> EngineOptionsFromFlags(bool serving = false);
// The start-up device check (engine/device_check.h) for a device other than cpu, and its
// verdict applied to *o (o->checked_device and the next two fields record it): a pass keeps the device; a device auto
// chose that fails (or cannot run) is replaced by the cpu, with the reason in o->device_why; a
// device named by --device that fails is refused (FAILED_PRECONDITION, naming the override
// --allow_incorrect_device) and one that cannot run returns its own error. Prints its verdict on
// stderr and logs it.
absl::Status ApplyDeviceCheck(const model::LoadedModel& model, engine::EngineOptions* o);
// The check's options from the flags (--device_check_tolerance).
engine::DeviceCheckOptions DeviceCheckOptionsFromFlags();

}  // namespace dd::worker
