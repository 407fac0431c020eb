#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dd/kernels/cpu_ops.h"

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
typedef float V16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t I16 __attribute__((vector_size(64), aligned(4), may_alias));

// e^r for |r| <= ln2/2: the degree-7 Taylor polynomial by Horner, for float or V16 (the same
// operations in the same order, so scalar and vector callers get the same bits).
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
inline V16 ExpNonPositive(V16 x) {
  const I16 tiny = x < -87.0f;
  x = tiny ? V16{} - 87.0f : x;
  const V16 t = x * 1.44269504088896341f - 0.5f;
  const I16 k = __builtin_convertvector(t, I16);  // truncation toward zero = round(x log2 e)
  const V16 kf = __builtin_convertvector(k, V16);
  V16 r = x - kf * 0.693145751953125f;
  r = r - kf * 1.428606765330187045e-06f;
  const V16 p = ExpTaylor7(r);
  const I16 bits = (k + 127) << 23;
  V16 scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  const V16 out = p * scale;
  return tiny ? V16{} : out;
}
}  // namespace

void ScaledSoftmax(float* x, int64_t n, float scale) {
  if (n <= 0) return;
  // The max is exact whatever the order, so 16 lanes then across them.
  const int64_t nv = n / 16 * 16;
  V16 vmx = V16{} - INFINITY;
  for (int64_t i = 0; i < nv; i += 16) {
    V16 v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    v *= scale;
    vmx = v > vmx ? v : vmx;
  }
  float mx = -INFINITY;
  for (int i = 0; i < 16; ++i) mx = std::max(mx, vmx[i]);
  for (int64_t i = nv; i < n; ++i) mx = std::max(mx, x[i] * scale);
  V16 acc = {};
  for (int64_t i = 0; i < nv; i += 16) {
    V16 v;
    __builtin_memcpy(&v, x + i, sizeof(v));
    v = ExpNonPositive(v * scale - mx);
    __builtin_memcpy(x + i, &v, sizeof(v));
    acc += v;
  }
  if (nv < n) {  // the tail through the same vector code, padded with -inf (exp = 0)
    V16 v = V16{} - INFINITY;
    __builtin_memcpy(&v, x + nv, (n - nv) * sizeof(float));
    v = ExpNonPositive(v * scale - mx);
    __builtin_memcpy(x + nv, &v, (n - nv) * sizeof(float));
    acc += v;
  }
  float lanes[16];
  __builtin_memcpy(lanes, &acc, sizeof(lanes));
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

// e^x for any float x (clamped to [-87, 88]): x = n·ln2 + r with |r| <= ln2/2 (ln2 split in
// two for an exact n·ln2), e^r by a degree-7 Taylor-Horner polynomial, 2^n put in the exponent
// bits. Plain arithmetic only, so loops calling it vectorize.
inline float ExpPoly(float x) {
  x = x < 88.0f ? x : 88.0f;  // comparisons, not fmin/fmax (libm calls that stop vectorizing)
  x = x > -87.0f ? x : -87.0f;
  // Round to nearest by adding and removing 1.5·2^23 (std::floor would not vectorize).
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  const float p = ExpTaylor7(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace

void GeluTanhMul(const float* gate, const float* up, float* out, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i];
    const float y = kSqrt2OverPi * (x + 0.044715f * x * x * x);
    const float t = 1.0f - 2.0f / (ExpPoly(2.0f * y) + 1.0f);  // tanh(y)
    out[i] = 0.5f * x * (1.0f + t) * up[i];
  }
}

void SiluMul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i];
    out[i] = x / (1.0f + ExpPoly(-x)) * up[i];
  }
}

}  // namespace dd::kernels
