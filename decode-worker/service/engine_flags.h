// Command-line flags that configure a model and an engine, shared by every binary that runs
// one (ddctl, dd-decode-worker): --model, --mode, --budget, --device_memory, --kv_store,
// --prefix_block, --predictor, --spec_head, --prefetch_buffers, --step_cache, --resident_margin, --threads, --prefill_chunk, --matmul.
#pragma once

#include <string>

#include "absl/status/statusor.h"
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
// otherwise (kServingPrefixBlock tokens per key), and off with --sparse_layers.
constexpr int64_t kServingPrefixBlock = 64;
absl::StatusOr<engine::EngineOptions> EngineOptionsFromFlags(bool serving = false);

}  // namespace dd::worker
