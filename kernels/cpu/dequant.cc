// Dequantization of the ggml block formats (layouts as documented in ggml's ggml-common.h;
// written here from the format description). Values must match the `gguf` Python package's
// dequantization, which tests/reference uses independently.
#include <cstring>

#include "dd/kernels/cpu_ops.h"

namespace dd::kernels {
namespace {

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void DequantQ8_0(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b, src += 34, dst += 32) {
    const float d = F16ToF32(LoadU16(src));
    const int8_t* q = reinterpret_cast<const int8_t*>(src + 2);
    for (int i = 0; i < 32; ++i) dst[i] = d * static_cast<float>(q[i]);
  }
}

// Q4_0 (d | 16 bytes of nibbles) and Q4_1 (d | m | nibbles): element j < 16 is the low nibble
// of byte j, element j + 16 its high nibble; x = d·(q − 8) or d·q + m.
template <bool kHasMin>
void DequantQ4(const uint8_t* src, float* dst, int64_t n) {
  constexpr int64_t kBytes = kHasMin ? 20 : 18;
  for (int64_t b = 0; b < n / 32; ++b, src += kBytes, dst += 32) {
    const float d = F16ToF32(LoadU16(src));
    const float m = kHasMin ? F16ToF32(LoadU16(src + 2)) : 0.0f;
    const uint8_t* qs = src + (kHasMin ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      if (kHasMin) {
        dst[j] = d * static_cast<float>(qs[j] & 0x0f) + m;
        dst[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      } else {
        dst[j] = d * static_cast<float>((qs[j] & 0x0f) - 8);
        dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      }
    }
  }
}

// Q5_0 (d | 32 high bits | nibbles) and Q5_1 (d | m | high bits | nibbles): q = nibble | high
// bit << 4, x = d·(q − 16) or d·q + m.
template <bool kHasMin>
void DequantQ5(const uint8_t* src, float* dst, int64_t n) {
  constexpr int64_t kHead = kHasMin ? 8 : 6;
  for (int64_t b = 0; b < n / 32; ++b, src += kHead + 16, dst += 32) {
    const float d = F16ToF32(LoadU16(src));
    const float m = kHasMin ? F16ToF32(LoadU16(src + 2)) : 0.0f;
    uint32_t qh;
    std::memcpy(&qh, src + kHead - 4, 4);
    const uint8_t* qs = src + kHead;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0f) | (((qh >> j) << 4) & 0x10);
      const int hi = (qs[j] >> 4) | ((qh >> (j + 12)) & 0x10);
      if (kHasMin) {
        dst[j] = d * static_cast<float>(lo) + m;
        dst[j + 16] = d * static_cast<float>(hi) + m;
      } else {
        dst[j] = d * static_cast<float>(lo - 16);
        dst[j + 16] = d * static_cast<float>(hi - 16);
      }
    }
  }
}

// 6-bit scale and min of sub-block j (0..7) packed in 12 bytes (Q4_K / Q5_K).
inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void DequantQ4_K(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n / 256; ++b, src += 144) {
    const float d = F16ToF32(LoadU16(src));
    const float dmin = F16ToF32(LoadU16(src + 2));
    const uint8_t* scales = src + 4;
    const uint8_t* q = src + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
      uint8_t sc, m;
      ScaleMinK4(is, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      ScaleMinK4(is + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *dst++ = d1 * static_cast<float>(q[l] & 0x0f) - m1;
      for (int l = 0; l < 32; ++l) *dst++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void DequantQ5_K(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n / 256; ++b, src += 176) {
    const float d = F16ToF32(LoadU16(src));
    const float dmin = F16ToF32(LoadU16(src + 2));
    const uint8_t* scales = src + 4;
    const uint8_t* qh = src + 16;
    const uint8_t* ql = src + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
      uint8_t sc, m;
      ScaleMinK4(is, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      ScaleMinK4(is + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) {
        *dst++ = d1 * static_cast<float>((ql[l] & 0x0f) + ((qh[l] & u1) ? 16 : 0)) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        *dst++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
      }
      u1 <<= 2;
      u2 <<= 2;
    }
  }
}

void DequantQ6_K(const uint8_t* src, float* dst, int64_t n) {
  for (int64_t b = 0; b < n / 256; ++b, src += 210) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(src + 192);
    const float d = F16ToF32(LoadU16(src + 208));
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, dst += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        dst[l] = d * sc[is] * static_cast<float>(q1);
        dst[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
        dst[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
        dst[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
      }
    }
  }
}

}  // namespace

void DequantizeRow(DType t, const void* src_v, float* dst, int64_t n) {
  const uint8_t* src = static_cast<const uint8_t*>(src_v);
  switch (t) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToF32(LoadU16(src + 2 * i));
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToF32(LoadU16(src + 2 * i));
      return;
    case DType::kQ8_0: DequantQ8_0(src, dst, n); return;
    case DType::kQ4_0: DequantQ4<false>(src, dst, n); return;
    case DType::kQ4_1: DequantQ4<true>(src, dst, n); return;
    case DType::kQ5_0: DequantQ5<false>(src, dst, n); return;
    case DType::kQ5_1: DequantQ5<true>(src, dst, n); return;
    case DType::kQ4_K: DequantQ4_K(src, dst, n); return;
    case DType::kQ5_K: DequantQ5_K(src, dst, n); return;
    case DType::kQ6_K: DequantQ6_K(src, dst, n); return;
  }
}

}  // namespace dd::kernels
