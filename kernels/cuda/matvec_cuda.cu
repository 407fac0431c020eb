// Q4_K x int8 matrix-vector products on the GPU; see matvec_cuda.h.
#include <cuda_fp16.h>

#include "cuda/matvec_cuda.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kBlock = 32;            // activation block (and Q4_K sub-block) elements
constexpr int kSuper = 256;           // Q4_K super-block elements
constexpr int kSuperBytes = 144;      // f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles
constexpr int kWarpsPerBlock = 8;     // one output per warp
constexpr float kMinBlockMax = 1e-30f;  // as the CPU: blocks below quantize to zero

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ inline float H2F(const uint8_t* p) {
  __half_raw r;
  r.x = static_cast<unsigned short>(p[0] | (p[1] << 8));
  return __half2float(__half(r));
}

// Sub-block j's 6-bit scale and min (GGUF's get_scale_min_k4).
__device__ inline void ScaleMin(int j, const uint8_t* s, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

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

// One warp per output. Lane l takes sub-blocks l, l + 32, ...; for each activation row it keeps
// its own f32 sum, then the warp adds the 32 sums in a fixed butterfly. Nothing depends on how
// many rows there are, so a row's result is the same in any batch.
__global__ void __launch_bounds__(32 * kWarpsPerBlock, 4) MatVecQ4KKernel(const uint8_t* __restrict__ w, int64_t n, int64_t k,
                                const int8_t* __restrict__ q, const float* __restrict__ d,
                                const int32_t* __restrict__ qsum, int rows, float* __restrict__ y,
                                int64_t y_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (i >= n) return;
  const int64_t nsub = k / kBlock;
  const uint8_t* row = w + i * (k / kSuper) * kSuperBytes;
  float acc[kMatVecRows];
#pragma unroll
  for (int r = 0; r < kMatVecRows; ++r) acc[r] = 0.0f;
#pragma unroll 2
  for (int64_t s = lane; s < nsub; s += 32) {
    const int j = static_cast<int>(s & 7);
    const uint8_t* blk = row + (s >> 3) * kSuperBytes;
    const uint4* nib = reinterpret_cast<const uint4*>(blk + 16 + (j >> 1) * 32);
    const uint4 n0 = nib[0], n1 = nib[1];
    const float dw = H2F(blk), dmin = H2F(blk + 2);
    int sc, m;
    ScaleMin(j, blk + 4, &sc, &m);
    const float ds = __fmul_rn(dw, static_cast<float>(sc)), ms = __fmul_rn(dmin, static_cast<float>(m));
    const int shift = (j & 1) * 4;
    const unsigned wq[8] = {(n0.x >> shift) & 0x0f0f0f0fu, (n0.y >> shift) & 0x0f0f0f0fu,
                            (n0.z >> shift) & 0x0f0f0f0fu, (n0.w >> shift) & 0x0f0f0f0fu,
                            (n1.x >> shift) & 0x0f0f0f0fu, (n1.y >> shift) & 0x0f0f0f0fu,
                            (n1.z >> shift) & 0x0f0f0f0fu, (n1.w >> shift) & 0x0f0f0f0fu};
#pragma unroll
    for (int r = 0; r < kMatVecRows; ++r) {
      if (r < rows) {
        const uint4* a = reinterpret_cast<const uint4*>(q + r * k + s * kBlock);
        const uint4 a0 = a[0], a1 = a[1];
        int isum = 0;
        isum = __dp4a(static_cast<int>(wq[0]), static_cast<int>(a0.x), isum);
        isum = __dp4a(static_cast<int>(wq[1]), static_cast<int>(a0.y), isum);
        isum = __dp4a(static_cast<int>(wq[2]), static_cast<int>(a0.z), isum);
        isum = __dp4a(static_cast<int>(wq[3]), static_cast<int>(a0.w), isum);
        isum = __dp4a(static_cast<int>(wq[4]), static_cast<int>(a1.x), isum);
        isum = __dp4a(static_cast<int>(wq[5]), static_cast<int>(a1.y), isum);
        isum = __dp4a(static_cast<int>(wq[6]), static_cast<int>(a1.z), isum);
        isum = __dp4a(static_cast<int>(wq[7]), static_cast<int>(a1.w), isum);
        // Rounded operations spelled out: no contraction the compiler might choose per row slot.
        const float t = __fsub_rn(__fmul_rn(ds, static_cast<float>(isum)),
                                  __fmul_rn(ms, static_cast<float>(qsum[r * nsub + s])));
        acc[r] = __fmaf_rn(d[r * nsub + s], t, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMatVecRows; ++r) {
    if (r < rows) {
      float v = acc[r];
      for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
      if (lane == 0) y[r * y_stride + i] = v;
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

cudaError_t MatVecQ4K(const uint8_t* w, int64_t n, int64_t k, const int8_t* q, const float* d,
                      const int32_t* qsum, int64_t rows, float* y, cudaStream_t stream) {
  if (n <= 0 || k <= 0 || k % kSuper != 0 || rows < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (w == nullptr || q == nullptr || d == nullptr || qsum == nullptr || y == nullptr ||
      !Aligned16(w) || !Aligned16(q)) {
    return cudaErrorInvalidValue;
  }
  const int threads = 32 * kWarpsPerBlock;
  const int64_t grid = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t nsub = k / kBlock;
  // Fixed groups of kMatVecRows rows: the group a row falls in changes only which pass reads it.
  for (int64_t r0 = 0; r0 < rows; r0 += kMatVecRows) {
    const int in_pass = static_cast<int>(rows - r0 < kMatVecRows ? rows - r0 : kMatVecRows);
    MatVecQ4KKernel<<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        w, n, k, q + r0 * k, d + r0 * nsub, qsum + r0 * nsub, in_pass, y + r0 * n, n);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace dd::kernels::cuda
