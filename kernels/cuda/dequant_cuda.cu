// GPU dequantization of the ggml block formats; one thread per output element group.
// Checked element-for-element against the CPU reference (kernels/cpu/dequant.cc).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_entry.h"

namespace dd::kernels::cuda {
namespace {

__device__ inline float H2F(const uint8_t* p) {
  __half_raw r;
  r.x = static_cast<unsigned short>(p[0] | (p[1] << 8));
  return __half2float(__half(r));
}

// One thread per block of 32 elements.
__global__ void DequantQ8_0Kernel(const uint8_t* src, float* dst, int64_t n_blocks) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= n_blocks) return;
  const uint8_t* blk = src + b * 34;
  const float d = H2F(blk);
  const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
  for (int i = 0; i < 32; ++i) dst[b * 32 + i] = d * static_cast<float>(q[i]);
}

__device__ inline void ScaleMinK4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One thread per 256-element super-block.
__global__ void DequantQ4_KKernel(const uint8_t* src, float* dst, int64_t n_blocks) {
  const int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (b >= n_blocks) return;
  const uint8_t* blk = src + b * 144;
  const float d = H2F(blk), dmin = H2F(blk + 2);
  const uint8_t* scales = blk + 4;
  const uint8_t* q = blk + 16;
  float* y = dst + b * 256;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    int sc, m;
    ScaleMinK4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    ScaleMinK4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0f) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
  }
}

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::Status DequantizeRows(DType t, const void* src, int64_t rows, int64_t cols, float* dst) {
  int64_t block_elems, block_bytes;
  switch (t) {
    case DType::kQ8_0: block_elems = 32; block_bytes = 34; break;
    case DType::kQ4_K: block_elems = 256; block_bytes = 144; break;
    default:
      return absl::UnimplementedError(absl::StrCat("no CUDA dequantize kernel for type ", DTypeName(t)));
  }
  if (cols % block_elems != 0) return absl::InvalidArgumentError("cols not a multiple of the block size");
  const int64_t n_blocks = rows * cols / block_elems;
  uint8_t* d_src = nullptr;
  float* d_dst = nullptr;
  // One error code carried through the steps (absl::Status assignments trip nvcc's nodiscard
  // check under -Werror all-warnings), turned into a Status once at the end.
  const char* what = "cudaMalloc";
  cudaError_t err = cudaMalloc(&d_src, n_blocks * block_bytes);
  if (err == cudaSuccess) err = cudaMalloc(&d_dst, rows * cols * sizeof(float));
  if (err == cudaSuccess) {
    what = "copy in";
    err = cudaMemcpy(d_src, src, n_blocks * block_bytes, cudaMemcpyHostToDevice);
  }
  if (err == cudaSuccess) {
    const int threads = 128;
    const int64_t grid = (n_blocks + threads - 1) / threads;
    if (t == DType::kQ8_0) {
      DequantQ8_0Kernel<<<grid, threads>>>(d_src, d_dst, n_blocks);
    } else {
      DequantQ4_KKernel<<<grid, threads>>>(d_src, d_dst, n_blocks);
    }
    what = "kernel launch";
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    what = "copy out";
    err = cudaMemcpy(dst, d_dst, rows * cols * sizeof(float), cudaMemcpyDeviceToHost);
  }
  (void)cudaFree(d_src);
  (void)cudaFree(d_dst);
  return Check(err, what);
}

}  // namespace dd::kernels::cuda
