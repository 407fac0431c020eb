// Int8-activation × quantized-weight matrix multiply (the llama.cpp-style fast path).
//
// Each activation row is quantized once per call to int8 blocks of 32 with one f32 scale per
// block. Each output element is then, over the weight's 32-element blocks in ascending order,
//   acc = fma(float(integer dot of weight codes and int8 activations), scale product, acc)
// (Q4_K/Q5_K add one fnmadd per block for the −dmin·m term, Q4_1/Q5_1 one fmadd for +m). The integer dot is exact and the
// float ops per element are one fixed sequence, so a row's result depends only on that row and
// the weights: not on the batch size, the tiling or the thread count (DESIGN §5).
//
// AVX-512 layout. A tile is 16 consecutive weight rows. Each 32-element block of the tile is
// transposed so that 32-bit lane c of eight registers holds four consecutive codes of row c.
// Broadcasting an activation dword against them with VPDPBUSD (unsigned weight codes × signed
// int8 activations) leaves the 16 rows' dots in the 16 lanes: no horizontal reduction, the
// scales are per-lane vectors, and one decode serves every activation row of the call.
// Zero points (Q8_0's sign via +128, Q4_0's 8, Q5_0's 16, Q6_K's 32) are removed by starting the integer
// accumulator at −zero_point·Σ(activation block), precomputed once per row.
//
// The portable fallback (without AVX-512 F/BW/VL/VNNI/BITALG/VBMI2 and F16C) performs the same integer and float
// operations per element, so it gives the same bits, only slower. With AVX2 + FMA it runs
// three ways, all with those bits (dd-bench-matmul --checksum prints the same hashes as the
// portable build): up to kBytePathMaxRows activation rows, Q8_0/Q4_x/Q5_x rows dot straight
// from the weight bytes, 8 weight rows and 2 activation rows per call (RowDotBytes8,
// VPMADDUBSW, one lane per weight row; a tile's last rows one at a time, RowDotBytes), Q4_K
// and Q6_K likewise (RowDotK8; their last rows through DecodeRow and RowDot); other types up
// to kRowPathMaxRows decode a row and dot it (RowDot); more rows decode 8 weight rows into a
// transposed int16 tile once and dot every activation row against it on VPMADDWD (PairTile).

// GCC 12 reports -Wmaybe-uninitialized inside the AVX-512 intrinsics' own _mm512_undefined_*
// pass-through operands (GCC bug 105593, fixed in 13); the pragma covers the header's lines.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dd/kernels/cpu_ops.h"

// DD_INT8_PORTABLE forces the portable fallback (the matmul_int8_portable_test build), so that
// path is compiled with -Werror and tested on AVX-512 machines too.
#if !defined(DD_INT8_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BITALG__) && defined(__AVX512VBMI2__) && defined(__F16C__)
#define DD_INT8_AVX512 1
#else
#define DD_INT8_AVX512 0
#endif
// Without AVX-512 but with AVX2 and FMA (e.g. AMD Zen 2/3), the fallback's dots run 8 weight
// rows at a time on VPMADDWD (PairTile below): the same integer dots and float ops per
// element, so the same bits.
#if !DD_INT8_AVX512 && !defined(DD_INT8_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define DD_INT8_AVX2 1
#else
#define DD_INT8_AVX2 0
#endif

namespace dd::kernels {
namespace {

constexpr int64_t kBlock = 32;
constexpr int kTile = 16;           // weight rows per tile: one 32-bit lane each
constexpr int64_t kRowChunk = 64;   // activation rows whose accumulators stay in L1 per tile
constexpr int64_t kScratchPerBlock = 32;  // a tile's 16 f16 scales per block (Q8_0) or super-block
constexpr float kMinBlockMax = 1e-30f;
// A ParallelFor whose worker sleeps costs 30+ µs on the 2-vCPU development VM (condition
// variable wake-up), one whose worker still spins (~0.3 ms after each job here) a few µs.
// Calls whose estimated single-thread time is below this run on the calling thread. At 200 µs
// every decode matmul of both small models ran on one thread; since decode attention also
// runs on the pool (the worker stays awake through a step) 30 µs measured faster: decode
// tok/s, ddctl generate 4.2K context, 3 alternating rounds, Gemma full 41.6/37.0/43.9 ->
// 45.1/47.3/55.9, dualdecoder 32.7/35.6/38.2 -> 36.7/46.1/38.2; SmolLM2 sparse-cached
// 35.9/31.3/36.5 -> 39.4/31.1/43.1, dualdecoder unchanged. Results are the same bits either
// way.
constexpr double kParallelMinNs = 30e3;
constexpr int64_t kParallelQuantizeElems = 1 << 17;

// Zero point subtracted from the unsigned weight codes the SIMD kernel feeds to VPDPBUSD.
int32_t ZeroPoint(DType t) {
  switch (t) {
    case DType::kQ8_0: return 128;
    case DType::kQ4_0: return 8;
    case DType::kQ5_0: return 16;
    case DType::kQ6_K: return 32;
    default: return 0;
  }
}

// Quantized activation rows. Per row (stride a multiple of 64 bytes):
//   q[k] int8 | d[nb] f32 | xs[nb] f32 = d·Σq (the min terms)
//   | c32[nb] i32 = −zp·Σq over the block | c16[2nb] i32 = −zp·Σq over each 16-element half.
struct QuantActs {
  uint8_t* base = nullptr;
  int64_t stride = 0, k = 0, nb = 0;

  static int64_t Stride(int64_t k) { return (k + 4 * (k / kBlock) * 5 + 63) / 64 * 64; }
  int8_t* q(int64_t r) const { return reinterpret_cast<int8_t*>(base + r * stride); }
  float* d(int64_t r) const { return reinterpret_cast<float*>(base + r * stride + k); }
  float* xs(int64_t r) const { return d(r) + nb; }
  int32_t* c32(int64_t r) const { return reinterpret_cast<int32_t*>(xs(r) + nb); }
  int32_t* c16(int64_t r) const { return c32(r) + nb; }
};

void QuantizeActRow(const float* x, DType t, const QuantActs& a, int64_t r) {
  int8_t* q = a.q(r);
  float* d = a.d(r);
  QuantizeRowInt8Blocks(x, a.k, q, d);
  const int32_t zp = ZeroPoint(t);
  for (int64_t b = 0; b < a.nb; ++b) {
    int32_t lo = 0, hi = 0;
    for (int i = 0; i < 16; ++i) {
      lo += q[b * kBlock + i];
      hi += q[b * kBlock + 16 + i];
    }
    a.c16(r)[2 * b] = -zp * lo;
    a.c16(r)[2 * b + 1] = -zp * hi;
    a.c32(r)[b] = -zp * (lo + hi);
    a.xs(r)[b] = d[b] * static_cast<float>(lo + hi);
  }
}

#if DD_INT8_AVX512

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

#else  // portable fallback: same arithmetic per element, one weight row at a time

// Types whose blocks carry an additive min: x = d·q + m (Q4_1, Q5_1) or d·sc·q − dmin·mn (K).
bool HasMin(DType t) {
  return t == DType::kQ4_1 || t == DType::kQ5_1 || t == DType::kQ4_K || t == DType::kQ5_K;
}

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One weight row as signed integer codes plus per-32-block float factors:
//   scale[b]: d (Q8_0, Q4_x, Q5_x, Q6_K) or d·sc_j (Q4_K, Q5_K); minscale[b]: m (Q4_1, Q5_1) or
//   −dmin·m_j (Q4_K, Q5_K: negating is exact, so fma(−a, b, c) gives fnmadd's bits);
//   sc16[2b], sc16[2b+1]: Q6_K's int8 scales of the two halves.
struct DecodedRow {
  std::vector<int32_t> code, sc16;
  std::vector<float> scale, minscale;
};

void ScaleMinK(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

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

#if DD_INT8_AVX2
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
    const auto add_row = [&](int m, __m256i h0, __m256i h1, __m256i h2, __m256i h3) {
      // [rows 0-3 | rows 0-3] and [rows 4-7 | rows 4-7], halves of each row's sum in each lane.
      const __m256i p0123 = quad(h0, h1), p4567 = quad(h2, h3);
      __m256i dot = _mm256_add_epi32(_mm256_permute2x128_si256(p0123, p4567, 0x20),
                                     _mm256_permute2x128_si256(p0123, p4567, 0x31));
      if constexpr (zp) dot = _mm256_add_epi32(dot, _mm256_set1_epi32(a.c32(r + m)[b]));
      const __m256 sd = _mm256_mul_ps(scales, _mm256_set1_ps(a.d(r + m)[b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, acc[m]);
      if constexpr (has_min) acc[m] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.xs(r + m)[b]), acc[m]);
    };
    if constexpr (narrow && M > 4) {
      // The eight rows' codes stay in registers while each activation row runs against them
      // (at M <= 4 the order below stays: Q5_0 m = 1-2 ran 1.1-1.2× slower in this one).
      __m256i w[8];
      for (int i = 0; i < 8; ++i) w[i] = BlockCodes<t>(src + i * row_bytes);
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q(r + m) + b * kBlock));
        add_row(m, pair(w[0], w[1], x), pair(w[2], w[3], x), pair(w[4], w[5], x), pair(w[6], w[7], x));
      }
    } else {
      // The activation rows loaded first, each weight pair against all of them. Q8_0 (two
      // VPSIGNB per product) always: in the order above it ran up to 1.4× slower at M = 8.
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

// Activation rows per RowDotBytes8 / RowDotK8 call: each weight block's decode and scale
// loads are shared by this many (decisions.md, "Eight activation rows per decode call"). 8
// beat 4 at m = 8 (a dual step at batch 4) for the 4-6-bit types: dd-bench-matmul cold, one
// thread, median of 3 alternating runs, 8 vs 4: Q5_0 2048×640 0.77-0.90, Q4_K 640×1024 0.90,
// Q6_K 640×2048 0.90, Q4_1 1536×576 0.78-0.85. Q8_0 keeps 4 (its products need two VPSIGNB
// each, and 8 in one call ran up to 1.4× slower). Each instantiation stays out of line:
// inlined together into the dispatch, Q6_K's m = 1 and 2 ran 1.4-1.7× slower.
constexpr int kBytes8Rows = 8;
constexpr int RowsPerCall(DType t) { return t == DType::kQ8_0 ? 4 : kBytes8Rows; }
// Octets of weight rows the byte path prefetches ahead: 2 beat 1 and 4 on this AMD EPYC
// (dd-bench-matmul cold rows, alternating runs).
constexpr int64_t kBytePathAhead = 2;

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
      // As RowDotBytes8Of; Q4_K's nibbles stay int16 for 8 products, Q6_K's 6-bit codes widen
      // after 2 (2 · 63 · 128 < 2^15) and keep each row's two halves apart (lanes 0-3 | 4-7).
      __m256i w[8];
      for (int i = 0; i < 8; ++i) w[i] = KBlockCodes<t>(base + i * row_bytes, j);
      const __m256 sj = _mm256_load_ps(scale[j]);
      for (int m = 0; m < M; ++m) {
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
        const __m256i lo = _mm256_permute2x128_si256(p0123, p4567, 0x20);
        const __m256i hi = _mm256_permute2x128_si256(p0123, p4567, 0x31);
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
#endif  // DD_INT8_AVX2

#endif  // DD_INT8_AVX512

}  // namespace

void QuantizeRowInt8Blocks(const float* x, int64_t k, int8_t* q, float* d) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
#if DD_INT8_AVX512
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    // Below kMinBlockMax, 127 / amax could overflow: such blocks quantize to zero.
    const bool zero = !(amax >= kMinBlockMax);
    const float id = zero ? 0.0f : 127.0f / amax;
    d[b] = zero ? 0.0f : amax / 127.0f;
#if DD_INT8_AVX512
    // VCVTPS2DQ rounds half to even under the default MXCSR, like nearbyint below.
    const __m512 vid = _mm512_set1_ps(id);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
#else
    for (int i = 0; i < kBlock; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
#endif
  }
}

bool MatMulInt8Supports(DType t) {
  switch (t) {
    case DType::kQ8_0:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ5_1:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K: return true;
    default: return false;
  }
}

void MatMulInt8(const WeightView& w, const float* x, int64_t m_rows, int64_t x_stride, const float* bias,
                float* y, int64_t y_stride, ThreadPool& pool) {
  if (!MatMulInt8Supports(w.type)) {
    MatMul(w, x, m_rows, x_stride, bias, y, y_stride, pool);
    return;
  }
  if (m_rows <= 0 || w.rows <= 0) return;

  // Quantize the activations once per call. The buffer belongs to the calling thread; workers
  // only read it through `acts` while this call blocks in ParallelFor.
  thread_local std::vector<uint8_t> act_buf;
  QuantActs acts;
  acts.k = w.cols;
  acts.nb = w.cols / kBlock;
  acts.stride = QuantActs::Stride(w.cols);
  if (act_buf.size() < static_cast<size_t>(m_rows * acts.stride + 64)) act_buf.resize(m_rows * acts.stride + 64);
  acts.base = act_buf.data() + (-reinterpret_cast<uintptr_t>(act_buf.data()) & 63);
  const DType type = w.type;
  auto quantize = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) QuantizeActRow(x + r * x_stride, type, acts, r);
  };
  if (pool.active() > 1 && m_rows > 1 && m_rows * w.cols >= kParallelQuantizeElems) {
    pool.ParallelFor(m_rows, quantize);
  } else {
    quantize(0, m_rows);
  }

  const int64_t n_tiles = (w.rows + kTile - 1) / kTile;
#if DD_INT8_AVX512
  const Kernel kernel = KernelFor(type);
  // Prefetch calls per tile: one per block, Q4_K/Q5_K one per pair of blocks.
  const int64_t prefetch_units = (type == DType::kQ4_K || type == DType::kQ5_K) ? acts.nb / 2 : acts.nb;
  const int64_t ahead = PrefetchTilesAhead(w.row_bytes);
  auto run_tiles = [&](int64_t t0, int64_t t1) {
    // Each tile prefetches `ahead` tiles ahead; start the first ones of this range here.
    const int64_t head_end = std::min(w.rows, (t0 + ahead) * kTile) * w.row_bytes;
    for (int64_t off = t0 * kTile * w.row_bytes; off < head_end; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w.data + off), _MM_HINT_T1);
    }
    for (int64_t t = t0; t < t1; ++t) {
      RunTile(kernel, prefetch_units, ahead, w, t * kTile, acts, m_rows, bias, y, y_stride);
    }
  };
#elif DD_INT8_AVX2
  // Few activation rows: a transpose would not pay for itself; one weight row at a time.
  const bool bytes = HasBytePath(type), kbytes = HasKBytePath(type);
  const int64_t per_call = RowsPerCall(type);  // activation rows per RowDotBytes8 / RowDotK8 call
  const bool by_row = m_rows <= (bytes || kbytes ? kBytePathMaxRows : kRowPathMaxRows);
  // Otherwise every row's int16 activation pairs, once per call (read by the workers like `acts`).
  thread_local std::vector<int32_t> pair_buf;
  if (!by_row) {
    pair_buf.resize(m_rows * (w.cols / 2));
    for (int64_t r = 0; r < m_rows; ++r) PackActPairs(acts, r, pair_buf.data() + r * (w.cols / 2));
  }
  const int32_t* act_pairs = pair_buf.data();
  auto run_tiles = [&](int64_t t0, int64_t t1) {
    thread_local DecodedRow row;
    thread_local PairTile pt;
    const int64_t n_end = std::min(w.rows, t1 * kTile);
    if (by_row) {
      int64_t n = t0 * kTile;
      if (bytes || kbytes) {  // 8 weight rows at a time, each activation row against them
        for (; n + 8 <= n_end; n += 8) {
          // Decode streams every weight from DRAM once per step (a model's layers exceed the
          // LLC): ask for the eight rows kBytePathAhead octets ahead while these compute.
          if (const int64_t next = n + 8 * kBytePathAhead; next + 8 <= w.rows) {
            const uint8_t* p = w.data + next * w.row_bytes;
            for (int64_t off = 0; off < 8 * w.row_bytes; off += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
            }
          }
          for (int64_t r = 0; r < m_rows; r += per_call) {
            const int rows = static_cast<int>(std::min<int64_t>(per_call, m_rows - r));
            float v[8 * kBytes8Rows];
            if (bytes) {
              RowDotBytes8(type, rows, w.data + n * w.row_bytes, w.row_bytes, acts, r, v);
            } else {
              RowDotK8(type, rows, w.data + n * w.row_bytes, w.row_bytes, acts, r, v);
            }
            for (int m = 0; m < rows; ++m) {
              for (int i = 0; i < 8; ++i) {
                y[(r + m) * y_stride + n + i] = bias != nullptr ? v[8 * m + i] + bias[n + i] : v[8 * m + i];
              }
            }
          }
        }
      }
      for (; n < n_end; ++n) {
        const uint8_t* src = w.data + n * w.row_bytes;
        if (!bytes) DecodeRow(type, src, w.cols, &row);
        for (int64_t r = 0; r < m_rows; ++r) {
          const float v = bytes ? RowDotBytes(type, src, acts, r) : RowDot(type, row, acts, r);
          y[r * y_stride + n] = bias != nullptr ? v + bias[n] : v;
        }
      }
      return;
    }
    for (int64_t n0 = t0 * kTile; n0 < n_end; n0 += kPairRows) {
      const int valid = static_cast<int>(std::min<int64_t>(kPairRows, w.rows - n0));
      BuildPairTile(type, w, n0, valid, &row, &pt);
      PairTileRows(type, pt, acts, act_pairs, m_rows, n0, valid, bias, y, y_stride);
    }
  };
#else
  auto run_tiles = [&](int64_t t0, int64_t t1) {
    thread_local DecodedRow row;
    for (int64_t n = t0 * kTile; n < std::min(w.rows, t1 * kTile); ++n) {
      DecodeRow(type, w.data + n * w.row_bytes, w.cols, &row);
      for (int64_t r = 0; r < m_rows; ++r) {
        const float v = RowDot(type, row, acts, r);
        y[r * y_stride + n] = bias != nullptr ? v + bias[n] : v;
      }
    }
  };
#endif
  // Rough single-thread time: streaming the weights at ~15 GB/s plus ~100 G int8 MAC/s.
  const double single_thread_ns =
      static_cast<double>(w.rows * w.row_bytes) / 15.0 + static_cast<double>(m_rows) * w.rows * w.cols / 100.0;
  if (pool.active() > 1 && single_thread_ns >= kParallelMinNs) {
    pool.ParallelFor(n_tiles, run_tiles);
  } else {
    run_tiles(0, n_tiles);
  }
}

}  // namespace dd::kernels
