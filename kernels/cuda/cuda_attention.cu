// The CUDA backend's attention, landmark scores and top-chunk selection (cuda_kernels.h).
//
// Attention: one block of kThreads per (row, query head). Keys go in tiles of kThreads, one
// score per thread; the softmax runs online over tiles (running max and sum, rescaled per
// tile) and each thread keeps the output dims `tid` and `tid + kThreads`, adding the tile's
// values in key order. Block reductions use a fixed tree, so a row's bits depend on its own
// keys only (not on the batch, nor on how many blocks run).
//
// Top chunks: one block per list. The take-th best key is found by an 8-pass radix select
// over 64-bit keys (the CPU's: the score's order bits inverted, above the chunk id; integer
// histogram counts, so atomics change nothing), the keys at or above it are collected, and
// each is written at its rank among them: best to worst, the CPU's order.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/cuda_kernels.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// KV elements: f32, or f16 bits (DevShape::kv_f16) widened exactly.
__device__ inline float Widen(float x) { return x; }
__device__ inline float Widen(uint16_t h) { return __half2float(__ushort_as_half(h)); }
static_assert(2 * kThreads >= kMaxHeadDim, "two output dims per thread");

__device__ float BlockMax(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float m = red[0];
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  return m;
}

__device__ float BlockSum(float v, float* red) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float s = red[0];
  for (int w = 1; w < kThreads / 32; ++w) s += red[w];
  __syncthreads();
  return s;
}

// Keys of a causal row: position first + i, in the runs holding positions from lo on.
template <typename T>
struct RunKeys {
  using Elem = T;
  const DevRun* runs;
  int32_t n_runs;
  int64_t lo, first, kv_dim, head_off;
  __device__ void At(int64_t i, const T** k, const T** v) const {
    int64_t idx = first + i - lo;
    for (int r = 0; r < n_runs; ++r) {
      if (idx < runs[r].len || r == n_runs - 1) {
        *k = static_cast<const T*>(runs[r].k) + idx * kv_dim + head_off;
        *v = static_cast<const T*>(runs[r].v) + idx * kv_dim + head_off;
        return;
      }
      idx -= runs[r].len;
    }
  }
};

// Keys of a list: runs of keys at a stride (key_segments.h).
template <typename T>
struct ListKeys {
  using Elem = T;
  const KeySeg* segs;
  int64_t n_segs;
  __device__ void At(int64_t i, const T** k, const T** v) const { KeySegAt(segs, n_segs, i, k, v); }
};

template <typename Keys>
__device__ void AttendKeys(const float* q, float* out, int hd, float scale, int64_t n, const Keys& keys) {
  using T = typename Keys::Elem;
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float p_s[kThreads];
  __shared__ const T* v_s[kThreads];
  __shared__ float red[kThreads / 32];
  const int tid = threadIdx.x;
  for (int d = tid; d < hd; d += kThreads) q_s[d] = q[d];
  __syncthreads();
  float m = -INFINITY, l = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
  for (int64_t t0 = 0; t0 < n; t0 += kThreads) {
    const int64_t i = t0 + tid;
    float s = -INFINITY;
    const T* vp = nullptr;
    if (i < n) {
      const T* kp;
      keys.At(i, &kp, &vp);
      float dot = 0.0f;
      for (int d = 0; d < hd; ++d) dot = fmaf(q_s[d], Widen(kp[d]), dot);
      s = dot * scale;
    }
    const float m_new = fmaxf(m, BlockMax(s, red));
    const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
    const float p = i < n ? expf(s - m_new) : 0.0f;
    p_s[tid] = p;
    v_s[tid] = vp;
    l = l * alpha + BlockSum(p, red);  // its barriers also publish p_s and v_s
    acc0 *= alpha;
    acc1 *= alpha;
    const int count = static_cast<int>(n - t0 < kThreads ? n - t0 : kThreads);
    for (int j = 0; j < count; ++j) {
      const float pj = p_s[j];
      const T* vj = v_s[j];
      if (tid < hd) acc0 = fmaf(pj, Widen(vj[tid]), acc0);
      if (tid + kThreads < hd) acc1 = fmaf(pj, Widen(vj[tid + kThreads]), acc1);
    }
    m = m_new;
    __syncthreads();  // p_s and v_s are rewritten by the next tile
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  if (tid < hd) out[tid] = acc0 * inv;
  if (tid + kThreads < hd) out[tid + kThreads] = acc1 * inv;
}

template <typename T>
__global__ void AttendCausalKernel(DevShape shape, float scale, bool sliding, int64_t window, const float* q,
                                   float* out, const int64_t* positions, int64_t lo, const DevRun* runs,
                                   int32_t n_runs) {
  const int64_t r = blockIdx.x;
  const int h = static_cast<int>(blockIdx.y);
  const int hd = shape.head_dim, group = shape.n_head / shape.n_head_kv;
  const int64_t pos = positions[r];
  int64_t first = sliding ? pos - window + 1 : 0;
  if (first < 0) first = 0;
  const RunKeys<T> keys{runs, n_runs, lo, first, static_cast<int64_t>(shape.n_head_kv) * hd,
                     static_cast<int64_t>(h / group) * hd};
  const int64_t q_dim = static_cast<int64_t>(shape.n_head) * hd;
  AttendKeys(q + r * q_dim + h * hd, out + r * q_dim + h * hd, hd, scale, pos - first + 1, keys);
}

template <typename T>
__global__ void AttendListsKernel(DevShape shape, float scale, const DevListRow* rows, const DevList* lists,
                                  const KeySeg* segs) {
  const DevListRow row = rows[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y);
  const int hd = shape.head_dim, group = shape.n_head / shape.n_head_kv;
  const DevList list = lists[row.first_list + h / group];
  const ListKeys<T> keys{segs + list.seg_offset, list.n_segs};
  AttendKeys(row.q + h * hd, row.out + h * hd, hd, scale, list.n - row.hidden_tail, keys);
}

// One thread per (query, key): the dot as one fma chain over d ascending, the operations
// AttendKeys uses for a score (ops.h: landmark scores with the bits of attention scores).
template <typename KeyOf>
__global__ void KeyScoresKernel(const float* q, int64_t nq, int64_t hd, KeyOf key_of, int64_t nk, float* s,
                                int64_t ld) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= nq * nk) return;
  const int64_t i = t / nk, j = t % nk;
  const float* qi = q + i * hd;
  const float* kj = key_of(j);
  float dot = 0.0f;
  for (int64_t d = 0; d < hd; ++d) dot = fmaf(qi[d], kj[d], dot);
  s[i * ld + j] = dot;
}

// KeyScores' keys: in runs, or one pointer each.
struct SegKey {
  const KeySeg* segs;
  int64_t n_segs;
  __device__ const float* operator()(int64_t j) const {
    const float *k, *unused;
    KeySegAt<float>(segs, n_segs, j, &k, &unused);
    return k;
  }
};
struct PtrKey {
  const float* const* keys;
  __device__ const float* operator()(int64_t j) const { return keys[j]; }
};

constexpr int kSelectThreads = 256;

// Smaller is better: the max score's order bits inverted above the chunk id (-0 counted as +0).
__device__ uint64_t ChunkKey(const DevChunkList& l, int64_t rows, int64_t i) {
  float best = -INFINITY;
  for (int64_t h = 0; h < rows; ++h) best = fmaxf(best, l.scores[h * l.n + i]);
  if (best == 0.0f) best = 0.0f;  // -0 -> +0
  uint32_t u = __float_as_uint(best);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(~u) << 32) | static_cast<uint32_t>(l.chunks[i]);
}

__global__ void TopChunksKernel(const DevChunkList* lists, int64_t rows) {
  __shared__ unsigned int hist[256];
  __shared__ uint64_t prefix_s;
  __shared__ long long left_s;
  __shared__ unsigned int count_s;
  const DevChunkList l = lists[blockIdx.x];
  const int tid = threadIdx.x;
  const int64_t take = l.take < l.n ? l.take : l.n;
  if (take <= 0) return;
  uint64_t threshold = ~0ull;
  if (take < l.n) {
    uint64_t prefix = 0;
    long long left = take;  // the rank (1-based) of the threshold among keys matching prefix
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
      __syncthreads();
      for (int64_t i = tid; i < l.n; i += kSelectThreads) {
        const uint64_t key = ChunkKey(l, rows, i);
        if (shift == 56 || (key >> (shift + 8)) == (prefix >> (shift + 8))) {
          atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
      }
      __syncthreads();
      if (tid == 0) {
        long long cum = 0;
        for (int b = 0; b < 256; ++b) {
          if (cum + hist[b] >= left) {
            prefix |= static_cast<uint64_t>(b) << shift;
            left -= cum;
            break;
          }
          cum += hist[b];
        }
        prefix_s = prefix;
        left_s = left;
      }
      __syncthreads();
      prefix = prefix_s;
      left = left_s;
    }
    threshold = prefix;
  }
  if (tid == 0) count_s = 0;
  __syncthreads();
  for (int64_t i = tid; i < l.n; i += kSelectThreads) {
    const uint64_t key = ChunkKey(l, rows, i);
    if (key <= threshold) {
      const unsigned int slot = atomicAdd(&count_s, 1u);
      if (slot < take) l.scratch[slot] = key;  // exactly `take` when chunk ids are unique
    }
  }
  __syncthreads();
  const int64_t count = count_s < take ? count_s : take;
  for (int64_t a = tid; a < count; a += kSelectThreads) {
    const uint64_t key = l.scratch[a];
    int64_t rank = 0;
    for (int64_t b = 0; b < count; ++b) rank += l.scratch[b] < key;
    if (rank < take) l.ids[rank] = static_cast<int64_t>(key & 0xffffffffu);
  }
}

}  // namespace

cudaError_t AttendCausal(const DevShape& shape, float scale, bool sliding, int64_t window, const float* q, float* out,
                         const int64_t* positions, int64_t n_rows, int64_t lo, const DevRun* runs, int32_t n_runs,
                         cudaStream_t s) {
  if (n_rows <= 0) return cudaSuccess;
  if (shape.head_dim > kMaxHeadDim || shape.n_head_kv <= 0 || shape.n_head % shape.n_head_kv != 0 || n_runs <= 0 ||
      shape.n_head > 65535) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(shape.n_head));
  if (shape.kv_f16 != 0) {
    AttendCausalKernel<uint16_t><<<grid, kThreads, 0, s>>>(shape, scale, sliding, window, q, out, positions, lo, runs,
                                                          n_runs);
  } else {
    AttendCausalKernel<float><<<grid, kThreads, 0, s>>>(shape, scale, sliding, window, q, out, positions, lo, runs,
                                                       n_runs);
  }
  return cudaGetLastError();
}

cudaError_t AttendLists(const DevShape& shape, float scale, const DevListRow* rows, int64_t n_rows, const DevList* lists,
                        const KeySeg* segs, cudaStream_t s) {
  if (n_rows <= 0) return cudaSuccess;
  if (shape.head_dim > kMaxHeadDim || shape.n_head_kv <= 0 || shape.n_head % shape.n_head_kv != 0 ||
      shape.n_head > 65535) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>(shape.n_head));
  if (shape.kv_f16 != 0) {
    AttendListsKernel<uint16_t><<<grid, kThreads, 0, s>>>(shape, scale, rows, lists, segs);
  } else {
    AttendListsKernel<float><<<grid, kThreads, 0, s>>>(shape, scale, rows, lists, segs);
  }
  return cudaGetLastError();
}

cudaError_t KeyScores(const float* q, int64_t nq, int64_t head_dim, const KeySeg* segs, int64_t n_segs,
                      const float* const* ptrs, int64_t nk, float* s, int64_t ld, cudaStream_t stream) {
  if (nq <= 0 || nk <= 0) return cudaSuccess;
  if (segs != nullptr ? n_segs <= 0 : ptrs == nullptr) return cudaErrorInvalidValue;
  const int64_t threads = 256, blocks = (nq * nk + threads - 1) / threads;
  if (segs != nullptr) {
    KeyScoresKernel<<<blocks, threads, 0, stream>>>(q, nq, head_dim, SegKey{segs, n_segs}, nk, s, ld);
  } else {
    KeyScoresKernel<<<blocks, threads, 0, stream>>>(q, nq, head_dim, PtrKey{ptrs}, nk, s, ld);
  }
  return cudaGetLastError();
}

cudaError_t TopChunks(const DevChunkList* lists, int64_t n_lists, int64_t rows, cudaStream_t s) {
  if (n_lists <= 0) return cudaSuccess;
  TopChunksKernel<<<static_cast<unsigned>(n_lists), kSelectThreads, 0, s>>>(lists, rows);
  return cudaGetLastError();
}

}  // namespace dd::kernels::cuda
