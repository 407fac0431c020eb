// Entry points of the CUDA backend, in plain C++ types (no CUDA headers), so that
// registry.cc can call them without the rest of the project seeing CUDA.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "dd/kernels/dtype.h"

namespace dd::kernels::cuda {

// True when a device answers; `detail` gets its name or the CUDA error.
bool ProbeDevice(std::string* detail);

absl::Status DequantizeRows(DType t, const void* src, int64_t rows, int64_t cols, float* dst);

}  // namespace dd::kernels::cuda
