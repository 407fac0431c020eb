// Tensor element types, numbered as in GGUF / ggml so file values map 1:1.
//
// Quantized types store rows as consecutive blocks of `BlockElems` elements, `BlockBytes`
// bytes each; a row's element count must be a multiple of the block size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd::kernels {

enum class DType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

struct DTypeInfo {
  DType type;
  absl::string_view name;
  int64_t block_elems;
  int64_t block_bytes;
};

// A weight matrix of `rows` × `cols` elements in type `type`, row-major, rows of RowBytes().
// `data` is memory of the device the weights were loaded for (host memory on the CPU).
struct WeightView {
  DType type = DType::kF32;
  const uint8_t* data = nullptr;
  int64_t rows = 0;  // output features
  int64_t cols = 0;  // input features (reduction dimension)
  int64_t row_bytes = 0;
};

// Returns the layout of a supported type; Unimplemented names the ggml type id otherwise.
absl::StatusOr<DTypeInfo> GetDTypeInfo(uint32_t ggml_type);
absl::string_view DTypeName(DType t);

// Bytes of one row of `n` elements; InvalidArgument if n is not a multiple of the block.
absl::StatusOr<int64_t> RowBytes(DType t, int64_t n);

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);
// The conversion of builds without F16C (round to nearest even, subnormals included); exposed
// so that tests compare it with F16C's on machines that have both.
uint16_t F32ToF16Portable(float f);
// out[i] = F32ToF16(x[i]) for i < n, except that a finite value beyond ±65504 (the largest
// f16) becomes ±65504 instead of ±inf; returns how many did. Infinities and NaNs convert as
// they are.
int64_t F32ToF16Saturating(const float* x, int64_t n, uint16_t* out);
inline float BF16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

}  // namespace dd::kernels
