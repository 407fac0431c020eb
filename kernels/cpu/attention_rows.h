// The cpu backend's attention over KV rows (CpuOps::AttendCausal, AttendGroups): one
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
  std::vector<const void*> keys, values;   // per KV head, one pointer per key position
  std::vector<float> q, scores;            // the few-rows path (decode)
  std::vector<float*> outs;
  std::vector<int64_t> offsets, first_tiles, first_queries;  // AttendGroups' per-pair prefix sums
  std::vector<const float*> group_q;                      // AttendGroups' queries per pair
  std::vector<int64_t> j0, j1;                // visible keys per row of the few-rows path
};

// Causal attention (CausalAttention in ops.h). Work goes in blocks of 16 rows × the query
// heads of one KV head: the block's scores over the keys any of its rows sees (16 × heads ×
// n_keys floats per thread, never rows × keys), softmax per query over its own keys, then the
// weighted sum of values in ascending position. Each query's bits depend only on its own keys
// (batch invariance, docs/decisions/0001-batch-invariant-cpu-kernels.md) and equal Dot /
// ScaledSoftmax / Axpy one query at a time. Too few blocks to occupy the threads (decode: one row
// per sequence) takes another split with the same bits: scores by key tiles, then the weighted sums
// by output elements.
void AttendCausal(const CausalAttention& a, ThreadPool& pool, AttentionScratch* scratch);

// A layer's decode rows for the whole batch (Ops::AttendGroups): one task list over every
// (group, KV head) pair — scores by key tiles, softmax per query, weighted sums by head-dim
// pieces — so a batch costs three fork-joins, not three per sequence. Each row's bits equal
// its group alone, and one row at a time over its visible keys: scores are per-pair Dot bits,
// a hidden key gets probability 0 (it adds nothing to a weighted sum of finite values), and
// the pieces of a weighted sum are independent.
void AttendGroups(absl::Span<const AttentionGroup> groups, const AttentionShape& shape, float scale, ThreadPool& pool,
                  AttentionScratch* scratch);

}  // namespace dd::backend::cpu
