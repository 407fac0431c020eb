#include "dd/kernels/dtype.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace dd::kernels {

absl::StatusOr<DTypeInfo> GetDTypeInfo(uint32_t ggml_type) {
  switch (static_cast<DType>(ggml_type)) {
    case DType::kF32: return DTypeInfo{DType::kF32, "F32", 1, 4};
    case DType::kF16: return DTypeInfo{DType::kF16, "F16", 1, 2};
    case DType::kBF16: return DTypeInfo{DType::kBF16, "BF16", 1, 2};
    case DType::kQ8_0: return DTypeInfo{DType::kQ8_0, "Q8_0", 32, 34};
    case DType::kQ4_0: return DTypeInfo{DType::kQ4_0, "Q4_0", 32, 18};
    case DType::kQ4_1: return DTypeInfo{DType::kQ4_1, "Q4_1", 32, 20};
    case DType::kQ5_0: return DTypeInfo{DType::kQ5_0, "Q5_0", 32, 22};
    case DType::kQ5_1: return DTypeInfo{DType::kQ5_1, "Q5_1", 32, 24};
    case DType::kQ4_K: return DTypeInfo{DType::kQ4_K, "Q4_K", 256, 144};
    case DType::kQ5_K: return DTypeInfo{DType::kQ5_K, "Q5_K", 256, 176};
    case DType::kQ6_K: return DTypeInfo{DType::kQ6_K, "Q6_K", 256, 210};
  }
  return absl::UnimplementedError(
      absl::StrCat("unsupported tensor type id ", ggml_type,
                   " (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"));
}

absl::string_view DTypeName(DType t) {
  auto info = GetDTypeInfo(static_cast<uint32_t>(t));
  return info.ok() ? info->name : "unknown";
}

absl::StatusOr<int64_t> RowBytes(DType t, int64_t n) {
  auto info = GetDTypeInfo(static_cast<uint32_t>(t));
  if (!info.ok()) return info.status();
  if (n < 0 || n % info->block_elems != 0) {
    return absl::InvalidArgumentError(absl::StrCat("row of ", n, " elements is not a multiple of the ",
                                                   info->name, " block size ", info->block_elems));
  }
  return n / info->block_elems * info->block_bytes;
}

float F16ToF32(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16Portable(float f) {
  // Round to nearest even, subnormal results included (what F16C's conversion does).
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  const uint32_t mant = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    // A subnormal half: the significand (implicit bit included) in units of 2^-24. Below half
    // of the smallest one (shift > 24) it rounds to zero; a carry out of the subnormals gives
    // the smallest normal, correctly.
    if (exp < -10) return static_cast<uint16_t>(sign);
    const uint32_t m = mant | 0x800000u;
    const int shift = 14 - exp;  // 14..24
    uint32_t h = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
}

uint16_t F32ToF16(float f) {
#ifdef __F16C__
  return static_cast<uint16_t>(_cvtss_sh(f, 0));
#else
  return F32ToF16Portable(f);
#endif
}

int64_t F32ToF16Saturating(const float* x, int64_t n, uint16_t* out) {
  constexpr float kMax = 65504.0f;
  int64_t saturated = 0;
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  const __m256 hi = _mm256_set1_ps(kMax), lo = _mm256_set1_ps(-kMax), inf = _mm256_set1_ps(INFINITY);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 a = _mm256_andnot_ps(sign, v);
    // Finite and beyond the largest f16: |v| > max and |v| < inf (NaN compares false).
    const __m256 over = _mm256_and_ps(_mm256_cmp_ps(a, hi, _CMP_GT_OQ), _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
    const __m256 clamped = _mm256_blendv_ps(v, _mm256_min_ps(_mm256_max_ps(v, lo), hi), over);
    saturated += __builtin_popcount(_mm256_movemask_ps(over));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(clamped, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) {
    float v = x[i];
    if (std::isfinite(v) && std::fabs(v) > kMax) {
      v = v > 0 ? kMax : -kMax;
      ++saturated;
    }
    out[i] = F32ToF16(v);
  }
  return saturated;
}

}  // namespace dd::kernels
