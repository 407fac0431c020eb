// Internals of MatMulInt8 shared by its files (matmul_int8.cc states the contract): which
// path this build compiles, the quantized activation rows, and each path's tile runner.
//   matmul_int8.cc          activation quantization and the dispatch
//   matmul_int8_avx512.cc   16-row tiles on VPDPBUSD
//   matmul_int8_avx2.cc     rows from the weight bytes (RowDotBytes8, RowDotK8) and PairTile
//   matmul_int8_rows.cc     the portable fallback: DecodeRow and RowDot
#pragma once

// GCC 12 reports -Wmaybe-uninitialized inside the AVX-512 intrinsics' own _mm512_undefined_*
// pass-through operands (GCC bug 105593, fixed in 13); the pragma covers the header's lines.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <cstring>
#include <functional>
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
// rows at a time on VPMADDWD (PairTile in matmul_int8_avx2.cc): the same integer dots and float ops per
// element, so the same bits.
#if !DD_INT8_AVX512 && !defined(DD_INT8_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#define DD_INT8_AVX2 1
#else
#define DD_INT8_AVX2 0
#endif

namespace dd::kernels::int8 {

constexpr int64_t kBlock = 32;
constexpr int kTile = 16;  // weight rows per unit of MatMulInt8's ParallelFor (AVX-512: one lane each)

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

inline uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_K/Q5_K: sub-block j's 6-bit scale and min from the super-block's 12 scale bytes q.
inline void ScaleMinK(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One MatMulInt8 call: weights, quantized activation rows and output, read by every worker.
struct Call {
  WeightView w;
  QuantActs acts;
  int64_t m_rows = 0;
  const float* bias = nullptr;
  float* y = nullptr;
  int64_t y_stride = 0;
};

// Writes y's columns [t0·kTile, t1·kTile) for every activation row. Made on the calling thread
// (per-call buffers), then run on any of the pool's threads.
using TileRunner = std::function<void(int64_t t0, int64_t t1)>;

#if DD_INT8_AVX512
TileRunner Avx512Tiles(const Call& c);
#else
// Types whose blocks carry an additive min: x = d·q + m (Q4_1, Q5_1) or d·sc·q − dmin·mn (K).
inline bool HasMin(DType t) {
  return t == DType::kQ4_1 || t == DType::kQ5_1 || t == DType::kQ4_K || t == DType::kQ5_K;
}

// One weight row as signed integer codes plus per-32-block float factors:
//   scale[b]: d (Q8_0, Q4_x, Q5_x, Q6_K) or d·sc_j (Q4_K, Q5_K); minscale[b]: m (Q4_1, Q5_1) or
//   −dmin·m_j (Q4_K, Q5_K: negating is exact, so fma(−a, b, c) gives fnmadd's bits);
//   sc16[2b], sc16[2b+1]: Q6_K's int8 scales of the two halves.
struct DecodedRow {
  std::vector<int32_t> code, sc16;
  std::vector<float> scale, minscale;
};
void DecodeRow(DType t, const uint8_t* src, int64_t k, DecodedRow* out);
// Weight row w · activation row r: the reference arithmetic every path reproduces.
float RowDot(DType t, const DecodedRow& w, const QuantActs& a, int64_t r);
#if DD_INT8_AVX2
TileRunner Avx2Tiles(const Call& c);
#else
TileRunner PortableTiles(const Call& c);
#endif
#endif

}  // namespace dd::kernels::int8
