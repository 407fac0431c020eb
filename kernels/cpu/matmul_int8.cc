// Int8-activation × quantized-weight matrix multiply (the llama.cpp-style fast path).
//
// Each activation row is quantized once per call to int8 blocks of 32 with one f32 scale per
// block. Each output element is then, over the weight's 32-element blocks in ascending order,
//   acc = fma(float(integer dot of weight codes and int8 activations), scale product, acc)
// (Q4_K/Q5_K add one fnmadd per block for the −dmin·m term, Q4_1/Q5_1 one fmadd for +m). The integer dot is exact and the
// float ops per element are one fixed sequence, so a row's result depends only on that row and
// the weights: not on the batch size, the tiling or the thread count
// (docs/decisions/0001-batch-invariant-cpu-kernels.md).
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
// from the weight bytes, 8 weight rows and up to 8 activation rows per call (RowDotBytes8,
// VPMADDUBSW, one lane per weight row; a tile's last rows one at a time, RowDotBytes), Q4_K
// and Q6_K likewise (RowDotK8; their last rows through DecodeRow and RowDot); with two or more
// activation rows the 8 weight rows' codes are first transposed (TransposeDwords8) so each
// product lands in its row's lane without horizontal adds (narrow types and K-quants); other types up
// to kRowPathMaxRows decode a row and dot it (RowDot); more rows decode 8 weight rows into a
// transposed int16 tile once and dot every activation row against it on VPMADDWD (PairTile).
// The paths live in matmul_int8_avx512.cc, matmul_int8_avx2.cc and matmul_int8_rows.cc
// (matmul_int8_internal.h); this file quantizes the activations and dispatches.

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/matmul_int8_internal.h"

namespace dd::kernels {
namespace {

using int8::kBlock;
using int8::kTile;
using int8::QuantActs;

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
  const int8::Call call{w, acts, m_rows, bias, y, y_stride};
#if DD_INT8_AVX512
  const int8::TileRunner run_tiles = int8::Avx512Tiles(call);
#elif DD_INT8_AVX2
  const int8::TileRunner run_tiles = int8::Avx2Tiles(call);
#else
  const int8::TileRunner run_tiles = int8::PortableTiles(call);
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
