#include <cuda_runtime.h>

#include <string>

#include "cuda/cuda_entry.h"

namespace dd::kernels::cuda {

bool ProbeDevice(std::string* detail) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver) {  // no driver at all, or one older than the runtime
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);  // 0: no driver installed
    (void)cudaRuntimeGetVersion(&runtime);
    (void)cudaGetLastError();
    *detail = driver == 0 ? std::string("no NVIDIA driver found: libcuda.so.1 is not installed; in a container, the "
                                        "NVIDIA container toolkit mounts it")
                          : "the NVIDIA driver supports CUDA " + std::to_string(driver / 1000) + "." +
                                std::to_string(driver % 1000 / 10) + ", older than this build's runtime " +
                                std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10);
    return false;
  }
  if (err != cudaSuccess) {
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
