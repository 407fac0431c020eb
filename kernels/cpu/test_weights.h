// Random quantized weights for the kernel tests (CPU and CUDA): every code, scale and min
// pattern reachable, with small finite f16 scales.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "dd/kernels/dtype.h"

namespace dd::kernels {

// The types the int8 path takes.
inline constexpr DType kTypes[] = {DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ5_0,
                                   DType::kQ5_1, DType::kQ4_K, DType::kQ5_K, DType::kQ6_K};

inline void PutF16(uint8_t* p, float f) {
  const uint16_t h = F32ToF16(f);
  std::memcpy(p, &h, 2);
}

// Random block bytes (every code, scale and min pattern is reachable) with small finite f16
// scales of either sign.
inline std::vector<uint8_t> RandomWeights(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const int64_t row_bytes = *RowBytes(t, cols);
  const int64_t block_bytes = GetDTypeInfo(static_cast<uint32_t>(t))->block_bytes;
  std::vector<uint8_t> data(rows * row_bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(0.001f, 0.05f);
  auto scale = [&] { return byte(rng) & 1 ? mag(rng) : -mag(rng); };
  for (auto& b : data) b = static_cast<uint8_t>(byte(rng));
  for (int64_t off = 0; off < static_cast<int64_t>(data.size()); off += block_bytes) {
    uint8_t* blk = &data[off];
    switch (t) {
      case DType::kQ8_0:
      case DType::kQ4_0:
      case DType::kQ5_0: PutF16(blk, scale()); break;
      case DType::kQ4_1:
      case DType::kQ5_1:
        PutF16(blk, scale());
        PutF16(blk + 2, scale() * 4.0f);  // the min, of either sign
        break;
      case DType::kQ4_K:
      case DType::kQ5_K:
        PutF16(blk, scale());
        PutF16(blk + 2, mag(rng) * 0.1f);
        break;
      case DType::kQ6_K: PutF16(blk + 208, scale() * 0.1f); break;
      default: break;
    }
  }
  return data;
}

}  // namespace dd::kernels
