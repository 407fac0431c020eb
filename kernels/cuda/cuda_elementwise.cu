// The CUDA backend's per-element and per-row kernels (cuda_kernels.h). Reductions (norms, dot
// products) run in one block or warp per row with a fixed tree: the same order for every batch.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/cuda_blocks.cuh"
#include "cuda/cuda_kernels.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

int64_t Blocks(int64_t n, int64_t per) { return (n + per - 1) / per; }

// Sum over the block (blockDim.x = kThreads) in a fixed order; every thread gets the result.
__device__ double BlockSumD(double v, double* shared) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  double t = 0.0;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) t += shared[w];
  __syncthreads();
  return t;
}

__device__ float WarpSum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void DequantRowsKernel(DevWeights w, const int32_t* ids, int64_t n, float scale, float* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * w.cols) return;
  const int64_t i = idx / w.cols, j = idx % w.cols;
  const float v = DequantElem(w.type, w.data + ids[i] * w.row_bytes, j);
  out[i * w.cols + j] = scale != 1.0f ? __fmul_rn(v, scale) : v;
}

__global__ void RopeAnglesKernel(const float* inv_freq, int64_t half, const int64_t* positions, int64_t n,
                                 float* cos_out, float* sin_out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= n * half) return;
  const int64_t i = idx / half, j = idx % half;
  const double theta = static_cast<double>(positions[i]) * inv_freq[j];
  cos_out[idx] = static_cast<float>(cos(theta));
  sin_out[idx] = static_cast<float>(sin(theta));
}

__global__ void RmsNormKernel(const float* x, const int64_t* rows, const float* w, float eps, int64_t d, float* y) {
  __shared__ double shared[kThreads / 32];
  const int64_t r = blockIdx.x;
  const float* xr = x + (rows != nullptr ? rows[r] : r) * d;
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) ss += static_cast<double>(xr[i]) * xr[i];
  ss = BlockSumD(ss, shared);
  const float scale = static_cast<float>(1.0 / sqrt(ss / d + eps));
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    const float v = __fmul_rn(xr[i], scale);
    y[r * d + i] = w != nullptr ? __fmul_rn(v, w[i]) : v;
  }
}

// One block per (row, head): the head in shared memory, normed, then rotated.
__global__ void HeadNormRopeKernel(float* x, int64_t row_stride, int64_t head_dim, const float* norm_w, float eps,
                                   const float* cos, const float* sin, int64_t half, bool neox) {
  __shared__ double shared[kThreads / 32];
  __shared__ float head[kMaxHeadDim];
  const int64_t r = blockIdx.x, h = blockIdx.y;
  float* xh = x + r * row_stride + h * head_dim;
  for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) head[i] = xh[i];
  __syncthreads();
  if (norm_w != nullptr) {
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) ss += static_cast<double>(head[i]) * head[i];
    ss = BlockSumD(ss, shared);
    const float scale = static_cast<float>(1.0 / sqrt(ss / head_dim + eps));
    for (int64_t i = threadIdx.x; i < head_dim; i += blockDim.x) head[i] = __fmul_rn(__fmul_rn(head[i], scale), norm_w[i]);
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = head[a], x1 = head[b], c = cos[r * half + i], s = sin[r * half + i];
    xh[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    xh[b] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
  // Elements outside the rotated pairs (head_dim > 2 × half) keep the normed value.
  for (int64_t i = 2 * half + threadIdx.x; i < head_dim; i += blockDim.x) xh[i] = head[i];
}

__global__ void GatedMulKernel(int act, const float* gate, const float* up, float* out, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = gate[i], u = up[i];
  float a;
  if (act == 0) {
    const float k = 0.7978845608028654f;
    a = 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
  } else {
    a = x / (1.0f + expf(-x));
  }
  out[i] = a * u;
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}

__global__ void SoftcapKernel(float* x, int64_t n, float cap) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// One warp per output.
__global__ void DotRowsKernel(const float* const* rows, int64_t n, const float* x, int64_t d, float* out) {
  const int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (i >= n) return;
  const float* r = rows[i];
  float acc = 0.0f;
  for (int64_t j = lane; j < d; j += 32) acc = fmaf(r[j], x[j], acc);
  acc = WarpSum(acc);
  if (lane == 0) out[i] = acc;
}

// One thread per landmark element; the chunk's rows added in order, in double.
__device__ inline float RowElem(const void* row, int64_t j, bool f16) {
  return f16 ? __half2float(__ushort_as_half(static_cast<const uint16_t*>(row)[j])) : static_cast<const float*>(row)[j];
}

__global__ void ChunkMeansKernel(const void* const* rows, bool f16, int64_t n, int64_t chunk, int64_t kv_dim,
                                 float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * kv_dim) return;
  const int64_t c = i / kv_dim, j = i % kv_dim;
  double sum = 0.0;
  for (int64_t t = 0; t < chunk; ++t) sum = __dadd_rn(sum, static_cast<double>(RowElem(rows[c * chunk + t], j, f16)));
  out[i] = __double2float_rn(__ddiv_rn(sum, static_cast<double>(chunk)));
}

__global__ void StoreF16Kernel(const float* x, int64_t n, uint16_t* out, unsigned long long* saturated) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  float v = x[i];
  if (isfinite(v) && fabsf(v) > 65504.0f) {
    v = copysignf(65504.0f, v);
    atomicAdd(saturated, 1ull);
  }
  out[i] = __half_as_ushort(__float2half_rn(v));
}

__global__ void ScoreRowsKernel(DevWeights w, const int32_t* ids, int64_t n, const float* x, float* out) {
  const int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (i >= n) return;
  const uint8_t* row = w.data + ids[i] * w.row_bytes;
  float acc = 0.0f;
  for (int64_t j = lane; j < w.cols; j += 32) acc = fmaf(DequantElem(w.type, row, j), x[j], acc);
  acc = WarpSum(acc);
  if (lane == 0) out[i] = acc;
}

// One block per pair; 16-byte words when everything is aligned, else bytes.
__global__ void GatherPairsKernel(const uint8_t* src, const int64_t* pairs, int64_t block_bytes, uint8_t* dst) {
  const uint8_t* from = src + pairs[2 * blockIdx.x];
  uint8_t* to = dst + pairs[2 * blockIdx.x + 1];
  if (((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) | block_bytes) & 15) == 0) {
    const int4* f = reinterpret_cast<const int4*>(from);
    int4* t = reinterpret_cast<int4*>(to);
    for (int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x) t[i] = f[i];
  } else {
    for (int64_t i = threadIdx.x; i < block_bytes; i += blockDim.x) to[i] = from[i];
  }
}

// One block per row: each thread the least index of its largest non-NaN value (strided), then
// a tree over the threads keeping the larger value, the lesser index on equal values.
__global__ void ArgmaxRowsKernel(const float* x, int64_t n, int32_t* out) {
  constexpr int64_t kNone = 0x7fffffffffffffffLL;
  const float* row = x + blockIdx.x * n;
  float best = -INFINITY;
  int64_t at = kNone;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    if (v > best || (v == best && at == kNone)) {  // false for NaN; increasing i: the first equal
      best = v;
      at = i;
    }
  }
  __shared__ float vals[kThreads];
  __shared__ int64_t idx[kThreads];
  vals[threadIdx.x] = best;
  idx[threadIdx.x] = at;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float v = vals[threadIdx.x + stride];
      const int64_t j = idx[threadIdx.x + stride];
      if (j != kNone && (idx[threadIdx.x] == kNone || v > vals[threadIdx.x] ||
                         (v == vals[threadIdx.x] && j < idx[threadIdx.x]))) {
        vals[threadIdx.x] = v;
        idx[threadIdx.x] = j;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = (n <= 0 || isnan(row[0]) || idx[0] == kNone) ? 0 : static_cast<int32_t>(idx[0]);
}

}  // namespace

cudaError_t ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out, cudaStream_t s) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff || n > 0x7fffffff) return cudaErrorInvalidValue;
  ArgmaxRowsKernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(x, n, out);
  return cudaGetLastError();
}

cudaError_t DequantRows(const DevWeights& w, const int32_t* ids, int64_t n, float scale, float* out, cudaStream_t s) {
  if (n <= 0 || w.cols <= 0) return cudaSuccess;
  DequantRowsKernel<<<Blocks(n * w.cols, kThreads), kThreads, 0, s>>>(w, ids, n, scale, out);
  return cudaGetLastError();
}

cudaError_t RopeAngles(const float* inv_freq, int64_t half, const int64_t* positions, int64_t n, float* cos,
                       float* sin, cudaStream_t s) {
  if (n <= 0 || half <= 0) return cudaSuccess;
  RopeAnglesKernel<<<Blocks(n * half, kThreads), kThreads, 0, s>>>(inv_freq, half, positions, n, cos, sin);
  return cudaGetLastError();
}

cudaError_t RmsNormRows(const float* x, const int64_t* rows, const float* w, float eps, int64_t n, int64_t d, float* y,
                        cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  RmsNormKernel<<<n, kThreads, 0, s>>>(x, rows, w, eps, d, y);
  return cudaGetLastError();
}

cudaError_t HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                         const float* norm_w, float eps, const float* cos, const float* sin, int64_t half, bool neox,
                         cudaStream_t s) {
  if (n_rows <= 0 || n_heads <= 0) return cudaSuccess;
  if (head_dim > kMaxHeadDim || 2 * half > head_dim || n_heads > 65535) return cudaErrorInvalidValue;
  HeadNormRopeKernel<<<dim3(static_cast<unsigned>(n_rows), static_cast<unsigned>(n_heads)), kThreads, 0, s>>>(
      x, row_stride, head_dim, norm_w, eps, cos, sin, half, neox);
  return cudaGetLastError();
}

cudaError_t GatedMul(int act, const float* gate, const float* up, float* out, int64_t n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  GatedMulKernel<<<Blocks(n, kThreads), kThreads, 0, s>>>(act, gate, up, out, n);
  return cudaGetLastError();
}

cudaError_t Add(float* x, const float* y, int64_t n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  AddKernel<<<Blocks(n, kThreads), kThreads, 0, s>>>(x, y, n);
  return cudaGetLastError();
}

cudaError_t Softcap(float* x, int64_t n, float cap, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  SoftcapKernel<<<Blocks(n, kThreads), kThreads, 0, s>>>(x, n, cap);
  return cudaGetLastError();
}

cudaError_t DotRows(const float* const* rows, int64_t n, const float* x, int64_t d, float* out, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  DotRowsKernel<<<Blocks(n * 32, kThreads), kThreads, 0, s>>>(rows, n, x, d, out);
  return cudaGetLastError();
}

cudaError_t ChunkMeans(const void* const* rows, bool f16, int64_t n, int64_t chunk, int64_t kv_dim, float* out,
                       cudaStream_t s) {
  if (n <= 0 || kv_dim <= 0) return cudaSuccess;
  ChunkMeansKernel<<<Blocks(n * kv_dim, kThreads), kThreads, 0, s>>>(rows, f16, n, chunk, kv_dim, out);
  return cudaGetLastError();
}

cudaError_t StoreF16(const float* x, int64_t n, uint16_t* out, unsigned long long* saturated, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  StoreF16Kernel<<<Blocks(n, kThreads), kThreads, 0, s>>>(x, n, out, saturated);
  return cudaGetLastError();
}

cudaError_t ScoreRows(const DevWeights& w, const int32_t* ids, int64_t n, const float* x, float* out, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  ScoreRowsKernel<<<Blocks(n * 32, kThreads), kThreads, 0, s>>>(w, ids, n, x, out);
  return cudaGetLastError();
}

cudaError_t GatherPairs(const uint8_t* src, const int64_t* pairs, int64_t n, int64_t block_bytes, uint8_t* dst,
                        cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  if (n > 0x7fffffff) return cudaErrorInvalidValue;
  GatherPairsKernel<<<static_cast<unsigned>(n), 128, 0, s>>>(src, pairs, block_bytes, dst);
  return cudaGetLastError();
}

}  // namespace dd::kernels::cuda
