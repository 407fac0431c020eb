// MatMulInt8 on AVX-512 VNNI (matmul_int8_internal.h): 16-row weight tiles transposed so that
// one VPDPBUSD leaves the 16 rows' dots in the 16 lanes (matmul_int8.cc has the layout).
#include <algorithm>
#include <cmath>

#include "cpu/matmul_int8_internal.h"

#if DD_INT8_AVX512

namespace dd::kernels::int8 {
namespace {

constexpr int64_t kRowChunk = 64;         // activation rows whose accumulators stay in L1 per tile
constexpr int64_t kScratchPerBlock = 32;  // a tile's 16 f16 scales per block (Q8_0) or super-block

// Weight bytes are prefetched into L2 about this far ahead (a whole number of tiles, at least 1).
constexpr int64_t kPrefetchBytesAhead = 32 << 10;  // 16..64 KiB measured alike at m = 1
int64_t PrefetchTilesAhead(int64_t row_bytes) {
  return std::max<int64_t>(1, (kPrefetchBytesAhead + kTile * row_bytes / 2) / (kTile * row_bytes));
}

// The 16 (or fewer, at the end) weight rows of one tile. Rows past the matrix repeat its last
// row so every load stays in bounds; their lanes are never stored.
struct Tile {
  const uint8_t* rows[kTile];
  int valid = 0;
  // A later tile's bytes, prefetched one slice per unit of work (a block or sub-block) so that
  // decode (m = 1), which walks 16 rows at once, streams from DRAM near the sequential rate.
  const uint8_t* next = nullptr;
  int64_t next_bytes = 0;
  int64_t slice_bytes = 0;     // a multiple of 64
  uint8_t* scratch = nullptr;  // 64-byte aligned, kScratchPerBlock bytes per 32-element block

  void PlanPrefetch(int64_t units) {
    slice_bytes = (next_bytes + units - 1) / units;
    slice_bytes = (slice_bytes + 63) / 64 * 64;
  }
  void Prefetch(int64_t unit) const {
    const int64_t end = std::min(next_bytes, (unit + 1) * slice_bytes);
    for (int64_t off = unit * slice_bytes; off < end; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
    }
  }
};

Tile MakeTile(const WeightView& w, int64_t n0, int64_t ahead) {
  Tile t;
  t.valid = static_cast<int>(std::min<int64_t>(kTile, w.rows - n0));
  for (int c = 0; c < kTile; ++c) {
    const int rc = std::min(c, t.valid - 1);
    t.rows[c] = w.data + (n0 + rc) * w.row_bytes;
  }
  const int64_t next_begin = n0 + ahead * kTile, next_end = std::min(w.rows, next_begin + kTile);
  if (next_begin < next_end) {
    t.next = w.data + next_begin * w.row_bytes;
    t.next_bytes = (next_end - next_begin) * w.row_bytes;
  }
  return t;
}

inline __m512i Bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// z[j] = [row j | row j+8] as 8 dwords each → out[t] lane c = dword t of row c, for t < kOut
// (a 16×8 dword transpose; outputs t ≥ kOut are not computed).
template <int kOut>
inline void TransposeRows(const __m512i z[8], __m512i* out) {
  __m512i a[8], b[8];
  for (int j = 0; j < 8; j += 2) {
    a[j] = _mm512_unpacklo_epi32(z[j], z[j + 1]);
    a[j + 1] = _mm512_unpackhi_epi32(z[j], z[j + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // rows 0-3 (h = 0) and 4-7 (h = 4) of each 256-bit half
    b[h + 0] = _mm512_unpacklo_epi64(a[h + 0], a[h + 2]);
    b[h + 1] = _mm512_unpackhi_epi64(a[h + 0], a[h + 2]);
    b[h + 2] = _mm512_unpacklo_epi64(a[h + 1], a[h + 3]);
    b[h + 3] = _mm512_unpackhi_epi64(a[h + 1], a[h + 3]);
  }
  const __m512i idx_lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i idx_hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm512_permutex2var_epi64(b[i], idx_lo, b[i + 4]);
    if (i + 4 < kOut) out[i + 4] = _mm512_permutex2var_epi64(b[i], idx_hi, b[i + 4]);
  }
}

// out[t] lane c = bytes [4t, 4t+4) of rows[c] + off, for t < 8.
inline void Transpose16x32(const uint8_t* const* rows, int64_t off, __m512i out[8]) {
  __m512i z[8];
  for (int j = 0; j < 8; ++j) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + off));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j + 8] + off));
    z[j] = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
  }
  TransposeRows<8>(z, out);
}

// A whole kBytes-byte block (Q4_0, Q4_1, Q5_0, Q5_1: 18..24 bytes) per row, with masked loads
// so nothing past the block is read: out[t] lane c = bytes [4t, 4t+4) of rows[c] + off, for
// t < ceil(kBytes / 4), bytes past the block reading 0.
template <int kBytes>
inline void TransposeSmallBlocks(const uint8_t* const* rows, int64_t off, __m512i* out) {
  static_assert(kBytes % 2 == 0 && kBytes <= 32);
  constexpr __mmask16 kWords = static_cast<__mmask16>((1u << (kBytes / 2)) - 1);
  __m512i z[8];
  for (int j = 0; j < 8; ++j) {
    const __m256i lo = _mm256_maskz_loadu_epi16(kWords, rows[j] + off);
    const __m256i hi = _mm256_maskz_loadu_epi16(kWords, rows[j + 8] + off);
    z[j] = _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
  }
  TransposeRows<(kBytes + 3) / 4>(z, out);
}

// out[t] lane c = bytes [4t, 4t+4) of rows[c] + off, for t < 4.
inline void Transpose16x16(const uint8_t* const* rows, int64_t off, __m512i out[4]) {
  __m512i z[4];
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 4] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 8] + off)), 2);
    z[j] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j + 12] + off)), 3);
  }
  const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(a0, a2);
  out[1] = _mm512_unpackhi_epi64(a0, a2);
  out[2] = _mm512_unpacklo_epi64(a1, a3);
  out[3] = _mm512_unpackhi_epi64(a1, a3);
}

// Copies the kBytes-byte field at rows[c] + off + u·unit_bytes to dst[u·dst_stride + c·kBytes]
// for every unit u < units and row c, for the f16 scales no transpose reaches. Scalar loads and
// stores run beside the vector work; VPGATHERDD was slow here (two per Q5_0 block took as long
// as the rest of the block's decode).
template <int kBytes>
void CollectField(const Tile& t, int64_t off, int64_t unit_bytes, int64_t units, uint8_t* dst,
                  int64_t dst_stride) {
  for (int c = 0; c < kTile; ++c) {
    const uint8_t* src = t.rows[c] + off;
    uint8_t* out = dst + c * kBytes;
    for (int64_t u = 0; u < units; ++u) std::memcpy(out + u * dst_stride, src + u * unit_bytes, kBytes);
  }
}

inline __m512 F16Lo(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
inline __m512 F16Hi(__m512i v) { return F16Lo(_mm512_srli_epi32(v, 16)); }

// Integer dot of one 32-element block per lane, starting from `init` (two chains for latency).
inline __m512i Dot32(__m512i init, const __m512i w[8], const int8_t* a) {
  __m512i s0 = init, s1 = _mm512_setzero_si512();
  for (int t = 0; t < 8; t += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[t], Bcast4(a + 4 * t));
    s1 = _mm512_dpbusd_epi32(s1, w[t + 1], Bcast4(a + 4 * t + 4));
  }
  return _mm512_add_epi32(s0, s1);
}
inline __m512i Dot16(__m512i init, const __m512i w[4], const int8_t* a) {
  for (int t = 0; t < 4; ++t) init = _mm512_dpbusd_epi32(init, w[t], Bcast4(a + 4 * t));
  return init;
}

// acc = fma(float(dot), scale · dx, acc): the per-block float step shared by every type.
inline __m512 Accumulate(__m512 acc, __m512i dot, __m512 scale, float dx) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc);
}

void KernelQ8_0(const Tile& t, const QuantActs& a, int64_t r0, int64_t r1, float* acc) {
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  CollectField<2>(t, 0, 34, a.nb, t.scratch, 32);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i w[8];
    t.Prefetch(b);
    Transpose16x32(t.rows, 34 * b + 2, w);
    for (auto& v : w) v = _mm512_xor_si512(v, sign);  // q + 128: unsigned codes
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.scratch + 32 * b)));
    for (int64_t r = r0; r < r1; ++r) {
      float* ar = acc + (r - r0) * kTile;
      const __m512i dot = Dot32(_mm512_set1_epi32(a.c32(r)[b]), w, a.q(r) + b * kBlock);
      _mm512_store_ps(ar, Accumulate(_mm512_load_ps(ar), dot, dw, a.d(r)[b]));
    }
  }
}

// The 32-element types Q4_0 (d | nibbles), Q4_1 (d | m | nibbles), Q5_0 (d | qh | nibbles) and
// Q5_1 (d | m | qh | nibbles). Element j < 16 is the low nibble of byte j, j + 16 its high
// nibble; the fifth bit of element j is bit j of qh.
template <bool kHasMin, bool kFiveBit>
void KernelSmallBlock(const Tile& t, const QuantActs& a, int64_t r0, int64_t r1, float* acc) {
  constexpr int kHead = 2 + (kHasMin ? 2 : 0) + (kFiveBit ? 4 : 0);  // bytes before the nibbles
  constexpr int kBytes = kHead + 16;
  const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
  // VPSHUFBITQMB selectors: byte i of dword d (one row) picks bit 4u + i of that row's qh.
  __m512i select[8];
  for (int u = 0; u < 8; ++u) {
    uint64_t s = 0;
    for (int i = 0; i < 4; ++i) s |= uint64_t(4 * u + i) << (8 * i) | uint64_t(32 + 4 * u + i) << (8 * (4 + i));
    select[u] = _mm512_set1_epi64(static_cast<long long>(s));
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i blk[6], nib[4], w[8];
    t.Prefetch(b);
    TransposeSmallBlocks<kBytes>(t.rows, kBytes * b, blk);
    const __m512 dw = F16Lo(blk[0]);
    // Nibbles start at byte kHead: dword-aligned with a min (4, 8), else 2 bytes into a dword.
    for (int u = 0; u < 4; ++u) {
      if constexpr (kHead % 4 == 0) {
        nib[u] = blk[kHead / 4 + u];
      } else {
        nib[u] = _mm512_shrdi_epi32(blk[kHead / 4 + u], blk[kHead / 4 + u + 1], 16);
      }
    }
    for (int u = 0; u < 4; ++u) {
      w[u] = _mm512_and_si512(nib[u], low4);
      w[u + 4] = _mm512_and_si512(_mm512_srli_epi16(nib[u], 4), low4);
    }
    if (kFiveBit) {
      const __m512i qh = kHasMin ? blk[1] : _mm512_shrdi_epi32(blk[0], blk[1], 16);
      for (int u = 0; u < 8; ++u) {
        w[u] = _mm512_mask_add_epi8(w[u], _mm512_bitshuffle_epi64_mask(qh, select[u]), w[u], bit4);
      }
    }
    const __m512 mw = kHasMin ? F16Hi(blk[0]) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      float* ar = acc + (r - r0) * kTile;
      const __m512i dot = Dot32(_mm512_set1_epi32(a.c32(r)[b]), w, a.q(r) + b * kBlock);
      __m512 f = Accumulate(_mm512_load_ps(ar), dot, dw, a.d(r)[b]);
      if (kHasMin) f = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.xs(r)[b]), f);
      _mm512_store_ps(ar, f);
    }
  }
}

// d·sc_j and dmin·m_j of the 8 sub-blocks of a Q4_K/Q5_K super-block at byte `off`.
inline void KScales(const Tile& t, int64_t off, __m512 dsc[8], __m512 dmm[8]) {
  __m512i head[4];  // d|dmin, then the 12 bytes of packed scales and mins
  Transpose16x16(t.rows, off, head);
  const __m512 d = F16Lo(head[0]), dmin = F16Hi(head[0]);
  const __m512i s0 = head[1], s1 = head[2], s2 = head[3];
  const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
  for (int j = 0; j < 8; ++j) {
    __m512i sc, mn;
    if (j < 4) {
      sc = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * j), m63);
      mn = _mm512_and_si512(_mm512_srli_epi32(s1, 8 * j), m63);
    } else {
      const int s = 8 * (j - 4);
      sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, s), m15),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, s + 6), m3), 4));
      mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, s + 4), m15),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, s + 6), m3), 4));
    }
    dsc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    dmm[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn));
  }
}

// Q4_K and Q5_K: super-blocks of 256 = 4 chunks of 32 bytes of nibbles (low nibbles: sub-block
// 2g, high: 2g+1), Q5_K adding a fifth bit from 32 bytes of qh (bit 2g / 2g+1 of byte l).
template <bool kFiveBit>
void KernelQK(const Tile& t, const QuantActs& a, int64_t r0, int64_t r1, float* acc) {
  constexpr int64_t kSuperBytes = kFiveBit ? 176 : 144;
  constexpr int64_t kQlOffset = kFiveBit ? 48 : 16;
  const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
  for (int64_t sb = 0; sb < a.nb / 8; ++sb) {
    const int64_t so = sb * kSuperBytes;
    __m512 dsc[8], dmm[8];
    KScales(t, so, dsc, dmm);
    __m512i qh[8];
    if (kFiveBit) Transpose16x32(t.rows, so + 16, qh);
    for (int g = 0; g < 4; ++g) {
      t.Prefetch(sb * 4 + g);
      __m512i nib[8], wl[8], wh[8];
      Transpose16x32(t.rows, so + kQlOffset + 32 * g, nib);
      for (int u = 0; u < 8; ++u) {
        wl[u] = _mm512_and_si512(nib[u], low4);
        wh[u] = _mm512_and_si512(_mm512_srli_epi16(nib[u], 4), low4);
        if (kFiveBit) {
          const __mmask64 hl = _mm512_test_epi8_mask(qh[u], _mm512_set1_epi8(static_cast<char>(1 << (2 * g))));
          const __mmask64 hh = _mm512_test_epi8_mask(qh[u], _mm512_set1_epi8(static_cast<char>(2 << (2 * g))));
          wl[u] = _mm512_mask_add_epi8(wl[u], hl, wl[u], bit4);
          wh[u] = _mm512_mask_add_epi8(wh[u], hh, wh[u], bit4);
        }
      }
      const int64_t j0 = sb * 8 + 2 * g;  // activation block of the low-nibble sub-block
      for (int64_t r = r0; r < r1; ++r) {
        float* ar = acc + (r - r0) * kTile;
        const int8_t* q = a.q(r) + j0 * kBlock;
        const float* dx = a.d(r) + j0;
        const float* xs = a.xs(r) + j0;
        __m512 f = _mm512_load_ps(ar);
        f = Accumulate(f, Dot32(_mm512_setzero_si512(), wl, q), dsc[2 * g], dx[0]);
        f = _mm512_fnmadd_ps(dmm[2 * g], _mm512_set1_ps(xs[0]), f);
        f = Accumulate(f, Dot32(_mm512_setzero_si512(), wh, q + kBlock), dsc[2 * g + 1], dx[1]);
        f = _mm512_fnmadd_ps(dmm[2 * g + 1], _mm512_set1_ps(xs[1]), f);
        _mm512_store_ps(ar, f);
      }
    }
  }
}

// Q6_K: per half h, 64 bytes of low nibbles and 32 bytes of 2-bit highs make 4 sub-blocks of 32;
// each 16-element half of a sub-block has its own int8 scale, applied in integer arithmetic
// (|sc_lo·dot_lo + sc_hi·dot_hi| ≤ 2·16·32·127·128 < 2^24, so the float conversion is exact).
void KernelQ6_K(const Tile& t, const QuantActs& a, int64_t r0, int64_t r1, float* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  CollectField<2>(t, 208, 210, a.nb / 8, t.scratch, 32);
  for (int64_t sb = 0; sb < a.nb / 8; ++sb) {
    const int64_t so = sb * 210;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.scratch + 32 * sb)));
    __m512i sc[16], sc_packed[4];
    Transpose16x16(t.rows, so + 192, sc_packed);
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) sc[4 * i + j] = _mm512_srai_epi32(_mm512_slli_epi32(sc_packed[i], 24 - 8 * j), 24);
    }
    for (int h = 0; h < 2; ++h) {
      __m512i lo[8], hi[8], qh[8];
      Transpose16x32(t.rows, so + 64 * h, lo);
      Transpose16x32(t.rows, so + 64 * h + 32, hi);
      Transpose16x32(t.rows, so + 128 + 32 * h, qh);
      for (int s = 0; s < 4; ++s) {
        t.Prefetch(sb * 8 + 4 * h + s);
        __m512i w[8];
        for (int u = 0; u < 8; ++u) {
          const __m512i src = (s & 1) ? hi[u] : lo[u];
          const __m512i nib = (s < 2) ? src : _mm512_srli_epi16(src, 4);
          __m512i top;
          switch (s) {
            case 0: top = _mm512_slli_epi16(qh[u], 4); break;
            case 1: top = _mm512_slli_epi16(qh[u], 2); break;
            case 2: top = qh[u]; break;
            default: top = _mm512_srli_epi16(qh[u], 2); break;
          }
          w[u] = _mm512_or_si512(_mm512_and_si512(nib, low4), _mm512_and_si512(top, bits45));
        }
        const int64_t j = sb * 8 + 4 * h + s;
        const __m512i sc_lo = sc[8 * h + 2 * s], sc_hi = sc[8 * h + 2 * s + 1];
        for (int64_t r = r0; r < r1; ++r) {
          float* ar = acc + (r - r0) * kTile;
          const int8_t* q = a.q(r) + j * kBlock;
          const int32_t* c16 = a.c16(r) + 2 * j;
          const __m512i dlo = Dot16(_mm512_set1_epi32(c16[0]), w, q);
          const __m512i dhi = Dot16(_mm512_set1_epi32(c16[1]), w + 4, q + 16);
          const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(dlo, sc_lo), _mm512_mullo_epi32(dhi, sc_hi));
          _mm512_store_ps(ar, Accumulate(_mm512_load_ps(ar), dot, d, a.d(r)[j]));
        }
      }
    }
  }
}

using Kernel = void (*)(const Tile&, const QuantActs&, int64_t, int64_t, float*);

Kernel KernelFor(DType t) {
  switch (t) {
    case DType::kQ8_0: return KernelQ8_0;
    case DType::kQ4_0: return KernelSmallBlock<false, false>;
    case DType::kQ4_1: return KernelSmallBlock<true, false>;
    case DType::kQ5_0: return KernelSmallBlock<false, true>;
    case DType::kQ5_1: return KernelSmallBlock<true, true>;
    case DType::kQ4_K: return KernelQK<false>;
    case DType::kQ5_K: return KernelQK<true>;
    case DType::kQ6_K: return KernelQ6_K;
    default: return nullptr;
  }
}

void RunTile(Kernel kernel, int64_t prefetch_units, int64_t ahead, const WeightView& w, int64_t n0,
             const QuantActs& a, int64_t m_rows, const float* bias, float* y, int64_t y_stride) {
  Tile t = MakeTile(w, n0, ahead);
  thread_local std::vector<uint8_t> scratch;
  const size_t scratch_bytes = static_cast<size_t>(a.nb * kScratchPerBlock + 64);
  if (scratch.size() < scratch_bytes) scratch.resize(scratch_bytes);
  t.scratch = scratch.data() + (-reinterpret_cast<uintptr_t>(scratch.data()) & 63);
  t.PlanPrefetch(prefetch_units);
  const __mmask16 mask = static_cast<__mmask16>((1u << t.valid) - 1);
  const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  alignas(64) float acc[kRowChunk * kTile];
  for (int64_t r0 = 0; r0 < m_rows; r0 += kRowChunk) {
    const int64_t r1 = std::min(m_rows, r0 + kRowChunk);
    for (int64_t r = r0; r < r1; ++r) _mm512_store_ps(acc + (r - r0) * kTile, _mm512_setzero_ps());
    kernel(t, a, r0, r1, acc);
    for (int64_t r = r0; r < r1; ++r) {
      __m512 v = _mm512_load_ps(acc + (r - r0) * kTile);
      if (bias != nullptr) v = _mm512_add_ps(v, bv);
      _mm512_mask_storeu_ps(y + r * y_stride + n0, mask, v);
    }
  }
}

}  // namespace

TileRunner Avx512Tiles(const Call& c) {
  const Kernel kernel = KernelFor(c.w.type);
  // Prefetch calls per tile: one per block, Q4_K/Q5_K one per pair of blocks.
  const int64_t prefetch_units =
      (c.w.type == DType::kQ4_K || c.w.type == DType::kQ5_K) ? c.acts.nb / 2 : c.acts.nb;
  const int64_t ahead = PrefetchTilesAhead(c.w.row_bytes);
  return [c, kernel, prefetch_units, ahead](int64_t t0, int64_t t1) {
    // Each tile prefetches `ahead` tiles ahead; start the first ones of this range here.
    const int64_t head_end = std::min(c.w.rows, (t0 + ahead) * kTile) * c.w.row_bytes;
    for (int64_t off = t0 * kTile * c.w.row_bytes; off < head_end; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(c.w.data + off), _MM_HINT_T1);
    }
    for (int64_t t = t0; t < t1; ++t) {
      RunTile(kernel, prefetch_units, ahead, c.w, t * kTile, c.acts, c.m_rows, c.bias, c.y, c.y_stride);
    }
  };
}

}  // namespace dd::kernels::int8

#endif  // DD_INT8_AVX512
