// Random KV rows for decode benchmarks at long contexts (Engine::PrefillSynthetic): a 128K-token
// prefill of the Llama-3.1-8B shape takes longer than a benchmark may, and its KV says nothing
// on synthetic weights anyway. Keys and values have unit RMS. A row is a function of (seed,
// layer, K or V, position) alone, so every cache (dense or sparse, filled in any pieces) holds
// the same rows, and sparse attention over a budget that covers the context matches `full`.
// Rows come from one seeded table of floats, segment by segment from hashed offsets: filling
// 34 GB of context costs copies, not a random draw per float.
#pragma once

#include <cstdint>
#include <vector>

namespace dd::engine {

class RandomKv {
 public:
  // kv_dim: floats per row (n_head_kv × head_dim).
  RandomKv(uint64_t seed, int64_t kv_dim);
  // Rows of positions [p0, p1) of `layer`'s keys (`values` false) or values into out
  // ((p1 - p0) × kv_dim floats).
  void Rows(int64_t layer, bool values, int64_t p0, int64_t p1, float* out) const;

 private:
  const float* Segment(int64_t layer, bool values, int64_t segment) const;
  uint64_t seed_;
  int64_t kv_dim_, seg_rows_;
  std::vector<float> table_;
};

}  // namespace dd::engine
