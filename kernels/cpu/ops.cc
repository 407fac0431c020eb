#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "dd/kernels/cpu_ops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dd::kernels {

void RmsNorm(const float* x, const float* w, float eps, int64_t n, float* y) {
  double ss = 0;  // double: the norm of a 4K-wide activation must not depend on luck
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  if (w != nullptr) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
  }
}

void RopeAngles(const float* inv_freq, int64_t half, int64_t pos, float* cos_out, float* sin_out) {
  for (int64_t i = 0; i < half; ++i) {
    const double theta = static_cast<double>(pos) * inv_freq[i];
    cos_out[i] = static_cast<float>(std::cos(theta));
    sin_out[i] = static_cast<float>(std::sin(theta));
  }
}

void ApplyRope(float* head, int64_t half, const float* cos, const float* sin, bool neox) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = neox ? i : 2 * i;
    const int64_t b = neox ? i + half : 2 * i + 1;
    const float x0 = head[a], x1 = head[b];
    head[a] = x0 * cos[i] - x1 * sin[i];
    head[b] = x0 * sin[i] + x1 * cos[i];
  }
}

namespace {
// Softmax vectors: 16 lanes, held as kParts vectors of 16 / kParts floats. On AVX2 without
// AVX-512 GCC lowers 16-float generic vectors to stack traffic (15% of a prefill in perf), so
// there the 16 lanes are two 8-float halves; every lane sees the same operations either way.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kParts = 2;
#else
constexpr int kParts = 1;
#endif
constexpr int kPartLanes = 16 / kParts;
typedef float VP __attribute__((vector_size(4 * kPartLanes), aligned(4), may_alias));
typedef int32_t IP __attribute__((vector_size(4 * kPartLanes), aligned(4), may_alias));
// Loads and stores through the may_alias type: one unaligned vector move each. A
// __builtin_memcpy into a vector went through the stack on AVX2 (two 16-byte stores, then one
// 32-byte load: a store-forwarding stall per vector, most of the softmax's time).
inline VP LoadVP(const float* p) { return *reinterpret_cast<const VP*>(p); }
inline void StoreVP(float* p, VP v) { *reinterpret_cast<VP*>(p) = v; }

// e^r for |r| <= ln2/2: the degree-7 Taylor polynomial by Horner, for float or a vector (the
// same operations in the same order, so scalar and vector callers get the same bits).
template <typename T>
inline T ExpTaylor7(T r) {
  T p = T{} + 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// exp(x) for x <= 0 (softmax inputs after subtracting the max): x = k ln2 + r with
// |r| <= ln2/2, e^r by a degree-7 Taylor polynomial (error < 2e-8 relative), times 2^k built
// in the exponent bits. Inputs below -87 (and -inf) give 0.
inline VP ExpNonPositive(VP x) {
  const IP tiny = x < -87.0f;
  x = tiny ? VP{} - 87.0f : x;
  const VP t = x * 1.44269504088896341f - 0.5f;
  const IP k = __builtin_convertvector(t, IP);  // truncation toward zero = round(x log2 e)
  const VP kf = __builtin_convertvector(k, VP);
  VP r = x - kf * 0.693145751953125f;
  r = r - kf * 1.428606765330187045e-06f;
  const VP p = ExpTaylor7(r);
  const IP bits = (k + 127) << 23;
  VP scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const VP out = p * scale;
  return tiny ? VP{} : out;
}
}  // namespace

void ScaledSoftmax(float* x, int64_t n, float scale) {
  if (n <= 0) return;
  // The max is exact whatever the order, so 16 lanes then across them.
  const int64_t nv = n / 16 * 16;
  VP vmx[kParts];
  for (int h = 0; h < kParts; ++h) vmx[h] = VP{} - INFINITY;
  for (int64_t i = 0; i < nv; i += 16) {
    for (int h = 0; h < kParts; ++h) {
      const VP v = LoadVP(x + i + h * kPartLanes) * scale;
      vmx[h] = v > vmx[h] ? v : vmx[h];
    }
  }
  float mx = -INFINITY;
  for (int h = 0; h < kParts; ++h)
    for (int i = 0; i < kPartLanes; ++i) mx = std::max(mx, vmx[h][i]);
  for (int64_t i = nv; i < n; ++i) mx = std::max(mx, x[i] * scale);
  // Lane l of the 16 (part l / kPartLanes) sums the exponentials of elements l, l + 16, ...
  VP acc[kParts] = {};
  for (int64_t i = 0; i < nv; i += 16) {
    for (int h = 0; h < kParts; ++h) {
      const VP v = ExpNonPositive(LoadVP(x + i + h * kPartLanes) * scale - mx);
      StoreVP(x + i + h * kPartLanes, v);
      acc[h] += v;
    }
  }
  if (nv < n) {  // the tail through the same vector code, padded with -inf (exp = 0)
    float tail[16];
    std::fill(tail, tail + 16, -INFINITY);
    std::memcpy(tail, x + nv, (n - nv) * sizeof(float));
    for (int h = 0; h < kParts; ++h) {
      const VP v = ExpNonPositive(LoadVP(tail + h * kPartLanes) * scale - mx);
      StoreVP(tail + h * kPartLanes, v);
      acc[h] += v;
    }
    std::memcpy(x + nv, tail, (n - nv) * sizeof(float));
  }
  float lanes[16];
  for (int h = 0; h < kParts; ++h) StoreVP(lanes + h * kPartLanes, acc[h]);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) lanes[i] += lanes[i + w];
  const float inv = 1.0f / lanes[0];
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void Axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float GeluTanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

namespace {

// e^x for any float x (clamped to [-87, 88]), lane by lane: x = n·ln2 + r with |r| <= ln2/2
// (ln2 split in two for an exact n·ln2), e^r by a degree-7 Taylor-Horner polynomial, 2^n put
// in the exponent bits.
inline VP ExpPoly(VP x) {
  x = x < 88.0f ? x : VP{} + 88.0f;
  x = x > -87.0f ? x : VP{} - 87.0f;
  // Round to nearest by adding and removing 1.5·2^23.
  const VP n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  const VP r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  const VP p = ExpTaylor7(r);
  const IP bits = (__builtin_convertvector(n, IP) + 127) << 23;
  VP scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out[i] = f(gate[i], up[i]) for f on 16-lane vectors (as kParts parts); the last n % 16
// elements go through the same f in a padded vector, so every element gets the same
// operations wherever it sits (a row's bits do not depend on how the batch was split).
// `out` may alias `gate`.
template <typename F>
inline void GatedLanes(const float* gate, const float* up, float* out, int64_t n, F f) {
  const int64_t nv = n / 16 * 16;
  for (int64_t i = 0; i < nv; i += 16) {
    for (int h = 0; h < kParts; ++h) {
      const int64_t at = i + h * kPartLanes;
      StoreVP(out + at, f(LoadVP(gate + at), LoadVP(up + at)));
    }
  }
  if (nv == n) return;
  float g[16] = {}, u[16] = {};
  std::memcpy(g, gate + nv, (n - nv) * sizeof(float));
  std::memcpy(u, up + nv, (n - nv) * sizeof(float));
  for (int h = 0; h < kParts; ++h) {
    StoreVP(g + h * kPartLanes, f(LoadVP(g + h * kPartLanes), LoadVP(u + h * kPartLanes)));
  }
  std::memcpy(out + nv, g, (n - nv) * sizeof(float));
}

}  // namespace

// Both were scalar loops GCC did not vectorize (the exp clamps became branches): GELU 9.1 vs
// 1.1 ns an element, SiLU 6.0 vs 0.7 (one thread, 4 × 2048 elements); GELU was 1.8 ms of a
// Gemma batch-4 decode step (perf).
void GeluTanhMul(const float* gate, const float* up, float* out, int64_t n) {
  GatedLanes(gate, up, out, n, [](VP x, VP u) {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    const VP y = kSqrt2OverPi * (x + 0.044715f * x * x * x);
    const VP t = 1.0f - 2.0f / (ExpPoly(2.0f * y) + 1.0f);  // tanh(y)
    return 0.5f * x * (1.0f + t) * u;
  });
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  GatedLanes(gate, up, out, n, [](VP x, VP u) { return x / (1.0f + ExpPoly(-x)) * u; });
}

// The first index of the largest logit; NaNs never win, and a NaN at index 0 gives 0 (as
// the plain scan `if (x[i] > x[best]) best = i` does, which the tail below still is).
int32_t ArgmaxFirst(const float* logits, int64_t n) {
  if (n <= 0 || std::isnan(logits[0])) return 0;
  int32_t best = 0;
  int64_t i = 1;
#if defined(__AVX2__)
  // Per lane the first index of its largest value (a strict > keeps the first), then the
  // smallest index among the lanes holding the overall largest: the scan's answer. Four rows
  // of Gemma's 262144 logits (a batch-4 step): 0.13-0.17 ms vs 1.6-2.0 ms in the scan, hot in
  // cache (4.6 ms in a perf profile of the decode, where the logits come from the head).
  if (n >= 16) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    __m256i top_idx = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(logits + i);
      const __m256 gt = _mm256_cmp_ps(v, top, _CMP_GT_OQ);  // false for NaN
      top = _mm256_blendv_ps(top, v, gt);
      top_idx = _mm256_blendv_epi8(top_idx, idx, _mm256_castps_si256(gt));
      idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8));
    }
    alignas(32) float lane[8];
    alignas(32) int32_t lane_idx[8];
    _mm256_store_ps(lane, top);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_idx), top_idx);
    float m = lane[0];
    for (int l = 1; l < 8; ++l) m = std::max(m, lane[l]);
    best = std::numeric_limits<int32_t>::max();
    // All lanes at -inf only when every logit is -inf or NaN: their indices stayed 0.
    for (int l = 0; l < 8; ++l) {
      if (lane[l] == m) best = std::min(best, lane_idx[l]);
    }
  }
#endif
  for (; i < n; ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace dd::kernels
