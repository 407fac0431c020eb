// Backend registry: which compute backends this build has and which the machine can run.
//
// The CPU backend is always present. The CUDA backend exists when the build found nvcc and
// is usable only when a device answers at run time; any CUDA error while probing counts as
// "no device" (without a driver, cudaGetDeviceCount returns cudaErrorInsufficientDriver).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "dd/kernels/dtype.h"

namespace dd::kernels {

struct BackendInfo {
  std::string name;    // "cpu" or "cuda"
  bool compiled = false;
  bool usable = false;
  std::string detail;  // device name, or why it is unusable
};

std::vector<BackendInfo> ListBackends();
bool CudaUsable();

// Dequantizes `rows` rows of `cols` elements (host memory in, host memory out) on the GPU.
// Unavailable when no CUDA device is usable; Unimplemented for types without a GPU kernel.
absl::Status CudaDequantizeRows(DType t, const void* src, int64_t rows, int64_t cols, float* dst);

}  // namespace dd::kernels
