// MatMulInt8's portable fallback (without AVX-512; matmul_int8_internal.h): a weight row
// decoded to integer codes and per-block factors (DecodeRow), dotted with an activation row in
// the reference order (RowDot). The AVX2 path uses both for rows its byte path does not take.
#include <algorithm>
#include <cmath>

#include "cpu/matmul_int8_internal.h"

#if !DD_INT8_AVX512

namespace dd::kernels::int8 {

void DecodeRow(DType t, const uint8_t* src, int64_t k, DecodedRow* out) {
  const int64_t nb = k / kBlock;
  out->code.resize(k);
  out->scale.resize(nb);
  out->minscale.assign(nb, 0.0f);
  out->sc16.assign(2 * nb, 0);
  int32_t* c = out->code.data();
  switch (t) {
    case DType::kQ8_0:
      for (int64_t b = 0; b < nb; ++b, src += 34) {
        out->scale[b] = F16ToF32(LoadU16(src));
        for (int i = 0; i < 32; ++i) c[b * 32 + i] = static_cast<int8_t>(src[2 + i]);
      }
      return;
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1: {
      const bool has_min = t == DType::kQ4_1 || t == DType::kQ5_1;
      const bool five = t == DType::kQ5_0 || t == DType::kQ5_1;
      const int head = 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
      const int zp = five ? (has_min ? 0 : 16) : (has_min ? 0 : 8);
      for (int64_t b = 0; b < nb; ++b, src += head + 16) {
        out->scale[b] = F16ToF32(LoadU16(src));
        if (has_min) out->minscale[b] = F16ToF32(LoadU16(src + 2));
        uint32_t qh = 0;
        if (five) std::memcpy(&qh, src + head - 4, 4);
        for (int j = 0; j < 16; ++j) {
          c[b * 32 + j] = ((src[head + j] & 0x0f) | (((qh >> j) & 1) << 4)) - zp;
          c[b * 32 + 16 + j] = ((src[head + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - zp;
        }
      }
      return;
    }
    case DType::kQ4_K:
    case DType::kQ5_K: {
      const bool five = t == DType::kQ5_K;
      const int64_t bytes = five ? 176 : 144;
      for (int64_t sb = 0; sb < nb / 8; ++sb, src += bytes) {
        const float d = F16ToF32(LoadU16(src)), dmin = F16ToF32(LoadU16(src + 2));
        const uint8_t* qh = src + 16;
        const uint8_t* ql = src + (five ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
          int sc, m;
          ScaleMinK(j, src + 4, &sc, &m);
          out->scale[sb * 8 + j] = d * static_cast<float>(sc);
          out->minscale[sb * 8 + j] = -(dmin * static_cast<float>(m));
          // Sub-block j: the low (even j) or high nibbles of 32 bytes, plus bit j of qh (Q5_K).
          // Branch-free inner loops, so they vectorize.
          const uint8_t* qg = ql + 32 * (j / 2);
          const int shift = 4 * (j % 2);
          int32_t* dst = c + sb * 256 + j * 32;
          if (five) {
            for (int l = 0; l < 32; ++l) dst[l] = ((qg[l] >> shift) & 0x0f) | (((qh[l] >> j) & 1) << 4);
          } else {
            for (int l = 0; l < 32; ++l) dst[l] = (qg[l] >> shift) & 0x0f;
          }
        }
      }
      return;
    }
    case DType::kQ6_K:
      for (int64_t sb = 0; sb < nb / 8; ++sb, src += 210) {
        const float d = F16ToF32(LoadU16(src + 208));
        for (int i = 0; i < 16; ++i) out->sc16[sb * 16 + i] = static_cast<int8_t>(src[192 + i]);
        for (int j = 0; j < 8; ++j) out->scale[sb * 8 + j] = d;
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = src + 64 * h;
          const uint8_t* qh = src + 128 + 32 * h;
          int32_t* e = c + sb * 256 + 128 * h;
          for (int l = 0; l < 32; ++l) {
            e[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            e[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            e[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            e[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          }
        }
      }
      return;
    default: return;
  }
}

namespace {
#if DD_INT8_AVX2
// Σ c[i]·x[i] over 16 elements, exactly (codes fit in int16): VPMADDWD instead of the
// compiler's 32-bit multiplies.
inline int32_t Dot16(const int32_t* c, const int8_t* x) {
  const __m256i c16 = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)),
                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 8))),
      _MM_SHUFFLE(3, 1, 2, 0));
  const __m256i x16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i p = _mm256_madd_epi16(c16, x16);
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
}
#endif
}  // namespace


float RowDot(DType t, const DecodedRow& w, const QuantActs& a, int64_t r) {
  const int8_t* q = a.q(r);
  float acc = 0.0f;
  for (int64_t b = 0; b < a.nb; ++b) {
    const int32_t* c = w.code.data() + b * kBlock;
    const int8_t* x = q + b * kBlock;
#if DD_INT8_AVX2
    const int32_t lo = Dot16(c, x), hi = Dot16(c + 16, x + 16);
#else
    int32_t lo = 0, hi = 0;
    for (int i = 0; i < 16; ++i) {
      lo += c[i] * x[i];
      hi += c[16 + i] * x[16 + i];
    }
#endif
    const int32_t dot = t == DType::kQ6_K ? w.sc16[2 * b] * lo + w.sc16[2 * b + 1] * hi : lo + hi;
    acc = std::fma(static_cast<float>(dot), w.scale[b] * a.d(r)[b], acc);
    if (HasMin(t)) acc = std::fma(w.minscale[b], a.xs(r)[b], acc);
  }
  return acc;
}

#if !DD_INT8_AVX2
TileRunner PortableTiles(const Call& c) {
  return [c](int64_t t0, int64_t t1) {
    thread_local DecodedRow row;
    for (int64_t n = t0 * kTile; n < std::min(c.w.rows, t1 * kTile); ++n) {
      DecodeRow(c.w.type, c.w.data + n * c.w.row_bytes, c.w.cols, &row);
      for (int64_t r = 0; r < c.m_rows; ++r) {
        const float v = RowDot(c.w.type, row, c.acts, r);
        c.y[r * c.y_stride + n] = c.bias != nullptr ? v + c.bias[n] : v;
      }
    }
  };
}
#endif

}  // namespace dd::kernels::int8

#endif  // !DD_INT8_AVX512
