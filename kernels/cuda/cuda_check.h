// Small helpers the CUDA tests and benchmarks share. Internal to kernels/cuda (names CUDA types).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace dd::kernels::cuda {

// True when a CUDA device answers; clears the error a machine without one leaves behind.
inline bool HaveCudaDevice() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

// Ends a benchmark (exit status 1) with a message naming it, the step and CUDA's error.
inline void CheckOrExit(cudaError_t e, const char* program, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s: %s\n", program, what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace dd::kernels::cuda
