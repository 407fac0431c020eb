// Register-blocked attention kernels: query·key scores and the probability-weighted sum of
// values, for blocks of queries against keys given by pointer. Keys and values are f32 or f16
// (KvDtype): f16 elements are widened to f32 as they are loaded, so every kernel below gives,
// for f16 rows, the bits it gives for the widened rows.
//
// Both give the bits of the one-pair-at-a-time reference (Dot, Axpy) that every other
// attention path uses, so a cache may switch between them freely:
// - A score is one 16-lane accumulator walked over the head dimension, reduced by the lane
//   tree l[i] += l[i + w] for w = 8, 4, 2, 1, then the scalar tail — Dot's order. With AVX2
//   (AVX-512 machines included) pairs of queries and keys run in 8-float halves (Scores2x2);
//   elsewhere the generic 4×4 kernel reduces its 16 accumulators together: each tree level is
//   one vector add of two shuffles, pairing exactly the lanes the scalar tree pairs (15 adds per
//   16 scores instead of 15 per score, which dominated at head_dim 64).
// - A weighted sum adds p_j·v_j into a zeroed output for ascending j, element by element as
//   Axpy does; the output block stays in registers across keys instead of going to memory
//   once per key.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dd/kernels/cpu_ops.h"
#include "dd/kernels/dtype.h"

namespace dd::kernels {
namespace {

typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int kLanes = 16;

inline V16 Load(const float* p) { return *reinterpret_cast<const V16*>(p); }
inline void Store(float* p, V16 v) { *reinterpret_cast<V16*>(p) = v; }

// KV elements are float or uint16_t (f16 bits, KvDtype::kF16): widened to f32 exactly on load,
// so an f16 kernel gives the f32 kernel's bits on the widened rows.
inline float Widen(float x) { return x; }
inline float Widen(uint16_t h) { return F16ToF32(h); }
// (The generic kernels run on CPUs without AVX2; F16ToF32 uses F16C where the build has it.)
inline V16 Load(const uint16_t* p) {
  float w[kLanes];
  for (int i = 0; i < kLanes; ++i) w[i] = F16ToF32(p[i]);
  V16 r;
  std::memcpy(&r, w, sizeof(r));
  return r;
}
// Row j of a pointer list as elements of T (lists hold typed or untyped pointers).
template <typename T, typename P>
inline const T* RowOf(const P* list, int64_t j) {
  return static_cast<const T*>(list[j]);
}
// Dot(key, q) with the key widened first (the scalar path for head sizes not a multiple of 16).
inline float DotKey(const float* k, const float* q, int64_t hd) { return Dot(k, q, hd); }
inline float DotKey(const uint16_t* k, const float* q, int64_t hd) {
  thread_local std::vector<float> w;
  w.resize(hd);
  for (int64_t e = 0; e < hd; ++e) w[e] = F16ToF32(k[e]);
  return Dot(w.data(), q, hd);
}

// One tree level for two accumulators: first + second halves of each w-lane group, packed
// (__builtin_shufflevector: constant lane indices, GCC >= 12 and clang alike).
// w = 8: [a0..7 | b0..7] + [a8..15 | b8..15]; lanes 8t..8t+7 belong to a (t = 0) or b (t = 1).
inline V16 Level8(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
// w = 4 on two Level8 outputs (pairs p, p+1 | p+2, p+3): lanes 4t..4t+3 belong to pair p+t.
inline V16 Level4(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
// w = 2 on two Level4 outputs (pairs p..p+3 | p+4..p+7): lanes 2t, 2t+1 belong to pair p+t.
inline V16 Level2(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
// w = 1 on two Level2 outputs (pairs 0..7 | 8..15): lane t belongs to pair t.
inline V16 Level1(V16 a, V16 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// acc[k] for k = 0..15 → lane k holds the tree reduction of acc[k].
inline V16 ReduceSixteen(const V16 (&acc)[16]) {
  V16 l1[8];
  for (int m = 0; m < 8; ++m) l1[m] = Level8(acc[2 * m], acc[2 * m + 1]);
  V16 l2[4];
  for (int m = 0; m < 4; ++m) l2[m] = Level4(l1[2 * m], l1[2 * m + 1]);
  return Level1(Level2(l2[0], l2[1]), Level2(l2[2], l2[3]));
}

// Scores of 4 queries × 4 keys; out[4 * i + c] = Dot(q_i, key_c) bit for bit. hd is a
// multiple of 16 (other sizes go pair by pair through Dot, whose scalar tail the compiler may
// contract differently here).
template <typename T, typename P>
inline void Scores4x4(const float* q, int64_t hd, const P* keys, float out[16]) {
  V16 acc[16] = {};
  for (int64_t e = 0; e < hd; e += kLanes) {
    const V16 k0 = Load(RowOf<T>(keys, 0) + e), k1 = Load(RowOf<T>(keys, 1) + e);
    const V16 k2 = Load(RowOf<T>(keys, 2) + e), k3 = Load(RowOf<T>(keys, 3) + e);
    for (int i = 0; i < 4; ++i) {
      const V16 qv = Load(q + i * hd + e);
      acc[4 * i + 0] += k0 * qv;
      acc[4 * i + 1] += k1 * qv;
      acc[4 * i + 2] += k2 * qv;
      acc[4 * i + 3] += k3 * qv;
    }
  }
  Store(out, ReduceSixteen(acc));
}

// Keys and values come from blocks scattered over a resident set larger than the last-level
// cache; a pass's first sweep over a tile asks for the rows kPrefetchRows ahead, lines [e0, e1)
// (a hint only: no bits change).
constexpr int64_t kPrefetchRows = 16;
template <typename T>
inline void PrefetchRow(const T* row, int64_t e0, int64_t e1) {
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int64_t e = e0; e < e1; e += kLine) _mm_prefetch(reinterpret_cast<const char*>(row + e), _MM_HINT_T0);
}
// What a weighted-sum sweep prefetches: rows below nk (none when nk = 0), elements [e0, e1).
struct Ahead {
  int64_t nk = 0, e0 = 0, e1 = 0;
};

// The AVX2 kernels below also serve AVX-512 machines: on an AMD EPYC Zen 4 they decoded
// faster than the 16-lane generic kernels (SmolLM2 full mode at 8000 tokens, alternating
// binaries: batch 1 1.14-1.32x, batch 8 1.19x; Gemma at 4096 not slower). Same bits.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DD_ATTENTION_AVX2 1
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Four 16-lane accumulators, each as halves lo[p] (lanes 0-7) and hi[p] (8-15), reduced by
// Dot's tree (lane i += lane i + w for w = 8, 4, 2, 1) together: out[p] is accumulator p's sum.
inline void ReduceFour(const __m256 (&lo)[4], const __m256 (&hi)[4], float out[4]) {
  // w = 8: one 8-lane vector per accumulator.
  const __m256 a = _mm256_add_ps(lo[0], hi[0]), b = _mm256_add_ps(lo[1], hi[1]);
  const __m256 c = _mm256_add_ps(lo[2], hi[2]), d = _mm256_add_ps(lo[3], hi[3]);
  // w = 4: [a 0-3 | b 0-3] and [c | d].
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // w = 2: per 128-bit half, [a 0-1, c 0-1 | b 0-1, d 0-1].
  const __m256 t2 = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // w = 1: [a, c, a, c | b, d, b, d].
  const __m256 t1 = _mm256_add_ps(_mm256_shuffle_ps(t2, t2, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm256_shuffle_ps(t2, t2, _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(32) float r[8];
  _mm256_store_ps(r, t1);
  out[0] = r[0];
  out[1] = r[4];
  out[2] = r[1];
  out[3] = r[5];
}

// Scores of 2 queries × 2 keys in AVX2 registers, out[2 * i + c] = Dot(q_i, key_c) bit for
// bit: each pair's 16-lane accumulator is two 8-float halves (lanes 0-7, 8-15), fused
// multiply-added over the head dimension like Dot's, then reduced by the same tree (lane i +=
// lane i + w for w = 8, 4, 2, 1) for the 4 pairs together. Scores4x4's 16 accumulators
// would take 32 of AVX2's 16 registers.
template <typename T, typename P>
inline void Scores2x2(const float* q, int64_t hd, const P* keys, float out[4]) {
  const T* key0 = RowOf<T>(keys, 0);
  const T* key1 = RowOf<T>(keys, 1);
  __m256 lo[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 hi[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t e = 0; e < hd; e += kLanes) {
    const __m256 k0l = Load8(key0 + e), k0h = Load8(key0 + e + 8);
    const __m256 k1l = Load8(key1 + e), k1h = Load8(key1 + e + 8);
    for (int i = 0; i < 2; ++i) {
      const __m256 ql = _mm256_loadu_ps(q + i * hd + e), qh = _mm256_loadu_ps(q + i * hd + e + 8);
      lo[2 * i] = _mm256_fmadd_ps(k0l, ql, lo[2 * i]);
      hi[2 * i] = _mm256_fmadd_ps(k0h, qh, hi[2 * i]);
      lo[2 * i + 1] = _mm256_fmadd_ps(k1l, ql, lo[2 * i + 1]);
      hi[2 * i + 1] = _mm256_fmadd_ps(k1h, qh, hi[2 * i + 1]);
    }
  }
  ReduceFour(lo, hi, out);
}

// Scores of 1 query × 4 keys, out[c] = Dot(q, key_c) bit for bit (Scores2x2's accumulators and
// tree, for a group's odd last query).
template <typename T, typename P>
inline void Scores1x4(const float* q, int64_t hd, const P* keys, float out[4]) {
  __m256 lo[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 hi[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t e = 0; e < hd; e += kLanes) {
    const __m256 ql = _mm256_loadu_ps(q + e), qh = _mm256_loadu_ps(q + e + 8);
    for (int c = 0; c < 4; ++c) {
      lo[c] = _mm256_fmadd_ps(Load8(RowOf<T>(keys, c) + e), ql, lo[c]);
      hi[c] = _mm256_fmadd_ps(Load8(RowOf<T>(keys, c) + e + 8), qh, hi[c]);
    }
  }
  ReduceFour(lo, hi, out);
}

#else
#define DD_ATTENTION_AVX2 0
#endif

// One vector (16 output elements, starting at `e`) of 4 queries, over keys [j0, j1), continuing
// the sums already in `outs` unless `first` (then from zero). A float stored and reloaded keeps
// its bits, so splitting the keys into tiles changes nothing.
template <typename T, typename P>
inline void WeightedSum4(const float* const* p, int nq, const P* values, int64_t j0, int64_t j1, int64_t e,
                         float* const* outs, bool first, const Ahead& ahead = {}) {
  V16 acc[4] = {};
  if (!first) {
    for (int i = 0; i < 4; ++i) acc[i] = Load(outs[i] + e);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kPrefetchRows < ahead.nk) PrefetchRow(RowOf<T>(values, j + kPrefetchRows), ahead.e0, ahead.e1);
    const V16 v = Load(RowOf<T>(values, j) + e);
    for (int i = 0; i < 4; ++i) acc[i] += (V16{} + p[i][j]) * v;
  }
  for (int i = 0; i < nq; ++i) Store(outs[i] + e, acc[i]);
}

#if DD_ATTENTION_AVX2

// WeightedSum4 in AVX2 registers for NQ queries: NQ × 16 outputs as two 8-float halves
// each, one fused multiply-add per key and element in ascending key order (same bits). GCC
// lowers the 16-float generic vectors above to stack traffic on AVX2 (40% of a prefill in
// perf). Up to 6 queries fit (12 accumulators, 2 value halves, 1 broadcast), so a group of 3
// (SmolLM2's decode) or 6 (its dual step) runs unpadded.
template <int NQ, typename T, typename P>
inline void WeightedSumAvx2(const float* const* p, const P* values, int64_t j0, int64_t j1, int64_t e,
                            float* const* outs, bool first, const Ahead& ahead) {
  __m256 lo[NQ], hi[NQ];
  for (int i = 0; i < NQ; ++i) {
    lo[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(outs[i] + e);
    hi[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(outs[i] + e + 8);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kPrefetchRows < ahead.nk) PrefetchRow(RowOf<T>(values, j + kPrefetchRows), ahead.e0, ahead.e1);
    const T* row = RowOf<T>(values, j);
    const __m256 vl = Load8(row + e), vh = Load8(row + e + 8);
    for (int i = 0; i < NQ; ++i) {
      const __m256 pb = _mm256_broadcast_ss(p[i] + j);
      lo[i] = _mm256_fmadd_ps(pb, vl, lo[i]);
      hi[i] = _mm256_fmadd_ps(pb, vh, hi[i]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    _mm256_storeu_ps(outs[i] + e, lo[i]);
    _mm256_storeu_ps(outs[i] + e + 8, hi[i]);
  }
}

template <typename T, typename P>
inline void WeightedSumAvx2(int nq, const float* const* p, const P* values, int64_t j0, int64_t j1, int64_t e,
                            float* const* outs, bool first, const Ahead& ahead) {
  switch (nq) {
    case 1: return WeightedSumAvx2<1, T>(p, values, j0, j1, e, outs, first, ahead);
    case 2: return WeightedSumAvx2<2, T>(p, values, j0, j1, e, outs, first, ahead);
    case 3: return WeightedSumAvx2<3, T>(p, values, j0, j1, e, outs, first, ahead);
    case 4: return WeightedSumAvx2<4, T>(p, values, j0, j1, e, outs, first, ahead);
    case 5: return WeightedSumAvx2<5, T>(p, values, j0, j1, e, outs, first, ahead);
    default: return WeightedSumAvx2<6, T>(p, values, j0, j1, e, outs, first, ahead);
  }
}
constexpr int kSumQueries = 6;  // queries per weighted-sum block
#else
constexpr int kSumQueries = 4;
#endif

// Keys per tile: ~32 KiB of keys or values, reused from L1/L2 by every query quad.
inline int64_t KeyTile(int64_t hd) { return std::max<int64_t>(4, (8192 / std::max<int64_t>(hd, 16)) / 4 * 4); }

template <typename T, typename P>
void Scores(const float* q, int64_t nq, int64_t hd, const P* keys, int64_t nk, float* s, int64_t ld) {
  if (hd % kLanes != 0) {  // pair by pair (see Scores4x4)
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < nk; ++j) s[i * ld + j] = DotKey(RowOf<T>(keys, j), q + i * hd, hd);
    return;
  }
#if DD_ATTENTION_AVX2
  // Pairs of queries × pairs of keys (Scores2x2); an odd last query 4 keys at a time
  // (Scores1x4), the keys left over through Dot.
  const int64_t nq2 = nq / 2 * 2, nk2 = nk / 2 * 2;
  const int64_t tile2 = KeyTile(hd);
  for (int64_t jt = 0; jt < nk2; jt += tile2) {
    const int64_t je = std::min(nk2, jt + tile2);
    for (int64_t i = 0; i < nq2; i += 2) {
      for (int64_t j = jt; j < je; j += 2) {
        if (i == 0 && j + 1 + kPrefetchRows < nk) {
          PrefetchRow(RowOf<T>(keys, j + kPrefetchRows), 0, hd);
          PrefetchRow(RowOf<T>(keys, j + 1 + kPrefetchRows), 0, hd);
        }
        float out[4];
        Scores2x2<T>(q + i * hd, hd, keys + j, out);
        s[i * ld + j] = out[0];
        s[i * ld + j + 1] = out[1];
        s[(i + 1) * ld + j] = out[2];
        s[(i + 1) * ld + j + 1] = out[3];
      }
    }
  }
  if (nq2 < nq) {  // the odd last query: 4 keys at a time
    const int64_t nk4 = nk / 4 * 4;
    for (int64_t j = 0; j < nk4; j += 4) {
      if (nq2 == 0 && j + 3 + kPrefetchRows < nk) {
        for (int c = 0; c < 4; ++c) PrefetchRow(RowOf<T>(keys, j + c + kPrefetchRows), 0, hd);
      }
      Scores1x4<T>(q + nq2 * hd, hd, keys + j, s + nq2 * ld + j);
    }
    for (int64_t j = nk4; j < nk; ++j) s[nq2 * ld + j] = DotKey(RowOf<T>(keys, j), q + nq2 * hd, hd);
  }
  for (int64_t i = 0; i < nq2; ++i) {
    for (int64_t j = nk2; j < nk; ++j) s[i * ld + j] = DotKey(RowOf<T>(keys, j), q + i * hd, hd);
  }
  return;
#endif
  // A last partial quad of queries runs padded with copies of its last query (stored once).
  thread_local std::vector<float> pad;
  const int64_t n_quads = (nq + 3) / 4, rem = nq % 4;
  if (rem != 0) {
    pad.resize(4 * hd);
    for (int r = 0; r < 4; ++r)
      std::memcpy(&pad[r * hd], q + (nq - rem + std::min<int64_t>(r, rem - 1)) * hd, hd * sizeof(float));
  }
  const int64_t tile = KeyTile(hd);
  const int64_t nk4 = nk / 4 * 4;
  for (int64_t jt = 0; jt < nk4; jt += tile) {
    const int64_t je = std::min(nk4, jt + tile);
    for (int64_t quad = 0; quad < n_quads; ++quad) {
      const int64_t i = 4 * quad;
      const bool partial = rem != 0 && quad == n_quads - 1;
      const float* qq = partial ? pad.data() : q + i * hd;
      const int rows = partial ? static_cast<int>(rem) : 4;
      for (int64_t j = jt; j < je; j += 4) {
        if (quad == 0 && j + 3 + kPrefetchRows < nk) {  // scattered keys: ask ahead, as on AVX2
          for (int c = 0; c < 4; ++c) PrefetchRow(RowOf<T>(keys, j + c + kPrefetchRows), 0, hd);
        }
        float out[16];
        Scores4x4<T>(qq, hd, keys + j, out);
        for (int r = 0; r < rows; ++r) std::memcpy(s + (i + r) * ld + j, out + 4 * r, 4 * sizeof(float));
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t j = nk4; j < nk; ++j) s[i * ld + j] = DotKey(RowOf<T>(keys, j), q + i * hd, hd);
}

template <typename T, typename P>
void WeightedSum(const float* p, int64_t ld, int64_t nq, const P* values, int64_t nk, int64_t e0, int64_t e1,
                 float* const* outs) {
  const int64_t tile = KeyTile(e1 - e0);
  for (int64_t jt = 0; jt < nk || jt == 0; jt += tile) {  // tile outer: values reused by every block
    const int64_t je = std::min(nk, jt + tile);
    const bool first = jt == 0;
    // Blocks of at most kSumQueries, sizes balanced (8 queries: 4 + 4, not 6 + 2).
    const int64_t n_blocks = (nq + kSumQueries - 1) / kSumQueries;
    for (int64_t b = 0, i = 0; b < n_blocks; ++b) {
      const int n = static_cast<int>((nq - i + (n_blocks - b) - 1) / (n_blocks - b));
      // A partial block of queries repeats its last one (same bits, stored once); the AVX2
      // kernel runs just the n.
      const float* pr[kSumQueries];
      float* o[kSumQueries];
      for (int r = 0; r < kSumQueries; ++r) {
        pr[r] = p + (i + std::min(r, n - 1)) * ld;
        o[r] = outs[i + std::min(r, n - 1)];
      }
      int64_t e = e0;
      for (; e + kLanes <= e1; e += kLanes) {
        // The first sweep over the tile fetches the whole rows' slice ahead of use.
        const Ahead ahead = b == 0 && e == e0 ? Ahead{nk, e0, e1} : Ahead{};
#if DD_ATTENTION_AVX2
        WeightedSumAvx2<T>(n, pr, values, jt, je, e, o, first, ahead);
#else
        WeightedSum4<T>(pr, n, values, jt, je, e, o, first, ahead);
#endif
      }
      for (; e < e1; ++e) {  // scalar tail, same per-element order
        for (int r = 0; r < n; ++r) {
          float a = first ? 0.0f : o[r][e];
          // One fused multiply-add per key, as Axpy's contracted loop does. Written out: GCC
          // may otherwise vectorize the products and add them one by one (seen on AVX2).
          for (int64_t j = jt; j < je; ++j) {
#if defined(__FMA__)
            a = std::fma(pr[r][j], Widen(RowOf<T>(values, j)[e]), a);
#else
            a += pr[r][j] * Widen(RowOf<T>(values, j)[e]);
#endif
          }
          o[r][e] = a;
        }
      }
      i += n;
    }
  }
}

}  // namespace

void AttentionScores(const float* q, int64_t nq, int64_t hd, const float* const* keys, int64_t nk, float* s,
                     int64_t ld) {
  Scores<float>(q, nq, hd, keys, nk, s, ld);
}

void AttentionScores(const float* q, int64_t nq, int64_t hd, const void* const* keys, KvDtype t, int64_t nk, float* s,
                     int64_t ld) {
  if (t == KvDtype::kF16) return Scores<uint16_t>(q, nq, hd, keys, nk, s, ld);
  Scores<float>(q, nq, hd, keys, nk, s, ld);
}

void AttentionWeightedSum(const float* p, int64_t ld, int64_t nq, const float* const* values, int64_t nk,
                          int64_t e0, int64_t e1, float* const* outs) {
  WeightedSum<float>(p, ld, nq, values, nk, e0, e1, outs);
}

void AttentionWeightedSum(const float* p, int64_t ld, int64_t nq, const void* const* values, KvDtype t, int64_t nk,
                          int64_t e0, int64_t e1, float* const* outs) {
  if (t == KvDtype::kF16) return WeightedSum<uint16_t>(p, ld, nq, values, nk, e0, e1, outs);
  WeightedSum<float>(p, ld, nq, values, nk, e0, e1, outs);
}

}  // namespace dd::kernels
