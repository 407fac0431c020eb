#include "dd/kernels/low_rank_keys.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dd/kernels/cpu_ops.h"
#include "dd/kernels/dtype.h"

namespace dd::kernels {
namespace {

void Widen(const void* row, KvDtype t, int64_t n, float* out) {
  if (t == KvDtype::kF16) {
    const auto* h = static_cast<const uint16_t*>(row);
    for (int64_t j = 0; j < n; ++j) out[j] = F16ToF32(h[j]);
  } else {
    std::memcpy(out, row, static_cast<size_t>(n) * sizeof(float));
  }
}

}  // namespace

void ProjectKeyRows(const backend::LowRankKeys& f, const void* const* rows, const int64_t* positions, int64_t begin,
                    int64_t end, float* out) {
  const int64_t d = f.kv_dim(), hd = f.head_dim, r = f.rank;
  std::vector<float> key(d), cos(f.half), sin(f.half);
  // The basis transposed (element-major), so that the sums run over the coefficients as
  // vectors; each coefficient still adds its products in element order from zero.
  std::vector<float> bt(d * r);
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t e = 0; e < d; ++e) bt[e * r + j] = f.basis[j * d + e];
  }
  for (int64_t i = begin; i < end; ++i) {
    Widen(rows[i], f.kv, d, key.data());
    // The rotation undone: the same angles, turned the other way.
    RopeAngles(f.inv_freq, f.half, positions[i], cos.data(), sin.data());
    for (float& s : sin) s = -s;
    for (int64_t g = 0; g < f.n_head_kv; ++g) ApplyRope(key.data() + g * hd, f.half, cos.data(), sin.data(), f.neox);
    float* o = out + i * r;
    std::fill(o, o + r, 0.0f);
    for (int64_t e = 0; e < d; ++e) {
      const float x = key[e];
      const float* b = bt.data() + e * r;
      for (int64_t j = 0; j < r; ++j) o[j] += b[j] * x;
    }
  }
}

void ReconstructKeyChunks(const backend::LowRankKeys& f, const float* const* coeffs, const int64_t* first,
                          const int32_t* heads, int64_t chunk, int64_t begin, int64_t end, void* const* out) {
  const int64_t d = f.kv_dim(), hd = f.head_dim, half = f.half;
  std::vector<float> head(hd), cos(half), sin(half);
  // A chunk's positions are consecutive: the angles of its first position, then each next one
  // turned by one step (in double: the same floats as computing each, but for a last-bit tie
  // now and then), one sine and cosine per pair and item instead of per pair and position.
  std::vector<double> step_cos(half), step_sin(half), c(half), sn(half);
  for (int64_t i = 0; i < half; ++i) {
    step_cos[i] = std::cos(static_cast<double>(f.inv_freq[i]));
    step_sin[i] = std::sin(static_cast<double>(f.inv_freq[i]));
  }
  for (int64_t i = begin; i < end; ++i) {
    const float* part = f.basis + heads[i] * hd;  // basis row j's part for the head: part + j × d
    for (int64_t p = 0; p < half; ++p) {
      const double theta = static_cast<double>(first[i]) * f.inv_freq[p];
      c[p] = std::cos(theta);
      sn[p] = std::sin(theta);
    }
    for (int64_t t = 0; t < chunk; ++t) {
      const float* a = coeffs[i] + t * f.rank;
      std::fill(head.begin(), head.end(), 0.0f);
      for (int64_t j = 0; j < f.rank; ++j) {
        const float aj = a[j];
        const float* b = part + j * d;
        for (int64_t e = 0; e < hd; ++e) head[e] += aj * b[e];
      }
      for (int64_t p = 0; p < half; ++p) {
        cos[p] = static_cast<float>(c[p]);
        sin[p] = static_cast<float>(sn[p]);
        const double next_c = c[p] * step_cos[p] - sn[p] * step_sin[p];
        sn[p] = sn[p] * step_cos[p] + c[p] * step_sin[p];
        c[p] = next_c;
      }
      ApplyRope(head.data(), half, cos.data(), sin.data(), f.neox);
      if (f.kv == KvDtype::kF16) {
        (void)F32ToF16Saturating(head.data(), hd, static_cast<uint16_t*>(out[i]) + t * hd);
      } else {
        std::memcpy(static_cast<float*>(out[i]) + t * hd, head.data(), static_cast<size_t>(hd) * sizeof(float));
      }
    }
  }
}

}  // namespace dd::kernels
