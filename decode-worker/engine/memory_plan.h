// Device-memory accounting (docs/architecture.md, "Memory plan and admission";
// docs/decisions/0013-device-memory-plan.md): what a request costs on the device in each decode
// mode, so the engine can admit requests against `--device-memory` and report max batch.
//
// The projection is what the caches allocate, tag by tag (memory_plan_test compares it with
// the device's per-tag totals in every mode):
//   weights    every matrix and vector of the model, as stored;
//   workspace  a batch row's activations (a dualdecoder request has two rows; an upper bound:
//              rows within the forward workspace as created are counted again), and in sparse
//              modes a request's landmark scores (every chunk, the batch's scores come to the
//              host together) and without the step cache one layer's gathered blocks (the
//              batch's attention reads every request's at once); shared by all requests: the
//              forward workspace as created (a prefill pass of prefill_chunk rows and the
//              logits of Transformer::kLogitRows rows) and the context head's rows, hidden
//              state and scores (spec_head.h);
//   kv         (kKv) full: every position of every global layer. sparse modes: sinks and the
//              local window's ring (window + chunk rows) on sparse layers; global layers kept
//              dense (--sparse_layers) hold every position. Sliding-window layers keep a ring
//              of window + 1 positions in every mode;
//   landmarks  (kLandmarks) one per chunk per KV head on sparse layers;
//   resident   (kResidentSlots) with the resident fetch (sparse-cached, dualdecoder) a
//              resident set of `budget + resident_margin` tokens per sparse layer;
//   low_rank   (kLowRankKeys) with key reconstruction, per sparse layer that may rebuild its
//              keys: a basis of rank × kv_dim floats and rank floats per position of its full
//              chunks (low_rank_key_cache.h).
// Prefill is dense in every mode, so a request being prefilled transiently holds its whole
// prompt on global layers (sparse modes), and its sliding-window rings hold window - 1 +
// prefill_chunk rows instead of window + 1 (`prefill_extra`), released at its first decode step.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/byte_size.h"
#include "common/kv_dtype.h"
#include "decode-worker/engine/chunk_selector.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/model/weights.h"

namespace dd::engine {

// kSparseCached is `sparse` with the resident fetch (KvFetch::kResident,
// docs/decisions/0012-resident-set.md): the ShadowKV-style baseline that keeps the last steps'
// chunks resident and fetches the misses.
enum class DecodeMode { kFull, kSparse, kSparseCached, kDualDecoder };

// A request's decode-state bytes by memory tag.
struct KvBytes {
  int64_t kv = 0, landmarks = 0, resident = 0, low_rank = 0;
  int64_t total() const { return kv + landmarks + resident + low_rank; }
};

struct RequestBytes {
  int64_t kv = 0;             // steady decode state at the request's final length
  int64_t workspace = 0;      // per-row activations and logits
  int64_t prefill_extra = 0;  // additional bytes while the prompt is prefilled
  int64_t steady() const { return kv + workspace; }
};

class MemoryPlan {
 public:
  // `kv`: the type the caches keep KV rows in (landmarks stay f32).
  MemoryPlan(const model::LoadedModel& model, DecodeMode mode, const SparseOptions& sparse,
             int64_t prefill_chunk = 512, KvDtype kv = KvDtype::kF32);

  int64_t weight_bytes() const { return weight_bytes_; }
  int64_t shared_workspace_bytes() const { return shared_workspace_; }
  // Memory every request shares beyond the caches' buffers (the forward workspace as created,
  // the context head's row cache).
  void AddSharedWorkspace(int64_t bytes) { shared_workspace_ += bytes; }
  // A request whose prompt has `prompt_tokens` and that may grow to `total_tokens`.
  RequestBytes Request(int64_t prompt_tokens, int64_t total_tokens) const;
  // KV bytes the cache holds for one decoding sequence of `length` positions, by tag.
  KvBytes DecodeKv(int64_t length) const;
  int64_t DecodeKvBytes(int64_t length) const { return DecodeKv(length).total(); }
  // The chunks a request writes to the store at most: sparse modes offload every completed
  // chunk (all layers) up to its final length and always open a store sequence; full mode
  // only its prompt's chunks, and only with prefix reuse on (-1: no store sequence).
  int64_t StoreChunks(int64_t prompt_tokens, int64_t total_tokens, bool prefix_reuse) const;
  // How many requests of this shape fit in `budget` bytes (prefilled one at a time).
  int64_t MaxBatch(int64_t budget, int64_t prompt_tokens, int64_t total_tokens) const;
  // The explanation used in errors: "weights 253.1 MiB + workspace ... + kv ...".
  std::string Describe(const RequestBytes& r) const;

 private:
  const model::ModelConfig& config_;
  // The modes that keep a resident set (KvFetch::kResident).
  bool Resident() const { return mode_ == DecodeMode::kSparseCached || mode_ == DecodeMode::kDualDecoder; }
  DecodeMode mode_;
  SparseOptions sparse_;
  int64_t prefill_chunk_;
  KvDtype kv_;
  int64_t weight_bytes_ = 0;
  int64_t shared_workspace_ = 0;
};

using dd::MiB;
using dd::ParseByteSize;

}  // namespace dd::engine
