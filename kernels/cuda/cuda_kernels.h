// The CUDA backend's kernels, as launches on a stream with every argument in device memory
// (cuda_ops.cc stages the host-side lists first). Internal to kernels/cuda: it names
// cudaStream_t. Each launch returns the launch error (cudaSuccess when queued).
//
// Batch invariance (ops.h): every kernel computes a row (a query head, an output element) with
// one thread block or warp whose reduction order is fixed by the shape alone — never by the
// number of rows, the row's place in the call, or a split chosen from the batch — and no float
// reduction uses atomics. So a row's bits are the same alone and in any batch.
//
//   cuda_elementwise.cu  dequantized rows, rotary angles, norms, gated products, residual add,
//                        softcap, dot products, host-region gathers
//   cuda_linear.cu       the quantized linear layer (int8 activations) and its f32 path
//   cuda_attention.cu    causal and list attention, landmark scores, top chunks
//   cuda_low_rank.cu     the low-rank key cache: projection and reconstruction
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/key_segments.h"
#include "dd/kernels/dtype.h"

namespace dd::kernels::cuda {

// Largest head_dim the attention kernels take (Gemma 3: 256, Llama: 128).
constexpr int64_t kMaxHeadDim = 256;

// A weight matrix on the device (WeightView without the host types' constructors).
struct DevWeights {
  DType type;
  const uint8_t* data;
  int64_t rows, cols, row_bytes;
};

// out[i × d + j] = element j of row ids[i] of w, dequantized, × scale (d = w.cols).
cudaError_t DequantRows(const DevWeights& w, const int32_t* ids, int64_t n, float scale, float* out,
                        cudaStream_t s);
// cos/sin[i × half + j] of positions[i] × inv_freq[j], in double like the CPU.
cudaError_t RopeAngles(const float* inv_freq, int64_t half, const int64_t* positions, int64_t n, float* cos,
                       float* sin, cudaStream_t s);
// y[j] = RmsNorm(x[rows ? rows[j] : j]) × w for n rows of d floats (w may be null).
cudaError_t RmsNormRows(const float* x, const int64_t* rows, const float* w, float eps, int64_t n, int64_t d,
                        float* y, cudaStream_t s);
cudaError_t HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                         const float* norm_w, float eps, const float* cos, const float* sin, int64_t half, bool neox,
                         cudaStream_t s);
// act: 0 = GELU (tanh), 1 = SiLU.
cudaError_t GatedMul(int act, const float* gate, const float* up, float* out, int64_t n, cudaStream_t s);
cudaError_t Add(float* x, const float* y, int64_t n, cudaStream_t s);
cudaError_t Softcap(float* x, int64_t n, float cap, cudaStream_t s);
// out[i] = rows[i] · x over d floats.
cudaError_t DotRows(const float* const* rows, int64_t n, const float* x, int64_t d, float* out, cudaStream_t s);
// out[c × kv_dim + j] = the mean of element j of rows[c × chunk + t], t < chunk, for n chunks:
// summed in double in row order, rounded once (the CPU's bits); rows are f16 bits when f16.
cudaError_t ChunkMeans(const void* const* rows, bool f16, int64_t n, int64_t chunk, int64_t kv_dim, float* out,
                       cudaStream_t s);
// A low-rank key cache's shape (dd/backend/ops.h, LowRankKeys) with its device pointers:
// basis (rank × n_head_kv·head_dim f32) and inv_freq (half floats, staged).
struct LowRankShape {
  const float* basis;
  const float* inv_freq;
  int64_t rank, n_head_kv, head_dim, half;
  bool neox, f16;
};
// Ops::ProjectKeys for n rows (rows, positions: device arrays).
cudaError_t ProjectKeys(const LowRankShape& f, const void* const* rows, const int64_t* positions, int64_t n, float* out,
                        cudaStream_t s);
// Ops::ReconstructKeys for n items (coeffs, first, heads, out: device arrays).
cudaError_t ReconstructKeys(const LowRankShape& f, const float* const* coeffs, const int64_t* first,
                            const int32_t* heads, int64_t n, int64_t chunk, void* const* out, cudaStream_t s);
// out = x's n floats as f16 bits (round to nearest even); a finite value beyond ±65504 becomes
// ±65504 and adds one to *saturated (memory the device may write: mapped host memory).
cudaError_t StoreF16(const float* x, int64_t n, uint16_t* out, unsigned long long* saturated, cudaStream_t s);
// out[r] = the first index of the largest of row r's n floats (x + r × n), NaNs never winning,
// 0 for a NaN first element (kernels::ArgmaxFirst): one block per row; the answer (the least
// index holding the largest value) does not depend on the order of the comparisons.
cudaError_t ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out, cudaStream_t s);
// out[i] = (row ids[i] of w, dequantized) · x.
cudaError_t ScoreRows(const DevWeights& w, const int32_t* ids, int64_t n, const float* x, float* out,
                      cudaStream_t s);
// Each pair (src, dst) of `pairs` (2 × n int64) copies `block_bytes` from src + pair.src
// (mapped host memory) to dst + pair.dst.
cudaError_t GatherPairs(const uint8_t* src, const int64_t* pairs, int64_t n, int64_t block_bytes, uint8_t* dst,
                        cudaStream_t s);

// ---- linear (cuda_linear.cu) ----
// Bytes of the quantized activations of `rows` rows of k (a multiple of 32) for LinearInt8,
// which takes the types the CPU's int8 path takes (MatMulInt8Supports).
int64_t Int8ActsBytes(int64_t rows, int64_t k);
// y[r × y_stride + n] = Σ_k x[r × x_stride + k] W[n][k] (+ bias[n]) with the activations
// quantized to int8 blocks of 32 into `acts` (Int8ActsBytes of device scratch) and, per
// output, the CPU's reference order (kernels/cpu/matmul_int8_rows.cc: RowDot): one integer
// dot per block, acc = fma(dot, scale · act_scale, acc), then the min term, blocks ascending.
cudaError_t LinearInt8(const DevWeights& w, const float* x, int64_t rows, int64_t x_stride, const float* bias,
                       float* y, int64_t y_stride, void* acts, cudaStream_t s);
// The same product in f32 (weights dequantized per element): any weight type.
cudaError_t LinearF32(const DevWeights& w, const float* x, int64_t rows, int64_t x_stride, const float* bias,
                      float* y, int64_t y_stride, cudaStream_t s);

// ---- attention (cuda_attention.cu) ----
// kv_f16: keys and values are f16 bits (KvDtype::kF16), else f32.
struct DevShape {
  int32_t n_head, n_head_kv, head_dim, kv_f16;
};
struct DevRun {
  const void* k;
  const void* v;
  int64_t len;
};
// ops.h CausalAttention with positions and runs in device memory.
cudaError_t AttendCausal(const DevShape& shape, float scale, bool sliding, int64_t window, const float* q,
                         float* out, const int64_t* positions, int64_t n_rows, int64_t lo, const DevRun* runs,
                         int32_t n_runs, cudaStream_t s);
// A decode row of AttendGroups: its query, output, hidden tail and the index of its group's
// first list (lists[first_list + g] for KV head g).
struct DevListRow {
  const float* q;
  float* out;
  int64_t hidden_tail;
  int64_t first_list;
};
// A key list of n keys in n_segs runs: segs[seg_offset, seg_offset + n_segs) (key_segments.h).
struct DevList {
  int64_t seg_offset, n_segs, n;
};
cudaError_t AttendLists(const DevShape& shape, float scale, const DevListRow* rows, int64_t n_rows,
                        const DevList* lists, const KeySeg* segs, cudaStream_t s);
static_assert(sizeof(KeySeg) == 32 && sizeof(DevList) == 24, "the host fills these for the device");
// s[i × ld + j] = q_i · key j for nq queries and nk keys of head_dim floats: the keys in n_segs
// runs (segs), or, with segs null, one pointer each (ptrs).
cudaError_t KeyScores(const float* q, int64_t nq, int64_t head_dim, const KeySeg* segs, int64_t n_segs,
                      const float* const* ptrs, int64_t nk, float* s, int64_t ld, cudaStream_t stream);
// One list of TopChunks (ops.h ChunkScores) with its chunk ids on the device, and `scratch`
// for min(n, take) keys.
struct DevChunkList {
  const float* scores;
  const int64_t* chunks;
  int64_t n;
  int64_t* ids;
  int64_t take;
  uint64_t* scratch;
};
// Writes each list's best min(n, take) ids best to worst (the CPU's order for the sorted best
// k; a valid order for the rest). A list's chunk ids are unique (below 2^32).
cudaError_t TopChunks(const DevChunkList* lists, int64_t n_lists, int64_t rows, cudaStream_t s);

}  // namespace dd::kernels::cuda
