// The CUDA backend's linear layer (cuda_kernels.h).
//
// Int8 path: the activations are quantized per row to int8 blocks of 32 exactly as the CPU's
// QuantizeRowInt8Blocks does, then one warp computes one output for every activation row: lane
// L decodes weight blocks L, L + 32, ... to signed codes (DecodeBlock) and takes their integer
// dots with DP4A (exact); the float chain — acc = fma(dot, scale · act_scale, acc), then the
// min term, blocks ascending — runs in every lane over the 32 blocks of a round, broadcast by
// shuffles. Those are RowDot's operations in RowDot's order (kernels/cpu/matmul_int8_rows.cc),
// so the result is the CPU's to the bit, and a row's result never depends on its batch-mates.
#include <cuda_runtime.h>

#include "cuda/cuda_blocks.cuh"
#include "cuda/cuda_kernels.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 8;  // activation rows per pass over a weight row

// Per quantized row: q[k] int8 | d[nb] f32 | xs[nb] f32 (xs = d · Σq, the min terms' factor).
int64_t ActStride(int64_t k) { return (k + 8 * (k / 32) + 15) / 16 * 16; }

__global__ void QuantizeKernel(const float* x, int64_t rows, int64_t x_stride, int64_t k, uint8_t* acts,
                               int64_t stride) {
  const int64_t nb = k / 32;
  const int64_t wid = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (wid >= rows * nb) return;  // whole warps leave together (the count is in warps)
  const int64_t r = wid / nb, b = wid % nb;
  const float v = x[r * x_stride + b * 32 + lane];
  float amax = fabsf(v);
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const bool zero = !(amax >= 1e-30f);
  const float id = zero ? 0.0f : 127.0f / amax;
  const float d = zero ? 0.0f : amax / 127.0f;
  const int q = __float2int_rn(__fmul_rn(v, id));
  uint8_t* row = acts + r * stride;
  reinterpret_cast<int8_t*>(row)[b * 32 + lane] = static_cast<int8_t>(q);
  int lo = lane < 16 ? q : 0, hi = lane < 16 ? 0 : q;
  for (int o = 16; o > 0; o /= 2) {
    lo += __shfl_xor_sync(0xffffffffu, lo, o);
    hi += __shfl_xor_sync(0xffffffffu, hi, o);
  }
  if (lane == 0) {
    float* dv = reinterpret_cast<float*>(row + k);
    dv[b] = d;
    dv[nb + b] = d * static_cast<float>(lo + hi);
  }
}

__device__ inline int32_t Dot16(const int32_t* w, const int4& a) {
  int32_t s = __dp4a(w[0], a.x, 0);
  s = __dp4a(w[1], a.y, s);
  s = __dp4a(w[2], a.z, s);
  return __dp4a(w[3], a.w, s);
}

__global__ void LinearInt8Kernel(DevWeights w, const uint8_t* acts, int64_t stride, int64_t rows, const float* bias,
                                 float* y, int64_t y_stride) {
  const int64_t n = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (n >= w.rows) return;  // whole warps
  const uint8_t* wrow = w.data + n * w.row_bytes;
  const int64_t k = w.cols, nb = k / 32;
  const bool has_min = w.type == DType::kQ4_1 || w.type == DType::kQ5_1 || w.type == DType::kQ4_K ||
                       w.type == DType::kQ5_K;
  const bool q6 = w.type == DType::kQ6_K;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
    float acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
    for (int64_t base = 0; base < nb; base += 32) {
      const int64_t b = base + lane;
      CodeBlock cb{};
      int32_t dot[kRows];
      for (int r = 0; r < kRows; ++r) dot[r] = 0;
      if (b < nb) {
        cb = DecodeBlock(w.type, wrow, b);
        for (int r = 0; r < nr; ++r) {
          const int4* qa = reinterpret_cast<const int4*>(acts + (r0 + r) * stride + b * 32);
          const int32_t lo = Dot16(cb.w, qa[0]), hi = Dot16(cb.w + 4, qa[1]);
          dot[r] = q6 ? cb.sc_lo * lo + cb.sc_hi * hi : lo + hi;
        }
      }
      const int count = static_cast<int>(nb - base < 32 ? nb - base : 32);
      for (int i = 0; i < count; ++i) {
        const float sc = __shfl_sync(0xffffffffu, cb.scale, i);
        const float ms = __shfl_sync(0xffffffffu, cb.minscale, i);
        for (int r = 0; r < kRows; ++r) {
          const int32_t di = __shfl_sync(0xffffffffu, dot[r], i);
          if (r < nr) {
            const float* dv = reinterpret_cast<const float*>(acts + (r0 + r) * stride + k);
            acc[r] = fmaf(static_cast<float>(di), __fmul_rn(sc, dv[base + i]), acc[r]);
            if (has_min) acc[r] = fmaf(ms, dv[nb + base + i], acc[r]);
          }
        }
      }
    }
    if (lane == 0) {
      for (int r = 0; r < nr; ++r) {
        y[(r0 + r) * y_stride + n] = bias != nullptr ? __fadd_rn(acc[r], bias[n]) : acc[r];
      }
    }
  }
}

__global__ void LinearF32Kernel(DevWeights w, const float* x, int64_t rows, int64_t x_stride, const float* bias,
                                float* y, int64_t y_stride) {
  const int64_t n = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (n >= w.rows) return;
  const uint8_t* wrow = w.data + n * w.row_bytes;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int nr = static_cast<int>(rows - r0 < kRows ? rows - r0 : kRows);
    float acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
    for (int64_t j = lane; j < w.cols; j += 32) {
      const float wv = DequantElem(w.type, wrow, j);
      for (int r = 0; r < nr; ++r) acc[r] = fmaf(wv, x[(r0 + r) * x_stride + j], acc[r]);
    }
    for (int r = 0; r < kRows; ++r) {
      for (int o = 16; o > 0; o /= 2) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
    if (lane == 0) {
      for (int r = 0; r < nr; ++r) {
        y[(r0 + r) * y_stride + n] = bias != nullptr ? __fadd_rn(acc[r], bias[n]) : acc[r];
      }
    }
  }
}

int64_t WarpBlocks(int64_t warps) { return (warps * 32 + kThreads - 1) / kThreads; }

}  // namespace

int64_t Int8ActsBytes(int64_t rows, int64_t k) { return rows * ActStride(k); }

cudaError_t LinearInt8(const DevWeights& w, const float* x, int64_t rows, int64_t x_stride, const float* bias, float* y,
                       int64_t y_stride, void* acts, cudaStream_t s) {
  if (rows <= 0 || w.rows <= 0) return cudaSuccess;
  if (BlockBytesOf(w.type) == 0 || w.cols % 32 != 0 || (reinterpret_cast<uintptr_t>(acts) & 15) != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t stride = ActStride(w.cols);
  uint8_t* a = static_cast<uint8_t*>(acts);
  QuantizeKernel<<<WarpBlocks(rows * (w.cols / 32)), kThreads, 0, s>>>(x, rows, x_stride, w.cols, a, stride);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  LinearInt8Kernel<<<WarpBlocks(w.rows), kThreads, 0, s>>>(w, a, stride, rows, bias, y, y_stride);
  return cudaGetLastError();
}

cudaError_t LinearF32(const DevWeights& w, const float* x, int64_t rows, int64_t x_stride, const float* bias, float* y,
                      int64_t y_stride, cudaStream_t s) {
  if (rows <= 0 || w.rows <= 0) return cudaSuccess;
  LinearF32Kernel<<<WarpBlocks(w.rows), kThreads, 0, s>>>(w, x, rows, x_stride, bias, y, y_stride);
  return cudaGetLastError();
}

}  // namespace dd::kernels::cuda
