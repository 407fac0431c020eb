#include <cmath>

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

float GeluTanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace dd::kernels
