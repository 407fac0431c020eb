// Exact causal attention over KV rows held as runs of consecutive positions — the one
// implementation behind the dense cache and the sparse cache's prefill, so both give the
// same bits for the same keys.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "decode-worker/model/attention.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

// `len` consecutive positions stored as consecutive rows of n_head_kv × head_dim floats;
// k and v point at the first position's row.
struct KvRun {
  const float* k;
  const float* v;
  int64_t len;
};

struct AttentionScratch {
  std::vector<const float*> keys, values;  // per KV head, one pointer per key position
  std::vector<float> q, scores;            // the few-rows path (decode)
  std::vector<float*> outs;
  std::vector<int64_t> offsets, first_tiles;  // AttendRowToLists' per-KV-head prefix sums
};

// Rows [r0, r1) of `call` belong to one sequence. `runs` hold, in order, the positions
// [lo, call.rows[r1-1].pos]. Row r attends to [first, pos] with first = pos - window + 1
// (clamped to 0) on sliding calls and 0 otherwise; first must not be below lo.
//
// Work goes in blocks of 16 rows × the query heads of one KV head: the block's scores over
// the keys any of its rows sees (16 × heads × n_keys floats per thread, never rows × keys),
// softmax per query over its own keys, then the weighted sum of values in ascending position.
// Each query's bits depend only on its own keys (DESIGN §5 batch invariance), and equal
// Dot / ScaledSoftmax / Axpy one query at a time, as the sparse cache computes them.
// Too few blocks to occupy the threads (decode: one row per sequence) takes another split
// with the same bits: scores by key tiles, then the weighted sums by output elements.
void AttendCausal(const model::AttentionCall& call, const model::ModelConfig& config, int64_t r0, int64_t r1,
                  int64_t lo, absl::Span<const KvRun> runs, ThreadPool& pool, AttentionScratch* scratch);

// One KV head's keys for a decode row, one pointer per key (and its value) in order.
struct KeyValueList {
  const float* const* keys;
  const float* const* values;
  int64_t n;
};

// One decode row over per-KV-head key lists (the sparse cache's selection): KV head g's query
// heads (q + g × heads-per-group × head_dim, contiguous) attend to all of lists[g]; out_row
// gets n_head × head_dim. Split over `pool` like the few-rows path above (scores by key tiles,
// softmax per head, weighted sums by head-dim pieces), so the bits equal one query at a time.
void AttendRowToLists(const float* q, const model::ModelConfig& config, float scale,
                      absl::Span<const KeyValueList> lists, float* out_row, ThreadPool& pool,
                      AttentionScratch* scratch);

// A decode row of AttendRowsToLists: n_head × head_dim query and output; the row sees every
// key of each list but the last `hidden_tail`.
struct ListQuery {
  const float* q;
  float* out;
  int64_t hidden_tail = 0;
};

// Several decode rows over the same key lists in one pass: each key and value is loaded once
// for all rows' query heads (the dual-token step's real and speculative rows read the same
// blocks; the speculative row sees one more key, its own). Each row's bits equal
// AttendRowToLists over its visible keys: scores are per-pair Dot bits, and a hidden key
// gets probability 0, which adds nothing to a weighted sum of finite values.
void AttendRowsToLists(absl::Span<const ListQuery> rows, const model::ModelConfig& config, float scale,
                       absl::Span<const KeyValueList> lists, ThreadPool& pool, AttentionScratch* scratch);

}  // namespace dd::engine
