// Small helpers the CUDA tests and benchmarks share. Internal to kernels/cuda (names CUDA types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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

// A benchmark flag's comma-separated positive integers, each at most 2^20; anything else ends
// the benchmark (exit status 2) with a message naming it and the flag.
inline std::vector<int64_t> PositiveIntsOrExit(const char* program, const char* flag, const std::string& v) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= v.size()) {
    const size_t comma = v.find(',', pos) < v.size() ? v.find(',', pos) : v.size();
    char* end = nullptr;
    const std::string item = v.substr(pos, comma - pos);
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || x <= 0 || x > (1 << 20)) {
      std::fprintf(stderr, "%s: %s: '%s' is not a positive integer <= 2^20\n", program, flag, item.c_str());
      std::exit(2);
    }
    out.push_back(x);
    pos = comma + 1;
  }
  return out;
}

}  // namespace dd::kernels::cuda
