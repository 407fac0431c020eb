// Host -> device chunk gathers: the two paths a GPU decode moves offloaded KV chunks on
// (docs/decisions/0034-gpu-kernels-groundwork.md). Both copy `count` chunks of `chunk_bytes` each,
// read at byte offsets offsets[i] from `src` (host memory), into dst + i * chunk_bytes (device
// memory), in list order.
//   - On the device: GPU threads read the host memory directly (it must be mapped into the
//     device's address space: cudaHostAlloc(..., cudaHostAllocMapped) or cudaHostRegister(...,
//     cudaHostRegisterMapped), which is how the pool's shared-memory region is seen too), and
//     `src` is the device's address of it (cudaHostGetDevicePointer: for registered memory it can
//     differ from the host's). Needs the offsets on the device, so it suits the urgent path,
//     whose chunk list is computed there.
//   - On the copy engines: one cudaMemcpyBatchAsync; needs the offsets on the host, which the
//     prefetch has a whole step to provide, and leaves the SMs to the compute.
// This header is internal to kernels/cuda (it names CUDA types); nothing outside includes it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dd::kernels::cuda {

// Checks shared by both paths: count >= 0, chunk_bytes a positive multiple of 16 (16-byte
// loads), src and dst 16-byte aligned, every offset a multiple of 16 (the device path cannot
// check offsets that live on the device; callers of it keep them in range). Returns
// cudaErrorInvalidValue when one fails.
cudaError_t CheckGatherArgs(const void* src, int64_t count, int64_t chunk_bytes, const void* dst);

// The device path. `offsets` is a device array of `count` entries. `blocks` bounds the SMs it
// occupies (<= 0: as many blocks as the device has SMs); each warp copies whole chunks.
// Asynchronous on `stream`.
cudaError_t GatherChunksOnDevice(const void* src, const int64_t* offsets, int64_t count,
                                 int64_t chunk_bytes, void* dst, int blocks, cudaStream_t stream);

// Host-side lists one batch call needs, kept by the caller so that a step does not allocate.
struct CopyBatchScratch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

// The copy-engine path. `offsets` is a host array, each chunk within the `src_bytes` of `src`
// (checked); runs of chunks adjacent in both source and destination are merged into one copy.
// `prefer_overlap` passes the driver's hint to overlap the copies with compute
// (cudaMemcpyFlagPreferOverlapWithCompute). `stream` must not be the legacy default stream.
// Returns the number of copies issued in *copies when copies is not null. Needs CUDA 12.8 or
// later (cudaErrorNotSupported before).
cudaError_t GatherChunksCopyEngine(const void* src, int64_t src_bytes, const int64_t* offsets, int64_t count,
                                   int64_t chunk_bytes, void* dst, bool prefer_overlap,
                                   CopyBatchScratch* scratch, cudaStream_t stream,
                                   int64_t* copies = nullptr);

}  // namespace dd::kernels::cuda
