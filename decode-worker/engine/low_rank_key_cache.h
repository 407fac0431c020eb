// A sparse layer's low-rank key cache for one sequence (docs/decisions/0052-low-rank-key-
// reconstruction.md): the keys of its offloaded chunks before their rotation, the KV heads
// stacked, as `rank` coefficients per position over an orthonormal basis of the prompt's keys.
// The basis is computed once per (sequence, layer) on the host from the prompt's keys, at the
// end of prefill while the whole prompt is still on the device: their covariance (at most
// kMaxSampleRows rows, evenly spaced) and kIterations of subspace iteration for its `rank`
// leading directions. Coefficients are computed on the device (Ops::ProjectKeys) for the
// prompt's chunks then, and for each chunk completed while decoding. Keys are rebuilt on the
// device (Ops::ReconstructKeys) straight into the K half of a chunk's block, then attended as
// fetched ones are. Basis and coefficients are f32, in device memory under their own tag
// (MemoryTag::kLowRankKeys), counted by the memory plan.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "dd/backend/ops.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_rows.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

struct LowRankLayer {
  backend::DeviceBuffer basis;   // rank rows of kv_dim floats
  backend::DeviceBuffer coeffs;  // per full chunk: chunk × rank floats, chunks [0, projected)
  int64_t cap = 0;               // chunks coeffs holds
  int64_t projected = 0;         // chunks with coefficients
  bool ready = false;            // the basis is built
};

class LowRankKeyCache {
 public:
  static constexpr int64_t kMaxSampleRows = 2048;
  static constexpr int kIterations = 12;
  LowRankKeyCache(const model::ModelConfig& config, const SparseOptions& options, backend::Device& device,
                  SparseRows& rows);
  int64_t rank() const { return rank_; }
  int64_t kv_dim() const { return config_.n_head_kv * config_.head_dim; }
  // Device bytes of a sequence's cache for one layer at `tokens` positions (the memory plan's).
  int64_t BytesFor(int64_t tokens) const;
  // Buffers for a request growing to `total_tokens` (none allocated later).
  absl::Status Reserve(LowRankLayer& lr, int64_t total_tokens);
  // The basis from the keys of the full chunks `st` holds — all of its positions still in its
  // rows (before they become the decode window's ring) — then their coefficients. Nothing when
  // it holds no full chunk: the layer then fetches its keys for this sequence.
  absl::Status Build(LowRankLayer& lr, const LayerRows& st);
  // Coefficients of the full chunks completed since (their rows still on the device).
  absl::Status Project(LowRankLayer& lr, const LayerRows& st);
  // Enqueues on the compute queue the keys of chunks[i] for KV head heads[i], written to
  // dst[i] (the K half of the chunk's block for that head).
  void Reconstruct(const LowRankLayer& lr, absl::Span<const int64_t> chunks, absl::Span<const int32_t> heads,
                   absl::Span<void* const> dst);
  absl::Status Duplicate(const LowRankLayer& from, LowRankLayer& to);
  void Free(LowRankLayer& lr);
  static int64_t bytes(const LowRankLayer& lr) { return lr.basis.bytes + lr.coeffs.bytes; }
  // Bases built so far and the host time they took.
  int64_t builds() const { return builds_; }
  int64_t build_ns() const { return build_ns_; }

 private:
  backend::LowRankKeys Shape(const LowRankLayer& lr) const;
  int64_t ChunkCoeffBytes() const { return options_.chunk_tokens * rank_ * static_cast<int64_t>(sizeof(float)); }
  absl::Status EnsureCoeffs(LowRankLayer& lr, int64_t chunks);
  // The basis of the host keys (n rows of kv_dim floats, unrotated): rank rows of kv_dim.
  std::vector<float> Basis(const std::vector<float>& keys, int64_t n) const;

  const model::ModelConfig& config_;
  const SparseOptions& options_;
  backend::Device& device_;
  SparseRows& rows_;
  const int64_t rank_;
  int64_t builds_ = 0, build_ns_ = 0;
  std::vector<const void*> key_rows_;  // ProjectKeys' rows
  std::vector<int64_t> positions_;
  std::vector<const float*> item_coeffs_;  // ReconstructKeys' items
  std::vector<int64_t> item_first_;
};

}  // namespace dd::engine
