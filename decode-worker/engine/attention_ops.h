// The caches' attention calls in the backend's terms (dd/backend/ops.h): a model's heads as
// an AttentionShape, and rows of an AttentionCall as one sequence's causal attention.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "dd/backend/ops.h"
#include "decode-worker/model/attention.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

inline backend::AttentionShape ShapeOf(const model::ModelConfig& c, KvDtype kv) {
  return {.n_head = c.n_head, .n_head_kv = c.n_head_kv, .head_dim = c.head_dim, .kv = kv};
}

// Rows [r0, r1) of `call` belong to one sequence; `runs` hold, in order, its positions
// [lo, call.rows[r1-1].pos]. `positions` receives the rows' positions (it backs the span).
inline backend::CausalAttention CausalRows(const model::AttentionCall& call, const model::ModelConfig& c, KvDtype kv,
                                           int64_t r0, int64_t r1, int64_t lo, absl::Span<const backend::KvRun> runs,
                                           std::vector<int64_t>* positions) {
  positions->resize(r1 - r0);
  for (int64_t r = r0; r < r1; ++r) (*positions)[r - r0] = call.rows[r].pos;
  const int64_t q_dim = c.n_head * c.head_dim;
  return {.shape = ShapeOf(c, kv),
          .scale = call.scale,
          .sliding = call.sliding,
          .window = call.window,
          .q = call.q + r0 * q_dim,
          .out = call.out + r0 * q_dim,
          .positions = *positions,
          .lo = lo,
          .runs = runs};
}

}  // namespace dd::engine
