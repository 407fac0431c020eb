// CPU reference kernels (always built). Plain C++ types only; the readable reference that
// the CUDA kernels are tested against.
//
// Batch invariance (docs/decisions/0001-batch-invariant-cpu-kernels.md): every output element is
// reduced in a fixed order that does not depend on the batch size (m) or the thread count — work is
// split over output rows and columns, never over the reduction dimension.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "common/kv_dtype.h"
#include "common/thread_pool.h"
#include "dd/kernels/dtype.h"

namespace dd::kernels {

// Dequantizes `n` elements (a multiple of the block size) starting at `src` into `dst`.
void DequantizeRow(DType t, const void* src, float* dst, int64_t n);

// y[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n] if bias != nullptr), for m in [0, m_rows).
// x is m_rows × w.cols f32 (row stride x_stride), y is m_rows × w.rows (row stride y_stride).
void MatMul(const WeightView& w, const float* x, int64_t m_rows, int64_t x_stride,
            const float* bias, float* y, int64_t y_stride, ThreadPool& pool);

// The first index of the largest of x[0, n); NaNs never win, and a NaN at index 0 (or n <= 0)
// gives 0: what the plain scan `if (x[i] > x[best]) best = i` from best = 0 returns. Greedy
// sampling's rule, and Ops::ArgmaxRows'.
int32_t ArgmaxFirst(const float* x, int64_t n);

// Dot product of two f32 vectors with the fixed 16-lane reduction order used everywhere.
float Dot(const float* a, const float* b, int64_t n);

// y = x / rms(x) * w over n elements (w may be nullptr for no scale).
void RmsNorm(const float* x, const float* w, float eps, int64_t n, float* y);

// Rotary embedding. RopeAngles fills cos/sin of pos * inv_freq[i] for the rot_dim/2 pairs
// (computed once per position and shared by all heads); ApplyRope rotates one head in place.
// neox: pairs are (i, i + rot_dim/2) (rotate-half); otherwise adjacent (2i, 2i+1).
void RopeAngles(const float* inv_freq, int64_t half, int64_t pos, float* cos_out, float* sin_out);
void ApplyRope(float* head, int64_t half, const float* cos, const float* sin, bool neox);

// Softmax of x[0..n) scaled by `scale`, in place: x[i] = exp(scale*x[i] - max) / sum.
// Vectorized exp (max error ~2 ulp); the result depends only on x, never on threads.
void ScaledSoftmax(float* x, int64_t n, float scale);

// y[i] += a * x[i]. One implementation shared by every attention path, so that equal inputs
// give equal bits whichever cache computed them.
void Axpy(float a, const float* x, float* y, int64_t n);

// Blocked attention (kernels/cpu/attention.cc), bit-identical to the pair-at-a-time
// reference, so every cache gets the same bits whichever it uses:
// s[i * ld + j] = Dot(keys[j], q + i * hd, hd) for i < nq, j < nk (queries contiguous).
void AttentionScores(const float* q, int64_t nq, int64_t hd, const float* const* keys, int64_t nk, float* s,
                     int64_t ld);
// outs[i][e] for e in [e0, e1) = sum over ascending j < nk of p[i * ld + j] * values[j][e],
// accumulated from zero exactly as repeated Axpy calls would (a zero probability adds nothing
// for finite values). Element ranges are independent, so threads may split them.
void AttentionWeightedSum(const float* p, int64_t ld, int64_t nq, const float* const* values, int64_t nk,
                          int64_t e0, int64_t e1, float* const* outs);
// The same over KV rows of type `t` given by untyped pointers: f16 rows are widened to f32
// exactly on load, so the bits equal the f32 functions' on the widened rows.
void AttentionScores(const float* q, int64_t nq, int64_t hd, const void* const* keys, KvDtype t, int64_t nk, float* s,
                     int64_t ld);
void AttentionWeightedSum(const float* p, int64_t ld, int64_t nq, const void* const* values, KvDtype t, int64_t nk,
                          int64_t e0, int64_t e1, float* const* outs);

float GeluTanh(float x);
// out[i] = act(gate[i]) * up[i] over n elements (the gated MLP), with GELU (tanh form) or SiLU.
// exp comes from a vectorizable polynomial (relative error below 3e-7), not libm: these loops
// were 15% of Gemma's prefill through tanhf/expm1f calls. out may alias gate.
void GeluTanhMul(const float* gate, const float* up, float* out, int64_t n);
void SiluMul(const float* gate, const float* up, float* out, int64_t n);
float Silu(float x);

}  // namespace dd::kernels

namespace dd::kernels {

// ---- int8 fast path (kernels/cpu/matmul_int8.cc) ----
//
// Quantizes `k` (a multiple of 32) activations to int8 blocks of 32 with one f32 scale per
// block: d = max|x| / 127, q = round-half-even(x * (127 / max|x|)), and q = 0, d = 0 for a
// block whose max|x| is below 1e-30 (all-zero or negligible). Finite input only. Used by
// MatMulInt8; exposed so tests can build an exact reference from the same quantized activations.
void QuantizeRowInt8Blocks(const float* x, int64_t k, int8_t* q, float* d);

// True for the weight types MatMulInt8 handles (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K); the f32/f16/bf16
// types stay on MatMul.
bool MatMulInt8Supports(DType t);

// Same contract as MatMul, but each activation row is first quantized with
// QuantizeRowInt8Blocks and each output is a sum over blocks of (f32 scale product) x (exact
// integer dot product of int8 activations and integer weight codes), so results differ from
// MatMul by the activation quantization error (at most sum_b d_b/2 * sum_{i in b} |w_i|).
// Batch invariant: a row's output is bit-identical whatever m_rows and the pool size are.
// Calls too small to amortize a ParallelFor run on the calling thread alone. Unsupported weight
// types are forwarded to MatMul. Thread-compatible like MatMul (one call at a time per pool).
void MatMulInt8(const WeightView& w, const float* x, int64_t m_rows, int64_t x_stride,
                const float* bias, float* y, int64_t y_stride, ThreadPool& pool);

}  // namespace dd::kernels
