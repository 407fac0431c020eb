// MatMulInt8 on AVX2 + FMA without AVX-512 (e.g. AMD Zen 2/3; matmul_int8_internal.h): up to
// kBytePathMaxRows activation rows, 8 weight rows per call dotted straight from their bytes
// (RowDotBytes8 for Q8_0/Q4_x/Q5_x, RowDotK8 for Q4_K/Q6_K, one lane per weight row); more
// rows through a transposed int16 tile of 8 decoded rows (PairTile). Every path gives
// RowDot's bits (matmul_int8.cc).
#include <algorithm>
#include <cmath>

#include "cpu/matmul_int8_internal.h"

#if DD_INT8_AVX2

namespace dd::kernels::int8 {
namespace {

// Types whose 32-element blocks RowDotBytes reads straight from the weight bytes.
bool HasBytePath(DType t) {
  return t == DType::kQ8_0 || t == DType::kQ4_0 || t == DType::kQ4_1 || t == DType::kQ5_0 || t == DType::kQ5_1;
}

// Byte i of the result is 0x10 where bit i of `bits` is set, else 0.
inline __m256i FifthBits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i mask = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

// Bytes per 32-element block: f16 scale, [f16 min], [32 fifth bits], 16 nibble bytes (Q8_0: 32 codes).
constexpr int64_t BytePathBlockBytes(DType t) {
  return t == DType::kQ8_0 ? 34
                           : 18 + ((t == DType::kQ4_1 || t == DType::kQ5_1) ? 2 : 0) +
                                 ((t == DType::kQ5_0 || t == DType::kQ5_1) ? 4 : 0);
}

// A HasBytePath block's 32 weight codes as bytes: Q8_0's signed codes as stored, the others'
// unsigned codes (elements 0..15: the 16 bytes' low nibbles, 16..31: their high nibbles, plus
// the fifth bits).
template <DType t>
inline __m256i BlockCodes(const uint8_t* blk) {
  if constexpr (t == DType::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    constexpr bool five = t == DType::kQ5_0 || t == DType::kQ5_1;
    constexpr int head = 2 + ((t == DType::kQ4_1 || t == DType::kQ5_1) ? 2 : 0) + (five ? 4 : 0);
    const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + head));
    __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(0x0f));
    if constexpr (five) {
      uint32_t qh;
      std::memcpy(&qh, blk + head - 4, 4);
      w = _mm256_or_si256(w, FifthBits(qh));
    }
    return w;
  }
}

// BlockCodes times activations x, as eight int32 partial sums whose total is the block's
// integer dot before the zero point (RowDotBytesOf, RowDotBytes8Of).
template <DType t>
inline __m256i BlockProducts(__m256i w, __m256i x) {
  const __m256i p = t == DType::kQ8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                      : _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// One weight row (a HasBytePath type) · activation row r, from the weight bytes without
// DecodeRow: RowDot's integer dot per block and its float ops in its order. Unsigned codes
// times int8 activations on VPMADDUBSW cannot saturate (2·31·127 < 2^15; Q8_0 runs as
// |w|·sign(x, w), 2·128·127 < 2^15); a zero point comes back as c32 = −zp·Σx, exactly.
template <DType t>
float RowDotBytesOf(const uint8_t* src, const QuantActs& a, int64_t r) {
  const int8_t* q = a.q(r);
  const float* d = a.d(r);
  const float* xs = a.xs(r);
  const int32_t* c32 = a.c32(r);
  constexpr bool has_min = t == DType::kQ4_1 || t == DType::kQ5_1;
  constexpr bool zp = t == DType::kQ4_0 || t == DType::kQ5_0;
  float acc = 0.0f;
  for (int64_t b = 0; b < a.nb; ++b, src += BytePathBlockBytes(t)) {
    const __m256i p =
        BlockProducts<t>(BlockCodes<t>(src), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock)));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    const int32_t dot = _mm_cvtsi128_si32(h) + (zp ? c32[b] : 0);
    acc = std::fma(static_cast<float>(dot), F16ToF32(LoadU16(src)) * d[b], acc);
    if constexpr (has_min) acc = std::fma(F16ToF32(LoadU16(src + 2)), xs[b], acc);
  }
  return acc;
}

// An 8×8 matrix of dwords in v[0..7] (row i in v[i]) transposed in place: dword j of v[i]
// becomes dword i of v[j].
inline void TransposeDwords8(__m256i v[8]) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);      // rows i, i+1: dwords 0, 1 | 4, 5
    a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);  // dwords 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {
    for (int h = 0; h < 2; ++h) {
      b[i + 2 * h] = _mm256_unpacklo_epi64(a[i + h], a[i + 2 + h]);      // rows i..i+3: dword 2h | 2h+4
      b[i + 2 * h + 1] = _mm256_unpackhi_epi64(a[i + h], a[i + 2 + h]);  // dword 2h+1 | 2h+5
    }
  }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x20);
    v[j + 4] = _mm256_permute2x128_si256(b[j], b[4 + j], 0x31);
  }
}

// The f16s at p, p + stride, ..., p + 7·stride, as floats (exact).
inline __m256 Halves8(const uint8_t* p, int64_t stride) {
  return _mm256_cvtph_ps(_mm_setr_epi16(LoadU16(p), LoadU16(p + stride), LoadU16(p + 2 * stride),
                                        LoadU16(p + 3 * stride), LoadU16(p + 4 * stride), LoadU16(p + 5 * stride),
                                        LoadU16(p + 6 * stride), LoadU16(p + 7 * stride)));
}

// RowDotBytesOf for 8 weight rows `row_bytes` apart against activation rows r..r+M-1, one
// lane per weight row: lane i of out[8m..8m+7] gets the same integer dots and the same float ops
// in the same order as RowDotBytesOf on row i and activation row r+m (same bits), without its
// serial per-block chain and horizontal sums; the M activation rows share each weight block's
// decode and scale loads.
template <DType t, int M>
__attribute__((noinline)) void RowDotBytes8Of(const uint8_t* src, int64_t row_bytes, const QuantActs& a, int64_t r, float* out) {
  constexpr bool has_min = t == DType::kQ4_1 || t == DType::kQ5_1;
  constexpr bool zp = t == DType::kQ4_0 || t == DType::kQ5_0;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b, src += BytePathBlockBytes(t)) {
    // h[k]: rows 2k, 2k+1 against one activation row, pairwise summed. Unsigned 4- and 5-bit
    // codes stay in int16 until 8 products are summed (|8 · 31 · 128| < 2^15): one VPMADDWD per
    // four rows instead of one per row. Integer sums: the same dots whatever the order.
    constexpr bool narrow = t != DType::kQ8_0;
    const __m256 scales = Halves8(src, row_bytes);
    const __m256 mins = has_min ? Halves8(src + 2, row_bytes) : _mm256_setzero_ps();
    const auto pair = [](__m256i w0, __m256i w1, __m256i x) {
      return narrow ? _mm256_hadd_epi16(_mm256_maddubs_epi16(w0, x), _mm256_maddubs_epi16(w1, x))
                    : _mm256_hadd_epi32(BlockProducts<t>(w0, x), BlockProducts<t>(w1, x));
    };
    const auto quad = [](__m256i a, __m256i b) {  // rows 0-3 (or 4-7), one int32 each per lane
      return narrow ? _mm256_madd_epi16(_mm256_hadd_epi16(a, b), _mm256_set1_epi16(1)) : _mm256_hadd_epi32(a, b);
    };
    const auto finish = [&](int m, __m256i dot) {  // lane i: weight row i's integer dot
      if constexpr (zp) dot = _mm256_add_epi32(dot, _mm256_set1_epi32(a.c32(r + m)[b]));
      const __m256 sd = _mm256_mul_ps(scales, _mm256_set1_ps(a.d(r + m)[b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, acc[m]);
      if constexpr (has_min) acc[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.xs(r + m)[b]), acc[m]);
    };
    const auto add_row = [&](int m, __m256i h0, __m256i h1, __m256i h2, __m256i h3) {
      // [rows 0-3 | rows 0-3] and [rows 4-7 | rows 4-7], halves of each row's sum in each lane.
      const __m256i p0123 = quad(h0, h1), p4567 = quad(h2, h3);
      finish(m, _mm256_add_epi32(_mm256_permute2x128_si256(p0123, p4567, 0x20),
                                 _mm256_permute2x128_si256(p0123, p4567, 0x31)));
    };
    if constexpr (narrow && M >= 2) {
      // The eight rows' codes transposed once (dword j of lane i: row i's codes 4j..4j+3), so
      // each activation dword, broadcast, meets all eight rows in one VPMADDUBSW and the lanes
      // end up holding the rows' dots: no horizontal sums per activation row. Four products
      // of a 5-bit code and an int8 stay in int16 (4 · 2 · 31 · 127 < 2^15).
      __m256i w[8];
      for (int i = 0; i < 8; ++i) w[i] = BlockCodes<t>(src + i * row_bytes);
      TransposeDwords8(w);
      for (int m = 0; m < M; ++m) {
        const int32_t* x = reinterpret_cast<const int32_t*>(a.q(r + m) + b * kBlock);
        const auto dot2 = [&](int k) { return _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(x[k])); };
        const auto four = [&](int j) {
          return _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_add_epi16(dot2(j), dot2(j + 1)), _mm256_add_epi16(dot2(j + 2), dot2(j + 3))),
              _mm256_set1_epi16(1));
        };
        finish(m, _mm256_add_epi32(four(0), four(4)));
      }
    } else {
      // The activation rows loaded first, each weight pair against all of them, summed
      // horizontally: one row of a 4-5-bit type (the transpose did not pay for itself: Q5_0
      // 1.08× slower) and Q8_0 (transposed, its sign trick made m = 2 1.1-1.3× slower).
      __m256i x[M], h[4][M];
      for (int m = 0; m < M; ++m) x[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q(r + m) + b * kBlock));
      for (int k = 0; k < 4; ++k) {
        const __m256i w0 = BlockCodes<t>(src + 2 * k * row_bytes), w1 = BlockCodes<t>(src + (2 * k + 1) * row_bytes);
        for (int m = 0; m < M; ++m) h[k][m] = pair(w0, w1, x[m]);
      }
      for (int m = 0; m < M; ++m) add_row(m, h[0][m], h[1][m], h[2][m], h[3][m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

// Activation rows per RowDotBytes8 / RowDotK8 call: each weight block's decode (and, from two
// rows, its transpose) and scale loads are shared by this many
// (docs/decisions/0003-simd-dispatch-same-bits.md). 8 beat 4 at m = 8 (a dual step at batch 4)
// for the 4-6-bit types: dd-bench-matmul cold, one thread, median of 3 alternating runs, 8 vs
// 4: Q5_0 2048×640 0.77-0.90, Q4_K 640×1024 0.90, Q6_K 640×2048 0.90, Q4_1 1536×576 0.78-0.85.
// Q8_0 keeps 4 (its products need two VPSIGNB each, and 8 in one call ran up to 1.4× slower).
// Each instantiation stays out of line: inlined together into the dispatch, Q6_K's m = 1 and
// 2 ran 1.4-1.7× slower.
constexpr int kBytes8Rows = 8;
constexpr int RowsPerCall(DType t) { return t == DType::kQ8_0 ? 4 : kBytes8Rows; }
// How far ahead the byte path prefetches weight rows: whole octets of rows, the fewest that
// reach kBytePathAheadBytes. Fixed octet counts favoured different matrices: 2 beat 1 and 4 on
// dd-bench-matmul's cold rows, while Gemma's decode (its Q8_0 LM head's octets are 5.4 KB) ran
// 4.5% faster at 1 (71.5 vs 68.4 tok/s, AVX2 build, AMD EPYC, 3 alternating runs) and SmolLM2's
// (Q4_1 octets of 2.9 KB) the same at 1 and 2. A longer distance issues its prefetches too early
// for the line-fill buffers: 4 octets ran Gemma at 59 tok/s.
constexpr int64_t kBytePathAheadBytes = 3 << 10;
constexpr int64_t BytePathAhead(int64_t row_bytes) { return (kBytePathAheadBytes + 8 * row_bytes - 1) / (8 * row_bytes); }

// f.template operator()<M>() with M = min(rows, kMax) as a constant (rows >= 1).
template <int kMax, typename F>
void WithRows(int rows, F&& f) {
  if constexpr (kMax == 1) {
    f.template operator()<1>();
  } else if (rows >= kMax) {
    f.template operator()<kMax>();
  } else {
    WithRows<kMax - 1>(rows, f);
  }
}

// RowDotBytes8Of for `rows` (1..kBytes8Rows) activation rows from r.
template <DType t>
void RowDotBytes8For(int rows, const uint8_t* src, int64_t row_bytes, const QuantActs& a, int64_t r, float* out) {
  WithRows<RowsPerCall(t)>(rows, [&]<int M>() { RowDotBytes8Of<t, M>(src, row_bytes, a, r, out); });
}

void RowDotBytes8(DType t, int rows, const uint8_t* src, int64_t row_bytes, const QuantActs& a, int64_t r,
                  float* out) {
  switch (t) {
    case DType::kQ8_0: return RowDotBytes8For<DType::kQ8_0>(rows, src, row_bytes, a, r, out);
    case DType::kQ4_0: return RowDotBytes8For<DType::kQ4_0>(rows, src, row_bytes, a, r, out);
    case DType::kQ4_1: return RowDotBytes8For<DType::kQ4_1>(rows, src, row_bytes, a, r, out);
    case DType::kQ5_0: return RowDotBytes8For<DType::kQ5_0>(rows, src, row_bytes, a, r, out);
    default: return RowDotBytes8For<DType::kQ5_1>(rows, src, row_bytes, a, r, out);
  }
}

// Q4_K / Q6_K rows from their bytes, 8 weight rows and M activation rows per call: lane i of
// out[8m..8m+7] gets RowDot's integer dot and float ops for row i (same bits), without
// DecodeRow's int32 codes. Per 256-element superblock the rows' factors are laid out lane by
// lane first (Q4_K: d·sc and −dmin·m as DecodeRow computes them; Q6_K: d and the two int8
// half-scales of each block); per 32-element block the codes are bytes (Q4_K: a nibble,
// Q6_K: 4 + 2 bits, unsigned, its zero point 32 coming back through c16 per 16 elements).
bool HasKBytePath(DType t) { return t == DType::kQ4_K || t == DType::kQ6_K; }

template <DType t>
inline __m256i KBlockCodes(const uint8_t* sb, int j) {
  if constexpr (t == DType::kQ4_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16 + 32 * (j / 2)));
    return _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (j % 2))), _mm256_set1_epi8(0x0f));
  } else {
    const int h = j / 4, g = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * h + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (g >> 1))), _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(0x03));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
}

template <DType t, int M>
__attribute__((noinline)) void RowDotK8Of(const uint8_t* src, int64_t row_bytes, const QuantActs& a, int64_t r, float* out) {
  constexpr bool q4 = t == DType::kQ4_K;
  constexpr int64_t sb_bytes = q4 ? 144 : 210;
  alignas(32) float scale[8][8], minscale[8][8];  // [block j][row i]
  alignas(32) int32_t sc_lo[8][8], sc_hi[8][8];
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < a.nb / 8; ++sb) {
    const uint8_t* base = src + sb * sb_bytes;
    for (int i = 0; i < 8; ++i) {
      const uint8_t* p = base + i * row_bytes;
      if constexpr (q4) {
        const float d = F16ToF32(LoadU16(p)), dmin = F16ToF32(LoadU16(p + 2));
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          ScaleMinK(j, p + 4, &sc, &mn);
          scale[j][i] = d * static_cast<float>(sc);
          minscale[j][i] = -(dmin * static_cast<float>(mn));
        }
      } else {
        const float d = F16ToF32(LoadU16(p + 208));
        for (int j = 0; j < 8; ++j) {
          scale[j][i] = d;
          sc_lo[j][i] = static_cast<int8_t>(p[192 + 2 * j]);
          sc_hi[j][i] = static_cast<int8_t>(p[192 + 2 * j + 1]);
        }
      }
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = sb * 8 + j;
      // As RowDotBytes8Of. One activation row: Q4_K's nibbles stay int16 for 8 products, Q6_K's
      // 6-bit codes widen after 2 (2 · 63 · 128 < 2^15); each row's two halves kept apart.
      __m256i w[8];
      for (int i = 0; i < 8; ++i) w[i] = KBlockCodes<t>(base + i * row_bytes, j);
      // From two activation rows on, the codes transposed as in RowDotBytes8Of: lanes hold the
      // rows' sums without horizontal adds (Q6_K: two products of a 6-bit code in int16).
      if constexpr (M >= 2) TransposeDwords8(w);
      const __m256 sj = _mm256_load_ps(scale[j]);
      for (int m = 0; m < M; ++m) {
        __m256i lo, hi;  // lane i: row i's dot over elements 0-15 and 16-31
        if constexpr (M >= 2) {
          const int32_t* x = reinterpret_cast<const int32_t*>(a.q(r + m) + b * kBlock);
          const auto dot2 = [&](int k) { return _mm256_maddubs_epi16(w[k], _mm256_set1_epi32(x[k])); };
          const auto half = [&](int k) {  // dwords k..k+3
            const __m256i one = _mm256_set1_epi16(1);
            const __m256i s01 = _mm256_add_epi16(dot2(k), dot2(k + 1)), s23 = _mm256_add_epi16(dot2(k + 2), dot2(k + 3));
            return q4 ? _mm256_madd_epi16(_mm256_add_epi16(s01, s23), one)
                      : _mm256_add_epi32(_mm256_madd_epi16(s01, one), _mm256_madd_epi16(s23, one));
          };
          lo = half(0);
          hi = half(4);
        } else {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q(r + m) + b * kBlock));
          __m256i h[4];
          for (int k = 0; k < 4; ++k) {
            const __m256i p0 = _mm256_maddubs_epi16(w[2 * k], x), p1 = _mm256_maddubs_epi16(w[2 * k + 1], x);
            h[k] = q4 ? _mm256_hadd_epi16(p0, p1)
                      : _mm256_hadd_epi32(_mm256_madd_epi16(p0, _mm256_set1_epi16(1)),
                                          _mm256_madd_epi16(p1, _mm256_set1_epi16(1)));
          }
          __m256i p0123, p4567;
          if constexpr (q4) {
            p0123 = _mm256_madd_epi16(_mm256_hadd_epi16(h[0], h[1]), _mm256_set1_epi16(1));
            p4567 = _mm256_madd_epi16(_mm256_hadd_epi16(h[2], h[3]), _mm256_set1_epi16(1));
          } else {
            p0123 = _mm256_hadd_epi32(h[0], h[1]);
            p4567 = _mm256_hadd_epi32(h[2], h[3]);
          }
          // [rows 0-7] of the first and of the second 16 elements.
          lo = _mm256_permute2x128_si256(p0123, p4567, 0x20);
          hi = _mm256_permute2x128_si256(p0123, p4567, 0x31);
        }
        __m256i dot;
        if constexpr (q4) {
          dot = _mm256_add_epi32(lo, hi);
        } else {
          const int32_t* c16 = a.c16(r + m) + 2 * b;
          dot = _mm256_add_epi32(
              _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc_lo[j])),
                                 _mm256_add_epi32(lo, _mm256_set1_epi32(c16[0]))),
              _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc_hi[j])),
                                 _mm256_add_epi32(hi, _mm256_set1_epi32(c16[1]))));
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sj, _mm256_set1_ps(a.d(r + m)[b])), acc[m]);
        if constexpr (q4) {
          acc[m] = _mm256_fmadd_ps(_mm256_load_ps(minscale[j]), _mm256_set1_ps(a.xs(r + m)[b]), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + 8 * m, acc[m]);
}

template <DType t>
void RowDotK8For(int rows, const uint8_t* src, int64_t row_bytes, const QuantActs& a, int64_t r, float* out) {
  WithRows<RowsPerCall(t)>(rows, [&]<int M>() { RowDotK8Of<t, M>(src, row_bytes, a, r, out); });
}

void RowDotK8(DType t, int rows, const uint8_t* src, int64_t row_bytes, const QuantActs& a, int64_t r, float* out) {
  if (t == DType::kQ4_K) return RowDotK8For<DType::kQ4_K>(rows, src, row_bytes, a, r, out);
  return RowDotK8For<DType::kQ6_K>(rows, src, row_bytes, a, r, out);
}

float RowDotBytes(DType t, const uint8_t* src, const QuantActs& a, int64_t r) {
  switch (t) {
    case DType::kQ8_0: return RowDotBytesOf<DType::kQ8_0>(src, a, r);
    case DType::kQ4_0: return RowDotBytesOf<DType::kQ4_0>(src, a, r);
    case DType::kQ4_1: return RowDotBytesOf<DType::kQ4_1>(src, a, r);
    case DType::kQ5_0: return RowDotBytesOf<DType::kQ5_0>(src, a, r);
    default: return RowDotBytesOf<DType::kQ5_1>(src, a, r);
  }
}

constexpr int kPairRows = 8;  // weight rows per PairTile: one 32-bit lane each
// Up to this many activation rows, the weight rows are dotted from their bytes (RowDotBytes8,
// RowDotK8) or decoded one at a time (RowDot) instead of PairTile. PairTile's decode and
// transpose cost about one row of RowDot. dd-bench-matmul --m, one thread, ms, byte path (4
// activation rows per call) vs PairTile: Q4_1 1536×576 m = 24 0.84 vs 1.56, m = 32 1.05-1.15
// vs 1.21-1.69, m = 64 1.89-2.25 vs 2.02-3.41, m = 96+ no better; Q5_0 2048×640 m = 32 1.84 vs
// 2.24, m = 64 3.56 vs 3.55; Q8_0 2048×640 m = 32 1.73 vs 2.45; Q6_K 640×2048 m = 24 1.85 vs
// 2.36, m = 32 2.66 vs 2.80, m = 48 4.21 vs 3.61; Q4_K 640×1024 m = 32 0.76 vs 1.12. (With 2
// rows per call the crossing was m = 16-32.) 32 covers a dual step at batch 16.
constexpr int64_t kBytePathMaxRows = 32, kRowPathMaxRows = 1;

struct alignas(32) Lanes8 {
  int32_t i[8];
};
struct alignas(32) Floats8 {
  float f[8];
};

// 8 decoded weight rows, transposed for VPMADDWD: lane c of pairs[16 b + p] holds row c's
// codes 32b + 2p and 32b + 2p + 1 as two int16; per block, the rows' factors as 8 lanes.
// Rows past the matrix repeat its last row (their lanes are never stored).
struct PairTile {
  std::vector<Lanes8> pairs, sc_lo, sc_hi;  // sc_*: Q6_K's int8 scales of the two halves
  std::vector<Floats8> scale, minscale;
};

void BuildPairTile(DType t, const WeightView& w, int64_t n0, int valid, DecodedRow* row, PairTile* out) {
  const int64_t nb = w.cols / kBlock;
  out->pairs.resize(nb * 16);
  out->sc_lo.resize(nb);
  out->sc_hi.resize(nb);
  out->scale.resize(nb);
  out->minscale.resize(nb);
  for (int c = 0; c < kPairRows; ++c) {
    DecodeRow(t, w.data + (n0 + std::min(c, valid - 1)) * w.row_bytes, w.cols, row);
    const int32_t* code = row->code.data();
    for (int64_t j = 0; j < nb * 16; ++j) {
      out->pairs[j].i[c] = static_cast<int32_t>(static_cast<uint16_t>(code[2 * j]) |
                                                (static_cast<uint32_t>(static_cast<uint16_t>(code[2 * j + 1])) << 16));
    }
    for (int64_t b = 0; b < nb; ++b) {
      out->scale[b].f[c] = row->scale[b];
      out->minscale[b].f[c] = row->minscale[b];
      out->sc_lo[b].i[c] = row->sc16[2 * b];
      out->sc_hi[b].i[c] = row->sc16[2 * b + 1];
    }
  }
}

// Activation row r's int8 codes as int16 pairs (the VPMADDWD broadcast operand), k/2 per row.
void PackActPairs(const QuantActs& a, int64_t r, int32_t* out) {
  const int8_t* q = a.q(r);
  for (int64_t j = 0; j < a.k / 2; ++j) {
    out[j] = static_cast<int32_t>(static_cast<uint16_t>(static_cast<int16_t>(q[2 * j])) |
                                  (static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(q[2 * j + 1]))) << 16));
  }
}

// Rows n0.. n0+valid of y for every activation row: RowDot's integer dots (summed in another
// order: exact) and its float ops per lane in its order.
void PairTileRows(DType t, const PairTile& pt, const QuantActs& a, const int32_t* act_pairs, int64_t m_rows,
                  int64_t n0, int valid, const float* bias, float* y, int64_t y_stride) {
  const bool q6 = t == DType::kQ6_K, has_min = HasMin(t);
  for (int64_t r = 0; r < m_rows; ++r) {
    const int32_t* ap = act_pairs + r * (a.k / 2);
    const float* d = a.d(r);
    const float* xs = a.xs(r);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < a.nb; ++b) {
      const Lanes8* wp = &pt.pairs[b * 16];
      const int32_t* bp = ap + b * 16;
      __m256i half[2];
      for (int h = 0; h < 2; ++h) {
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int p = 8 * h; p < 8 * h + 8; p += 2) {
          s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wp[p].i)),
                                                      _mm256_set1_epi32(bp[p])));
          s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(wp[p + 1].i)),
                                                      _mm256_set1_epi32(bp[p + 1])));
        }
        half[h] = _mm256_add_epi32(s0, s1);
      }
      const __m256i dot =
          q6 ? _mm256_add_epi32(_mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(pt.sc_lo[b].i)), half[0]),
                                _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(pt.sc_hi[b].i)), half[1]))
             : _mm256_add_epi32(half[0], half[1]);
      const __m256 f = _mm256_mul_ps(_mm256_load_ps(pt.scale[b].f), _mm256_set1_ps(d[b]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc);
      if (has_min) acc = _mm256_fmadd_ps(_mm256_load_ps(pt.minscale[b].f), _mm256_set1_ps(xs[b]), acc);
    }
    Floats8 out;
    _mm256_store_ps(out.f, acc);
    for (int c = 0; c < valid; ++c) y[r * y_stride + n0 + c] = bias != nullptr ? out.f[c] + bias[n0 + c] : out.f[c];
  }
}

}  // namespace

TileRunner Avx2Tiles(const Call& c) {
  const DType type = c.w.type;
  // Few activation rows: a transpose would not pay for itself; one weight row at a time.
  const bool bytes = HasBytePath(type), kbytes = HasKBytePath(type);
  const bool by_row = c.m_rows <= (bytes || kbytes ? kBytePathMaxRows : kRowPathMaxRows);
  // Otherwise every row's int16 activation pairs, once per call (read by the workers like the
  // activations).
  thread_local std::vector<int32_t> pair_buf;
  if (!by_row) {
    pair_buf.resize(c.m_rows * (c.w.cols / 2));
    for (int64_t r = 0; r < c.m_rows; ++r) PackActPairs(c.acts, r, pair_buf.data() + r * (c.w.cols / 2));
  }
  const int32_t* act_pairs = pair_buf.data();
  return [c, type, bytes, kbytes, by_row, act_pairs](int64_t t0, int64_t t1) {
    const WeightView& w = c.w;
    thread_local DecodedRow row;
    thread_local PairTile pt;
    const int64_t n_end = std::min(w.rows, t1 * kTile);
    if (!by_row) {
      for (int64_t n0 = t0 * kTile; n0 < n_end; n0 += kPairRows) {
        const int valid = static_cast<int>(std::min<int64_t>(kPairRows, w.rows - n0));
        BuildPairTile(type, w, n0, valid, &row, &pt);
        PairTileRows(type, pt, c.acts, act_pairs, c.m_rows, n0, valid, c.bias, c.y, c.y_stride);
      }
      return;
    }
    int64_t n = t0 * kTile;
    if (bytes || kbytes) {  // 8 weight rows at a time, each activation row against them
      const int64_t per_call = RowsPerCall(type);
      const int64_t ahead = BytePathAhead(w.row_bytes);
      for (; n + 8 <= n_end; n += 8) {
        // Decode streams every weight from DRAM once per step (a model's layers exceed the
        // LLC): ask for the eight rows `ahead` octets ahead while these compute.
        if (const int64_t next = n + 8 * ahead; next + 8 <= w.rows) {
          const uint8_t* p = w.data + next * w.row_bytes;
          for (int64_t off = 0; off < 8 * w.row_bytes; off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
          }
        }
        for (int64_t r = 0; r < c.m_rows; r += per_call) {
          const int rows = static_cast<int>(std::min<int64_t>(per_call, c.m_rows - r));
          float v[8 * kBytes8Rows];
          if (bytes) {
            RowDotBytes8(type, rows, w.data + n * w.row_bytes, w.row_bytes, c.acts, r, v);
          } else {
            RowDotK8(type, rows, w.data + n * w.row_bytes, w.row_bytes, c.acts, r, v);
          }
          for (int m = 0; m < rows; ++m) {
            for (int i = 0; i < 8; ++i) {
              c.y[(r + m) * c.y_stride + n + i] = c.bias != nullptr ? v[8 * m + i] + c.bias[n + i] : v[8 * m + i];
            }
          }
        }
      }
    }
    for (; n < n_end; ++n) {  // the last rows, one at a time
      const uint8_t* src = w.data + n * w.row_bytes;
      if (!bytes) DecodeRow(type, src, w.cols, &row);
      for (int64_t r = 0; r < c.m_rows; ++r) {
        const float v = bytes ? RowDotBytes(type, src, c.acts, r) : RowDot(type, row, c.acts, r);
        c.y[r * c.y_stride + n] = c.bias != nullptr ? v + c.bias[n] : v;
      }
    }
  };
}

}  // namespace dd::kernels::int8

#endif  // DD_INT8_AVX2
