// Entry points of the CUDA backend, in plain C++ types (no CUDA headers), so that
// registry.cc can call them without the rest of the project seeing CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dd/backend/device.h"

namespace dd::kernels::cuda {

// True when a device answers; `detail` gets its name or the CUDA error.
bool ProbeDevice(std::string* detail);

// The CUDA device (cuda_device.h) with `budget_bytes` of device memory (0: 90% of what is free),
// static segments launched as CUDA graphs when `graphs`, prefetch gathers by the copy engines
// when `copy_engine_prefetch`.
absl::StatusOr<std::unique_ptr<backend::Device>> CreateCudaDevice(int64_t budget_bytes, bool graphs,
                                                                  bool copy_engine_prefetch);

}  // namespace dd::kernels::cuda
