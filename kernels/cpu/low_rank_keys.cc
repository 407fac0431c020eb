#include "dd/kernels/low_rank_keys.h"

#include <algorithm>
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
  const int64_t d = f.kv_dim(), hd = f.head_dim;
  std::vector<float> head(hd), cos(f.half), sin(f.half);
  for (int64_t i = begin; i < end; ++i) {
    const float* part = f.basis + heads[i] * hd;  // basis row j's part for the head: part + j × d
    for (int64_t t = 0; t < chunk; ++t) {
      const float* a = coeffs[i] + t * f.rank;
      std::fill(head.begin(), head.end(), 0.0f);
      for (int64_t j = 0; j < f.rank; ++j) {
        const float aj = a[j];
        const float* b = part + j * d;
        for (int64_t e = 0; e < hd; ++e) head[e] += aj * b[e];
      }
      RopeAngles(f.inv_freq, f.half, first[i] + t, cos.data(), sin.data());
      ApplyRope(head.data(), f.half, cos.data(), sin.data(), f.neox);
      if (f.kv == KvDtype::kF16) {
        (void)F32ToF16Saturating(head.data(), hd, static_cast<uint16_t*>(out[i]) + t * hd);
      } else {
        std::memcpy(static_cast<float*>(out[i]) + t * hd, head.data(), static_cast<size_t>(hd) * sizeof(float));
      }
    }
  }
}

}  // namespace dd::kernels
