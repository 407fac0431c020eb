// Minimal writer for NumPy .npy files (version 1.0, little-endian float32, C order).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace dd::ddctl {
absl::Status WriteNpyF32(const std::string& path, const std::vector<int64_t>& shape, const float* data);
}
