// The compute-backend seam, ops half: the forward pass's operations for Gemma 3 and
// Llama-architecture models, as one backend runs them on its compute queue.
//
// The contract every backend keeps: a row's bits depend only on that row — not on how many
// rows share the call, where the row sits in it, or how many threads run it (batch
// invariance, docs/decisions/0001-batch-invariant-cpu-kernels.md). That is what keeps
// `dualdecoder`'s real rows bit-identical to `sparse` while the speculative rows share every call.
//
// Float pointers are device memory of the backend (host memory on the CPU); spans of
// integers (tokens, positions, row lists) and `inv_freq` are host memory, read before the
// call returns. Rows of activations are contiguous with the given stride, in floats.
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "common/kv_dtype.h"
#include "dd/kernels/dtype.h"

namespace dd::backend {

// How a quantized weight matrix multiplies activations:
//   kInt8: activations quantized per row to int8 blocks of 32, integer dot products (fast);
//   kF32:  weights dequantized to f32, f32 dot products (exact w.r.t. the file's weights).
enum class LinearKind { kInt8, kF32 };

enum class GatedActivation { kGeluTanh, kSilu };

// Attention heads: n_head query heads in n_head_kv groups (GQA), head_dim elements each; keys
// and values are kept in `kv` (widened to f32 in registers), queries and outputs are f32.
struct AttentionShape {
  int64_t n_head = 0, n_head_kv = 0, head_dim = 0;
  KvDtype kv = KvDtype::kF32;
};

// `len` consecutive positions stored as consecutive rows of n_head_kv × head_dim elements of
// the shape's KV type; k and v point at the first position's row.
struct KvRun {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t len = 0;
};

// Causal attention for rows of one sequence over its KV held as runs (prefill, and dense
// decode). Row r (query q + r × n_head × head_dim, output likewise) at positions[r] sees
// positions [first, positions[r]] with first = positions[r] - window + 1 (clamped to 0) when
// `sliding`, else 0; the runs hold, in order, positions [lo, the last row's position], and
// first must not be below lo.
struct CausalAttention {
  AttentionShape shape;
  float scale = 1.0f;
  bool sliding = false;
  int64_t window = 0;
  const float* q = nullptr;
  float* out = nullptr;
  absl::Span<const int64_t> positions;
  int64_t lo = 0;
  absl::Span<const KvRun> runs;
};

// One KV head's keys for decode rows, one pointer per key (and its value, head_dim elements of
// the shape's KV type), in the order the weighted sum adds them (ascending logical position).
struct KeyValueList {
  const void* const* keys = nullptr;
  const void* const* values = nullptr;
  int64_t n = 0;
};

// A decode row attending over key lists: n_head × head_dim query and output; it sees every
// key of each list but the last `hidden_tail` (the dual-token step's real row does not see
// the speculative row's key).
struct ListQuery {
  const float* q = nullptr;
  float* out = nullptr;
  int64_t hidden_tail = 0;
};

// One sequence's decode rows of a layer (its real row, its speculative row, or both) over its
// own per-KV-head key lists (n_head_kv of them, lists[g] for group g).
struct AttentionGroup {
  absl::Span<const ListQuery> rows;
  absl::Span<const KeyValueList> lists;
};

// One list of a chunk selection: `rows` query heads' scores of n = chunks.size() chunks (row h
// at scores + h × n, device memory), the chunks' ids (host memory), where the best go (device
// memory, `take` of them at most) and whether the best k are written in order.
struct ChunkScores {
  const float* scores = nullptr;
  absl::Span<const int64_t> chunks;
  int64_t* ids = nullptr;
  int64_t take = 0;
  bool sorted = false;
};

// A sparse layer's low-rank key cache (docs/decisions/0052-low-rank-key-reconstruction.md):
// each position's key before its rotation, the KV heads stacked (kv_dim = n_head_kv × head_dim
// floats), kept as `rank` coefficients over an orthonormal basis of `rank` rows of kv_dim floats
// (f32, device memory). The rotation is the model's (kernels::ApplyRope on each head: `half`
// pairs from `inv_freq`, host memory; neox pairs (i, i + half), else (2i, 2i + 1)); a rebuild's
// angles may differ from kernels::RopeAngles' in the last bit (rebuilt keys approximate anyway).
struct LowRankKeys {
  const float* basis = nullptr;
  int64_t rank = 0, n_head_kv = 0, head_dim = 0;
  const float* inv_freq = nullptr;
  int64_t half = 0;
  bool neox = false;
  KvDtype kv = KvDtype::kF32;  // the key rows' type
  int64_t kv_dim() const { return n_head_kv * head_dim; }
};

class Ops {
 public:
  virtual ~Ops() = default;

  // x[i] = table row tokens[i] (dequantized) × scale, d = table.cols floats per row.
  virtual void Embed(const kernels::WeightView& table, absl::Span<const int32_t> tokens, float scale,
                     float* x) = 0;
  // Rotary angles of each position: cos/sin[i * half + j] of positions[i] * inv_freq[j].
  virtual void RopeAngles(const float* inv_freq, int64_t half, absl::Span<const int64_t> positions, float* cos,
                          float* sin) = 0;
  // y[r] = x[r] / rms(x[r]) * w for n_rows rows of d floats (w may be null: no scale; y may
  // alias x).
  virtual void RmsNormRows(const float* x, const float* w, float eps, int64_t n_rows, int64_t d, float* y) = 0;
  // y[j] = RmsNorm(x[rows[j]]) for the listed rows of d floats: the final norm of the rows
  // that want logits, packed.
  virtual void RmsNormSelected(const float* x, absl::Span<const int64_t> rows, const float* w, float eps, int64_t d,
                               float* y) = 0;
  // y[r][n] = sum_k x[r][k] W[n][k] (+ bias[n]) for n_rows rows; bias may be null.
  virtual void Linear(const kernels::WeightView& w, LinearKind kind, const float* x, int64_t n_rows,
                      int64_t x_stride, const float* bias, float* y, int64_t y_stride) = 0;
  // For each row r and head h of x (n_heads heads of head_dim floats from x + r * row_stride):
  // RmsNorm with `norm_w` first when it is not null, then the rotation by row r's angles
  // (cos/sin + r * half); neox pairs (i, i + half), otherwise (2i, 2i + 1).
  virtual void HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                            const float* norm_w, float eps, const float* cos, const float* sin, int64_t half,
                            bool neox) = 0;
  // out = act(gate) * up over n_rows rows of n floats (out may alias gate).
  virtual void GatedMul(GatedActivation act, const float* gate, const float* up, float* out, int64_t n_rows,
                        int64_t n) = 0;
  // x += y over n floats (the residual add).
  virtual void Add(float* x, const float* y, int64_t n) = 0;
  // x = cap * tanh(x / cap) over n floats (final logit softcapping).
  virtual void Softcap(float* x, int64_t n, float cap) = 0;

  // ---- attention ----
  // Each query's bits depend only on its own keys: scores are per-pair dot products in one
  // fixed order, the softmax is per query, and values are added in list order from zero.
  virtual void AttendCausal(const CausalAttention& a) = 0;
  // A layer's decode rows for the whole batch in one call (the host-built attention plan):
  // each group's rows over the group's lists, every key and value read once for all of the
  // group's rows (a dual-token step's real and speculative rows share their lists). A row's
  // bits equal those of its group alone, whatever the other groups.
  virtual void AttendGroups(absl::Span<const AttentionGroup> groups, const AttentionShape& shape, float scale) = 0;
  // s[i × ld + j] = q_i · keys[j] for nq queries of head_dim (contiguous) and nk keys: landmark
  // scores for chunk selection, with the bits of the attention scores. Safe to call from
  // several threads at once.
  virtual void KeyScores(const float* q, int64_t nq, int64_t head_dim, const float* const* keys, int64_t nk,
                         float* s, int64_t ld) = 0;
  // Landmarks of n chunks of `chunk` key rows: out[c × kv_dim + j] (f32) = the mean of element
  // j of rows[c × chunk + t] over t < chunk (each row kv_dim elements of type t), summed in
  // double in row order from zero and rounded once, so every backend writes the same bits.
  // Computed where the keys are: no copy to the host.
  virtual void ChunkMeans(const void* const* rows, KvDtype t, int64_t n, int64_t chunk, int64_t kv_dim,
                          float* out) = 0;
  // out = n floats of x in type t: a copy for f32; f16 rounds to nearest even, and a finite
  // value beyond ±65504 saturates there and is counted in KvOverflows() (infinities and NaNs
  // pass through uncounted). How K and V rows enter a cache.
  virtual void StoreKv(const float* x, int64_t n, KvDtype t, void* out) = 0;
  // Finite values StoreKv saturated so far, counted as the compute queue runs them (a metric:
  // read without waiting, so work still queued may not be in it yet).
  virtual int64_t KvOverflows() = 0;

  // ---- low-rank keys ----
  // out[i × rank + j] (f32) = basis row j · key i unrotated, for the key rows rows[i] (kv_dim
  // elements of f.kv each) at positions[i]: their coefficients. Dot products in element order
  // from zero, so every row's bits depend on that row alone.
  virtual void ProjectKeys(const LowRankKeys& f, const void* const* rows, absl::Span<const int64_t> positions,
                           float* out) = 0;
  // Keys rebuilt from coefficients, one KV head of one chunk per item: item i's `chunk`
  // positions from first[i] on have their coefficients at coeffs[i] (chunk × rank f32); KV
  // head heads[i] of each position's key, Σ_j coefficient j × (basis row j's part for that
  // head) summed in j order from zero, rotated to its position and narrowed to f.kv (as
  // StoreKv does, uncounted), goes to out[i] + t × head_dim elements: the K half of the
  // chunk's block for that head.
  virtual void ReconstructKeys(const LowRankKeys& f, const float* const* coeffs, absl::Span<const int64_t> first,
                               absl::Span<const int32_t> heads, int64_t chunk, void* const* out) = 0;

  // ---- chunk selection ----
  // Top-k per list: a chunk's score is the max over the rows; the order is higher first, ties
  // to the lower chunk id (−0 ties +0). Writes the best min(n, take) ids: the best min(n, k)
  // first — best to worst when `sorted`, else in any order — then the rest in any order (the
  // speculative row's shortlist). Comparisons only: every backend writes the same set.
  virtual void TopChunks(absl::Span<const ChunkScores> lists, int64_t rows, int64_t k) = 0;

  // ---- the speculative row's context head ----
  // out rows (d = w.cols floats each) = the listed rows of w, dequantized.
  virtual void DequantizeRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, float* out) = 0;
  // out[i] = rows[i] · x over d floats.
  virtual void DotRows(absl::Span<const float* const> rows, const float* x, int64_t d, float* out) = 0;
  // out[i] = (row ids[i] of w, dequantized) · x over w.cols floats: the same bits as
  // DequantizeRows then DotRows, without holding the dequantized rows.
  virtual void ScoreRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, const float* x,
                         float* out) = 0;
  // out[r] (int32, device memory) = the first index of the largest of row r's n floats
  // (x + r × n); NaNs never win and a NaN first element gives 0 (kernels::ArgmaxFirst, greedy
  // sampling's rule): a speculative row's token without its logits leaving the device.
  virtual void ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) = 0;

  // A static segment: the calls between BeginSegment and EndSegment, made by the thread that
  // began it, form a run the backend may record and replay as one launch (CUDA graphs) when
  // every argument equals the last run's under the same key; `key` names the run's place in
  // the pass (e.g. a layer's half), never its arguments. The calls' effects are in order with
  // everything else on the compute queue; the backend may defer their launch until the
  // segment ends or the thread makes any other call on the device. Backends without such a
  // launch ignore it (the default).
  virtual void BeginSegment(int64_t /*key*/) {}
  virtual void EndSegment() {}
};

}  // namespace dd::backend
