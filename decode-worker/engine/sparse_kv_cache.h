// Sparse KV cache, `sparse` decode mode (DESIGN §4, §5.2; ShadowKV-style on-demand retrieval).
//
// For each sparse layer (global-attention layers; sliding-window layers stay dense) and each
// sequence, the device keeps: the attention sinks (first `sink_tokens`), the local window
// (chunks overlapping the last `window_tokens` positions) including the unfilled tail chunk,
// and one landmark per full chunk per KV head (the mean of the chunk's post-RoPE keys). Full
// chunks are written to the KvStore as they fill. A decode row's query scores the selectable
// chunks (neither sinks nor window) per KV head — score = max over the group's query heads of
// q · landmark, ties to the lower chunk — takes the top budget/chunk, fetches them from the
// store on the critical path (urgent priority) and attends exactly over sinks ∪ selected ∪
// window in ascending position order. When every selectable chunk fits the budget, the
// result is bit-identical to the dense cache.
//
// Prefill rows attend densely (the whole prefix stays on the device while a sequence is
// prefilling); the first decode row drops what left the window. Not thread-safe.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/engine/kv_cache.h"
#include "kv-pool/client/kv_store.h"

namespace dd::engine {

struct SparseOptions {
  int64_t budget_tokens = 2048;  // selected tokens per step per KV head (a multiple of chunk)
  int64_t chunk_tokens = 8;
  int64_t sink_tokens = 16;
  int64_t window_tokens = 64;
  // InvalidArgument naming the field: budget smaller than a chunk or larger than the
  // model context, non-positive chunk, sinks/window not multiples of the chunk.
  absl::Status Validate(int64_t model_context) const;
};

class SparseKvCache : public KvCache {
 public:
  // `store` and `pool` must outlive the cache.
  static absl::StatusOr<std::unique_ptr<SparseKvCache>> Create(const model::ModelConfig& config,
                                                               const SparseOptions& options,
                                                               kvpool::KvStore* store, ThreadPool& pool);

  void Reset(int32_t seq) override;
  absl::Status Copy(int32_t src, int32_t dst) override;
  int64_t Length(int32_t seq) const override;
  int64_t device_bytes() const override;
  absl::Status Attend(const model::AttentionCall& call) override;

  // Counters since construction (for reports): chunks fetched and bytes moved on demand.
  int64_t fetched_chunks() const { return fetched_chunks_; }
  int64_t fetched_bytes() const { return fetched_bytes_; }

 private:
  struct LayerState {
    int64_t length = 0;          // positions written
    int64_t dev_base = 0;        // first position (after the sinks) still on the device
    std::vector<float> k, v;     // device rows for positions [dev_base, length), n_kv × hd each
    std::vector<float> sink_k, sink_v;  // positions [0, min(length, sinks))
    std::vector<float> landmarks;       // full chunks × n_kv × hd
    bool decoded = false;        // a decode row has run (no more dense prefill)
  };
  struct Seq {
    kvpool::SequenceId store_id = 0;
    bool open = false;
    std::vector<LayerState> layers;  // indexed by model layer; unused for dense layers
  };
  SparseKvCache(const model::ModelConfig& config, const SparseOptions& options, kvpool::KvStore* store,
                ThreadPool& pool);

  absl::StatusOr<Seq*> GetSeq(int32_t seq);
  absl::Status Append(Seq& s, int64_t layer, const float* k, const float* v, int64_t pos);
  absl::Status AttendDecodeRow(Seq& s, const model::AttentionCall& call, int64_t row);
  void AttendPrefillRows(Seq& s, const model::AttentionCall& call, int64_t r0, int64_t r1);
  const float* DevK(const LayerState& st, int64_t pos) const;
  const float* DevV(const LayerState& st, int64_t pos) const;

  const model::ModelConfig& config_;
  SparseOptions options_;
  kvpool::KvStore* store_;
  ThreadPool& pool_;
  DenseKvCache dense_;  // the dense (sliding-window) layers
  std::vector<Seq> seqs_;
  std::vector<float> scratch_scores_, gathered_;
  int64_t fetched_chunks_ = 0, fetched_bytes_ = 0;
};

}  // namespace dd::engine
