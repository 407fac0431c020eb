// The low-rank key cache's kernels (cuda_kernels.h, ProjectKeys / ReconstructKeys): one thread
// block per key row, the row held in shared memory, every sum in a fixed order (element order
// for a coefficient, coefficient order for an element), so a row's bits depend on that row
// alone. Rotary angles are computed per pair in double from the staged frequencies, as the
// CPU's kernels::RopeAngles does.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/cuda_kernels.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__device__ inline float KeyElem(const void* row, int64_t j, bool f16) {
  return f16 ? __half2float(__ushort_as_half(static_cast<const uint16_t*>(row)[j])) : static_cast<const float*>(row)[j];
}

// Rotates every head of `key` (shared memory) to position `pos`, or back when `undo`.
__device__ void RotateHeads(float* key, const LowRankShape& f, int64_t pos, bool undo) {
  for (int64_t p = threadIdx.x; p < f.n_head_kv * f.half; p += blockDim.x) {
    const int64_t g = p / f.half, i = p % f.half;
    const double theta = static_cast<double>(pos) * f.inv_freq[i];
    const float c = static_cast<float>(cos(theta));
    const float s = undo ? -static_cast<float>(sin(theta)) : static_cast<float>(sin(theta));
    float* head = key + g * f.head_dim;
    const int64_t a = f.neox ? i : 2 * i, b = f.neox ? i + f.half : 2 * i + 1;
    const float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
  }
}

__global__ void ProjectKeysKernel(LowRankShape f, const void* const* rows, const int64_t* positions, float* out) {
  extern __shared__ float key[];
  const int64_t i = blockIdx.x, d = f.n_head_kv * f.head_dim;
  for (int64_t e = threadIdx.x; e < d; e += blockDim.x) key[e] = KeyElem(rows[i], e, f.f16);
  __syncthreads();
  RotateHeads(key, f, positions[i], /*undo=*/true);
  __syncthreads();
  for (int64_t j = threadIdx.x; j < f.rank; j += blockDim.x) {
    const float* b = f.basis + j * d;
    float acc = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc = fmaf(b[e], key[e], acc);
    out[i * f.rank + j] = acc;
  }
}

// Block (i, t): position t of item i (one KV head of one chunk).
__global__ void ReconstructKeysKernel(LowRankShape f, const float* const* coeffs, const int64_t* first,
                                      const int32_t* heads, int64_t chunk, void* const* out) {
  extern __shared__ float key[];  // the item's head: head_dim floats
  const int64_t i = blockIdx.x / chunk, t = blockIdx.x % chunk, d = f.n_head_kv * f.head_dim;
  const float* a = coeffs[i] + t * f.rank;
  const float* part = f.basis + heads[i] * f.head_dim;
  for (int64_t e = threadIdx.x; e < f.head_dim; e += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < f.rank; ++j) acc = fmaf(a[j], part[j * d + e], acc);
    key[e] = acc;
  }
  __syncthreads();
  LowRankShape one = f;  // the rotation of one head
  one.n_head_kv = 1;
  RotateHeads(key, one, first[i] + t, /*undo=*/false);
  __syncthreads();
  for (int64_t e = threadIdx.x; e < f.head_dim; e += blockDim.x) {
    if (f.f16) {
      const float x = key[e];
      const float v = isfinite(x) ? fminf(fmaxf(x, -65504.0f), 65504.0f) : x;  // saturating, as StoreKv (uncounted)
      static_cast<uint16_t*>(out[i])[t * f.head_dim + e] = __half_as_ushort(__float2half_rn(v));
    } else {
      static_cast<float*>(out[i])[t * f.head_dim + e] = key[e];
    }
  }
}

}  // namespace

cudaError_t ProjectKeys(const LowRankShape& f, const void* const* rows, const int64_t* positions, int64_t n, float* out,
                        cudaStream_t s) {
  if (n <= 0 || f.rank <= 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(f.n_head_kv * f.head_dim) * sizeof(float);
  ProjectKeysKernel<<<static_cast<unsigned>(n), kThreads, shared, s>>>(f, rows, positions, out);
  return cudaGetLastError();
}

cudaError_t ReconstructKeys(const LowRankShape& f, const float* const* coeffs, const int64_t* first,
                            const int32_t* heads, int64_t n, int64_t chunk, void* const* out, cudaStream_t s) {
  if (n <= 0 || chunk <= 0 || f.rank <= 0) return cudaSuccess;
  const size_t shared = static_cast<size_t>(f.head_dim) * sizeof(float);
  ReconstructKeysKernel<<<static_cast<unsigned>(n * chunk), kThreads, shared, s>>>(f, coeffs, first, heads, chunk,
                                                                                    out);
  return cudaGetLastError();
}

}  // namespace dd::kernels::cuda
