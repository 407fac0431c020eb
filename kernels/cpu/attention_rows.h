// The cpu backend's attention over KV rows (CpuOps::AttendCausal, AttendRowsToLists): one
// implementation behind dense attention, the sparse cache's prefill and its decode rows over
// selected chunks, so all give the same bits for the same keys.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "dd/backend/ops.h"

namespace dd::backend::cpu {

// Reused across calls (one at a time): key pointers and the few-rows path's buffers.
struct AttentionScratch {
  std::vector<const float*> keys, values;  // per KV head, one pointer per key position
  std::vector<float> q, scores;            // the few-rows path (decode)
  std::vector<float*> outs;
  std::vector<int64_t> offsets, first_tiles;  // AttendRowsToLists' per-KV-head prefix sums
  std::vector<int64_t> j0, j1;                // visible keys per row of the few-rows path
};

// Causal attention (CausalAttention in ops.h). Work goes in blocks of 16 rows × the query
// heads of one KV head: the block's scores over the keys any of its rows sees (16 × heads ×
// n_keys floats per thread, never rows × keys), softmax per query over its own keys, then the
// weighted sum of values in ascending position. Each query's bits depend only on its own keys
// (DESIGN §5 batch invariance) and equal Dot / ScaledSoftmax / Axpy one query at a time. Too
// few blocks to occupy the threads (decode: one row per sequence) takes another split with
// the same bits: scores by key tiles, then the weighted sums by output elements.
void AttendCausal(const CausalAttention& a, ThreadPool& pool, AttentionScratch* scratch);

// Decode rows over per-KV-head key lists in one pass: each key and value is loaded once for
// all rows' query heads. Each row's bits equal the row alone over its visible keys: scores are
// per-pair Dot bits, and a hidden key gets probability 0, which adds nothing to a weighted sum
// of finite values. Split over `pool` like the few-rows path (scores by key tiles, softmax per
// head, weighted sums by head-dim pieces).
void AttendRowsToLists(absl::Span<const ListQuery> rows, const AttentionShape& shape, float scale,
                       absl::Span<const KeyValueList> lists, ThreadPool& pool, AttentionScratch* scratch);

}  // namespace dd::backend::cpu
