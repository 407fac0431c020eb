// Q4_K x int8 matrix-vector products on the GPU; see matvec_cuda.h.
#include <cuda_fp16.h>

#include "cuda/matvec_cuda.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kBlock = 32;            // activation block (and Q4_K sub-block) elements
constexpr int kSuper = 256;           // Q4_K super-block elements
constexpr int kSuperBytes = 144;      // f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
constexpr int kWarpsPerBlock = 8;
constexpr float kMinBlockMax = 1e-30f;  // as the CPU: blocks below quantize to zero

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// One warp per block of 32: the same float operations as QuantizeRowInt8Blocks, in the same
// order (max, 127 / max, max / 127, x * (127 / max) rounded half to even).
__global__ void QuantizeKernel(const float* __restrict__ x, int64_t blocks, int8_t* __restrict__ q,
                               float* __restrict__ d, int32_t* __restrict__ qsum) {
  const int lane = threadIdx.x & 31;
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (b >= blocks) return;  // whole warps leave together: blockDim is a multiple of 32
  const float v = x[b * kBlock + lane];
  float amax = fabsf(v);
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const bool zero = !(amax >= kMinBlockMax);
  const float id = zero ? 0.0f : __fdiv_rn(127.0f, amax);
  const int qi = __float2int_rn(__fmul_rn(v, id));
  q[b * kBlock + lane] = static_cast<int8_t>(qi);
  int s = qi;
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) {
    d[b] = zero ? 0.0f : __fdiv_rn(amax, 127.0f);
    qsum[b] = s;
  }
}

// Sub-block j's (0..7) 6-bit scale and min (GGUF's get_scale_min_k4), from the 12 scale bytes
// held in three words: bytes 0-3 (lo), 4-7 (mid), 8-11 (hi). No indexing of a register array.
__device__ inline void ScaleMin(int j, unsigned lo, unsigned mid, unsigned hi, float* sc, float* m) {
  const int shift = 8 * (j & 3);
  const unsigned a = (lo >> shift) & 0xff, b = (mid >> shift) & 0xff, c = (hi >> shift) & 0xff;
  if (j < 4) {
    *sc = static_cast<float>(a & 63);
    *m = static_cast<float>(b & 63);
  } else {
    *sc = static_cast<float>((c & 0x0f) | ((a >> 6) << 4));
    *m = static_cast<float>((c >> 4) | ((b >> 6) << 4));
  }
}

__device__ inline float HalfBits(unsigned bits) {
  __half_raw r;
  r.x = static_cast<unsigned short>(bits);
  return __half2float(__half(r));
}

// The integer dot product of 32 weight codes with 32 int8 activations: the codes are the low
// (shift 0) or high (shift 4) nibbles of the 32 bytes in n0, n1.
__device__ inline int Dot32(uint4 n0, uint4 n1, int shift, uint4 a0, uint4 a1) {
  constexpr unsigned kMask = 0x0f0f0f0fu;
  int s = 0;
  s = __dp4a(static_cast<int>((n0.x >> shift) & kMask), static_cast<int>(a0.x), s);
  s = __dp4a(static_cast<int>((n0.y >> shift) & kMask), static_cast<int>(a0.y), s);
  s = __dp4a(static_cast<int>((n0.z >> shift) & kMask), static_cast<int>(a0.z), s);
  s = __dp4a(static_cast<int>((n0.w >> shift) & kMask), static_cast<int>(a0.w), s);
  s = __dp4a(static_cast<int>((n1.x >> shift) & kMask), static_cast<int>(a1.x), s);
  s = __dp4a(static_cast<int>((n1.y >> shift) & kMask), static_cast<int>(a1.y), s);
  s = __dp4a(static_cast<int>((n1.z >> shift) & kMask), static_cast<int>(a1.z), s);
  s = __dp4a(static_cast<int>((n1.w >> shift) & kMask), static_cast<int>(a1.w), s);
  return s;
}

// One weight row's share of a 64-element pair: its nibbles and the two sub-blocks' scale
// products.
struct PairWeights {
  uint4 n0, n1;
  float ds0, ms0, ds1, ms1;
};

__device__ inline PairWeights LoadPair(const uint8_t* blk, int p) {
  PairWeights w;
  const uint4 h = *reinterpret_cast<const uint4*>(blk);
  const uint4* nib = reinterpret_cast<const uint4*>(blk + 16 + p * 32);
  w.n0 = nib[0];
  w.n1 = nib[1];
  const float dw = HalfBits(h.x & 0xffffu), dmin = HalfBits(h.x >> 16);
  float sc0, m0, sc1, m1;
  ScaleMin(2 * p, h.y, h.z, h.w, &sc0, &m0);
  ScaleMin(2 * p + 1, h.y, h.z, h.w, &sc1, &m1);
  w.ds0 = __fmul_rn(dw, sc0);
  w.ms0 = __fmul_rn(dmin, m0);
  w.ds1 = __fmul_rn(dw, sc1);
  w.ms1 = __fmul_rn(dmin, m1);
  return w;
}

// One warp per kOutputsPerWarp outputs (weight rows), so each activation row read from L1
// serves that many outputs; kMinBlocks keeps the registers within what that many resident
// blocks of 8 warps allow. Lane l takes the 64-element pairs of sub-blocks l, l + 32, ... (a
// pair shares 32 bytes of nibbles: low nibbles the even sub-block, high the odd one), reading
// its super-block's header in one 16-byte load; for each output and activation row it keeps its
// own f32 sum, then the warp adds the 32 sums in a fixed butterfly. An output's operations
// depend neither on the number of activation rows nor on its warp-mates nor on
// kOutputsPerWarp, so a row's result is the same in any batch and with any variant.
template <int kOutputsPerWarp, int kMinBlocks>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, kMinBlocks)
    MatVecQ4KKernel(const uint8_t* __restrict__ w, int64_t n, int64_t k, const int8_t* __restrict__ q,
                    const float* __restrict__ d, const int32_t* __restrict__ qsum, int rows,
                    float* __restrict__ y, int64_t y_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t first = ((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * kOutputsPerWarp;
  if (first >= n) return;
  const int64_t npairs = k / 64, nsub = k / kBlock, row_bytes = (k / kSuper) * kSuperBytes;
  // A last warp with fewer outputs reads its last row again and does not store it.
  const uint8_t* wrow[kOutputsPerWarp];
#pragma unroll
  for (int o = 0; o < kOutputsPerWarp; ++o) wrow[o] = w + (first + o < n ? first + o : first) * row_bytes;
  float acc[kOutputsPerWarp][kMatVecRows];
#pragma unroll
  for (int o = 0; o < kOutputsPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < kMatVecRows; ++r) acc[o][r] = 0.0f;
  }
  for (int64_t pi = lane; pi < npairs; pi += 32) {
    const int p = static_cast<int>(pi & 3);
    PairWeights pw[kOutputsPerWarp];
#pragma unroll
    for (int o = 0; o < kOutputsPerWarp; ++o) pw[o] = LoadPair(wrow[o] + (pi >> 2) * kSuperBytes, p);
    const int64_t s0 = 2 * pi;  // the even sub-block's index in the row's activation blocks
#pragma unroll
    for (int r = 0; r < kMatVecRows; ++r) {
      if (r < rows) {
        const uint4* a = reinterpret_cast<const uint4*>(q + r * k + s0 * kBlock);
        const uint4 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
        const float2 dx = *reinterpret_cast<const float2*>(d + r * nsub + s0);
        const int2 qs = *reinterpret_cast<const int2*>(qsum + r * nsub + s0);
#pragma unroll
        for (int o = 0; o < kOutputsPerWarp; ++o) {
          const int i0 = Dot32(pw[o].n0, pw[o].n1, 0, a0, a1), i1 = Dot32(pw[o].n0, pw[o].n1, 4, a2, a3);
          // Rounded operations spelled out: no contraction the compiler might choose per slot.
          const float t0 = __fsub_rn(__fmul_rn(pw[o].ds0, static_cast<float>(i0)),
                                     __fmul_rn(pw[o].ms0, static_cast<float>(qs.x)));
          const float t1 = __fsub_rn(__fmul_rn(pw[o].ds1, static_cast<float>(i1)),
                                     __fmul_rn(pw[o].ms1, static_cast<float>(qs.y)));
          acc[o][r] = __fmaf_rn(dx.x, t0, acc[o][r]);
          acc[o][r] = __fmaf_rn(dx.y, t1, acc[o][r]);
        }
      }
    }
  }
#pragma unroll
  for (int o = 0; o < kOutputsPerWarp; ++o) {
#pragma unroll
    for (int r = 0; r < kMatVecRows; ++r) {
      if (r < rows) {
        float v = acc[o][r];
        for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
        if (lane == 0 && first + o < n) y[r * y_stride + first + o] = v;
      }
    }
  }
}

}  // namespace

cudaError_t QuantizeRowsInt8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d,
                             int32_t* qsum, cudaStream_t stream) {
  if (rows < 0 || k <= 0 || k % kBlock != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || q == nullptr || d == nullptr || qsum == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = rows * (k / kBlock);
  const int threads = 32 * kWarpsPerBlock;
  const int64_t grid = (blocks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  QuantizeKernel<<<static_cast<unsigned>(grid), threads, 0, stream>>>(x, blocks, q, d, qsum);
  return cudaGetLastError();
}

cudaError_t MatVecQ4KVariant(int outputs_per_warp, const uint8_t* w, int64_t n, int64_t k, const int8_t* q,
                             const float* d, const int32_t* qsum, int64_t rows, float* y, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || k % kSuper != 0 || rows < 0) return cudaErrorInvalidValue;
  if (outputs_per_warp != 1 && outputs_per_warp != 2 && outputs_per_warp != 4) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (w == nullptr || q == nullptr || d == nullptr || qsum == nullptr || y == nullptr ||
      !Aligned16(w) || !Aligned16(q) || (reinterpret_cast<uintptr_t>(d) & 7) != 0 ||
      (reinterpret_cast<uintptr_t>(qsum) & 7) != 0) {
    return cudaErrorInvalidValue;
  }
  const int threads = 32 * kWarpsPerBlock;
  const int64_t warps = (n + outputs_per_warp - 1) / outputs_per_warp;
  const auto grid = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int64_t nsub = k / kBlock;
  // Fixed groups of kMatVecRows rows: the group a row falls in changes only which pass reads it.
  for (int64_t r0 = 0; r0 < rows; r0 += kMatVecRows) {
    const int in_pass = static_cast<int>(rows - r0 < kMatVecRows ? rows - r0 : kMatVecRows);
    const int8_t* qp = q + r0 * k;
    const float* dp = d + r0 * nsub;
    const int32_t* sp = qsum + r0 * nsub;
    float* yp = y + r0 * n;
    switch (outputs_per_warp) {
      case 1: MatVecQ4KKernel<1, 4><<<grid, threads, 0, stream>>>(w, n, k, qp, dp, sp, in_pass, yp, n); break;
      case 2: MatVecQ4KKernel<2, 3><<<grid, threads, 0, stream>>>(w, n, k, qp, dp, sp, in_pass, yp, n); break;
      default: MatVecQ4KKernel<4, 2><<<grid, threads, 0, stream>>>(w, n, k, qp, dp, sp, in_pass, yp, n); break;
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t MatVecQ4K(const uint8_t* w, int64_t n, int64_t k, const int8_t* q, const float* d,
                      const int32_t* qsum, int64_t rows, float* y, cudaStream_t stream) {
  // Measured on an H200 (bench/results/gpu-matvec.md, the variants table): 2 outputs per warp
  // were fastest at batch 1-2, 4 from batch 4. The bits are the same either way.
  return MatVecQ4KVariant(rows >= 4 ? 4 : 2, w, n, k, q, d, qsum, rows, y, stream);
}

}  // namespace dd::kernels::cuda
