#include <cuda_runtime.h>

#include "cuda/cuda_entry.h"

namespace dd::kernels::cuda {

bool ProbeDevice(std::string* detail) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {  // includes cudaErrorInsufficientDriver on GPU-less machines
    *detail = cudaGetErrorString(err);
    (void)cudaGetLastError();  // clear the sticky error
    return false;
  }
  if (count == 0) {
    *detail = "no CUDA device";
    return false;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    *detail = "cudaGetDeviceProperties failed";
    return false;
  }
  *detail = prop.name;
  return true;
}

}  // namespace dd::kernels::cuda
