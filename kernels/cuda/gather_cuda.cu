// Host -> device chunk gathers; see gather_cuda.h.
#include "cuda/gather_cuda.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
// 16-byte loads each lane keeps in flight before storing: reads of host memory over PCIe take
// microseconds, so a warp issues this many loads before it waits on the first.
constexpr int kLoadsInFlight = 8;

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// One warp copies one chunk at a time; warps stride over the list.
__global__ void GatherKernel(const uint4* __restrict__ src, const int64_t* __restrict__ offsets,
                             int64_t count, int64_t vecs_per_chunk, uint4* __restrict__ dst) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t c = warp; c < count; c += warps) {
    const uint4* from = src + offsets[c] / 16;
    uint4* to = dst + c * vecs_per_chunk;
    for (int64_t base = 0; base < vecs_per_chunk; base += 32 * kLoadsInFlight) {
      uint4 r[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < vecs_per_chunk) r[u] = from[i];
      }
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < vecs_per_chunk) to[i] = r[u];
      }
    }
  }
}

}  // namespace

cudaError_t CheckGatherArgs(const void* src, int64_t count, int64_t chunk_bytes, const void* dst) {
  if (count < 0 || chunk_bytes <= 0 || chunk_bytes % 16 != 0) return cudaErrorInvalidValue;
  if (count > 0 && (src == nullptr || dst == nullptr || !Aligned16(src) || !Aligned16(dst))) {
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t GatherChunksOnDevice(const void* src, const int64_t* offsets, int64_t count,
                                 int64_t chunk_bytes, void* dst, int blocks, cudaStream_t stream) {
  if (cudaError_t e = CheckGatherArgs(src, count, chunk_bytes, dst); e != cudaSuccess) return e;
  if (count == 0) return cudaSuccess;
  if (offsets == nullptr || (reinterpret_cast<uintptr_t>(offsets) & 7) != 0) {
    return cudaErrorInvalidValue;
  }
  if (blocks <= 0) {
    int device = 0, sms = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess) {
      return e;
    }
    blocks = sms;
  }
  // No more blocks than there are chunks for their warps.
  const int64_t needed = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > needed) blocks = static_cast<int>(needed);
  GatherKernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(
      static_cast<const uint4*>(src), offsets, count, chunk_bytes / 16, static_cast<uint4*>(dst));
  return cudaGetLastError();
}

cudaError_t GatherChunksCopyEngine(const void* src, int64_t src_bytes, const int64_t* offsets, int64_t count,
                                   int64_t chunk_bytes, void* dst, bool prefer_overlap,
                                   CopyBatchScratch* scratch, cudaStream_t stream,
                                   int64_t* copies) {
  if (cudaError_t e = CheckGatherArgs(src, count, chunk_bytes, dst); e != cudaSuccess) return e;
  if (copies != nullptr) *copies = 0;
  if (count == 0) return cudaSuccess;
  if (offsets == nullptr || scratch == nullptr || stream == nullptr || stream == cudaStreamLegacy ||
      src_bytes < chunk_bytes) {
    return cudaErrorInvalidValue;
  }
  scratch->dsts.clear();
  scratch->srcs.clear();
  scratch->sizes.clear();
  const auto* from = static_cast<const char*>(src);
  auto* to = static_cast<char*>(dst);
  for (int64_t c = 0; c < count; ++c) {
    if (offsets[c] < 0 || offsets[c] % 16 != 0 || offsets[c] > src_bytes - chunk_bytes) return cudaErrorInvalidValue;
    const char* s = from + offsets[c];
    char* d = to + c * chunk_bytes;
    if (!scratch->sizes.empty() && static_cast<const char*>(scratch->srcs.back()) +
                                           scratch->sizes.back() == s) {
      scratch->sizes.back() += chunk_bytes;  // the destination is adjacent by construction
      continue;
    }
    scratch->dsts.push_back(d);
    scratch->srcs.push_back(s);
    scratch->sizes.push_back(static_cast<size_t>(chunk_bytes));
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeHost;
  attr.dstLocHint.type = cudaMemLocationTypeDevice;
  if (cudaError_t e = cudaGetDevice(&attr.dstLocHint.id); e != cudaSuccess) return e;
  attr.flags = prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
  size_t attr_index = 0;
  if (copies != nullptr) *copies = static_cast<int64_t>(scratch->sizes.size());
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(scratch->dsts.data(), scratch->srcs.data(), scratch->sizes.data(),
                              scratch->sizes.size(), &attr, &attr_index, 1, stream);
#elif CUDART_VERSION >= 12080
  size_t fail_index = 0;  // 12.x's signature reports the failing copy too
  return cudaMemcpyBatchAsync(scratch->dsts.data(), const_cast<void**>(scratch->srcs.data()),
                              scratch->sizes.data(), scratch->sizes.size(), &attr, &attr_index, 1,
                              &fail_index, stream);
#else
  return cudaErrorNotSupported;
#endif
}

}  // namespace dd::kernels::cuda
