#include "decode-worker/engine/low_rank_key_cache.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common/status_macros.h"
#include "dd/kernels/cpu_ops.h"
#include "dd/kernels/dtype.h"

namespace dd::engine {
namespace {

// A fixed start for the subspace iteration: the same basis for the same keys on every run.
double StartValue(uint64_t i) {
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
}

// Orthonormalizes the r vectors of q (r × d, one vector per row) in place, modified
// Gram-Schmidt done twice; a vector that vanishes (keys of lower rank than r) restarts from
// fresh start values.
void Orthonormalize(std::vector<double>& q, int64_t d, int64_t r, uint64_t* restarts) {
  const auto dot = [d](const double* a, const double* b) {
    double s = 0;
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
  };
  for (int64_t j = 0; j < r; ++j) {
    double* v = q.data() + j * d;
    for (int attempt = 0; attempt < 4; ++attempt) {
      const double before = dot(v, v);
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t k = 0; k < j; ++k) {
          const double* u = q.data() + k * d;
          const double x = dot(u, v);
          for (int64_t i = 0; i < d; ++i) v[i] -= x * u[i];
        }
      }
      const double norm = dot(v, v);
      if (norm > 1e-20 * std::max(before, 1e-300) && norm > 0) {
        const double inv = 1.0 / std::sqrt(norm);
        for (int64_t i = 0; i < d; ++i) v[i] *= inv;
        break;
      }
      for (int64_t i = 0; i < d; ++i) v[i] = StartValue(++*restarts * 1000003ull + i);
    }
  }
}

}  // namespace

LowRankKeyCache::LowRankKeyCache(const model::ModelConfig& config, const SparseOptions& options,
                                 backend::Device& device, SparseRows& rows)
    : config_(config), options_(options), device_(device), rows_(rows),
      rank_(options.key_reconstruction.RankFor(config.n_head_kv * config.head_dim)) {}

int64_t LowRankKeyCache::BytesFor(int64_t tokens) const {
  return rank_ * kv_dim() * static_cast<int64_t>(sizeof(float)) + tokens / options_.chunk_tokens * ChunkCoeffBytes();
}

backend::LowRankKeys LowRankKeyCache::Shape(const LowRankLayer& lr) const {
  backend::LowRankKeys f;
  f.basis = static_cast<const float*>(lr.basis.data);
  f.rank = rank_;
  f.n_head_kv = config_.n_head_kv;
  f.head_dim = config_.head_dim;
  f.inv_freq = config_.inv_freq.data();
  f.half = config_.rope_dim / 2;
  f.neox = config_.rope_neox;
  f.kv = rows_.kv_dtype();
  return f;
}

absl::Status LowRankKeyCache::Reserve(LowRankLayer& lr, int64_t total_tokens) {
  if (!lr.basis) {
    ASSIGN_OR_RETURN(lr.basis, AllocateOrEmpty(device_, backend::MemoryTag::kLowRankKeys,
                                               rank_ * kv_dim() * static_cast<int64_t>(sizeof(float))));
  }
  return EnsureCoeffs(lr, total_tokens / options_.chunk_tokens);
}

absl::Status LowRankKeyCache::EnsureCoeffs(LowRankLayer& lr, int64_t chunks) {
  if (chunks <= lr.cap) return absl::OkStatus();
  const int64_t cap = std::max(chunks, 2 * lr.cap);
  ASSIGN_OR_RETURN(backend::DeviceBuffer next,
                   AllocateOrEmpty(device_, backend::MemoryTag::kLowRankKeys, cap * ChunkCoeffBytes()));
  if (lr.coeffs) {
    absl::Status st = lr.projected > 0 ? device_.Copy(backend::Queue::kCompute, lr.coeffs, 0, next, 0,
                                                      lr.projected * ChunkCoeffBytes())
                                       : absl::OkStatus();
    // Nothing queued may still read the old buffer when it goes.
    if (st.ok()) st = device_.Synchronize(device_.Record(backend::Queue::kCompute));
    if (!st.ok()) {
      device_.Free(next);
      return st;
    }
    device_.Free(lr.coeffs);
  }
  lr.coeffs = next;
  lr.cap = cap;
  return absl::OkStatus();
}

std::vector<float> LowRankKeyCache::Basis(const std::vector<float>& keys, int64_t n) const {
  const int64_t d = kv_dim(), r = rank_;
  // Uncentred covariance of the keys (the basis of their span, as ShadowKV's SVD of the keys).
  std::vector<double> cov(d * d, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    const float* x = keys.data() + t * d;
    for (int64_t i = 0; i < d; ++i) {
      const double xi = x[i];
      double* row = cov.data() + i * d;
      for (int64_t j = i; j < d; ++j) row[j] += xi * x[j];
    }
  }
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < i; ++j) cov[i * d + j] = cov[j * d + i];
  }
  // The r vectors as rows (r × d): every sum below runs over contiguous memory.
  std::vector<double> q(r * d), z(r * d);
  for (int64_t i = 0; i < r * d; ++i) q[i] = StartValue(static_cast<uint64_t>(i));
  uint64_t restarts = 0;
  Orthonormalize(q, d, r, &restarts);
  for (int it = 0; it < kIterations; ++it) {
    for (int64_t j = 0; j < r; ++j) {  // z_j = cov · q_j (cov is symmetric)
      const double* qj = q.data() + j * d;
      double* zj = z.data() + j * d;
      for (int64_t i = 0; i < d; ++i) {
        const double* c = cov.data() + i * d;
        double acc = 0;
        for (int64_t k = 0; k < d; ++k) acc += c[k] * qj[k];
        zj[i] = acc;
      }
    }
    Orthonormalize(z, d, r, &restarts);
    q.swap(z);
  }
  std::vector<float> basis(q.begin(), q.end());  // rows: the basis vectors
  return basis;
}

absl::Status LowRankKeyCache::Build(LowRankLayer& lr, const LayerRows& st) {
  if (lr.ready) return absl::OkStatus();
  const int64_t C = options_.chunk_tokens, chunks = st.length / C, n = chunks * C, d = kv_dim();
  if (chunks == 0) return absl::OkStatus();
  const auto start = std::chrono::steady_clock::now();
  // A sample of evenly spaced keys of the prompt to the host, widened and unrotated.
  const int64_t stride = (n + kMaxSampleRows - 1) / kMaxSampleRows, samples = (n + stride - 1) / stride;
  const int64_t row_bytes = rows_.RowBytes(), half = config_.rope_dim / 2, hd = config_.head_dim;
  std::vector<uint8_t> raw_k(samples * row_bytes), raw_v(samples * row_bytes);
  for (int64_t s = 0; s < samples; ++s) {
    RETURN_IF_ERROR(rows_.ToHost(backend::Queue::kCompute, st, s * stride, s * stride + 1, raw_k.data() + s * row_bytes,
                                 raw_v.data() + s * row_bytes));
  }
  RETURN_IF_ERROR(device_.Synchronize(device_.Record(backend::Queue::kCompute)));
  std::vector<float> keys(samples * d), cos(half), sin(half);
  for (int64_t s = 0; s < samples; ++s) {
    float* x = keys.data() + s * d;
    const uint8_t* row = raw_k.data() + s * row_bytes;
    if (rows_.kv_dtype() == KvDtype::kF16) {
      const auto* h = reinterpret_cast<const uint16_t*>(row);
      for (int64_t e = 0; e < d; ++e) x[e] = kernels::F16ToF32(h[e]);
    } else {
      std::copy_n(reinterpret_cast<const float*>(row), d, x);
    }
    kernels::RopeAngles(config_.inv_freq.data(), half, s * stride, cos.data(), sin.data());
    for (float& a : sin) a = -a;
    for (int64_t g = 0; g < config_.n_head_kv; ++g) {
      kernels::ApplyRope(x + g * hd, half, cos.data(), sin.data(), config_.rope_neox);
    }
  }
  const std::vector<float> basis = Basis(keys, samples);
  if (!lr.basis) {
    ASSIGN_OR_RETURN(lr.basis, AllocateOrEmpty(device_, backend::MemoryTag::kLowRankKeys,
                                               static_cast<int64_t>(basis.size() * sizeof(float))));
  }
  RETURN_IF_ERROR(device_.CopyToDevice(backend::Queue::kCompute, basis.data(), lr.basis, 0,
                                       static_cast<int64_t>(basis.size() * sizeof(float))));
  lr.ready = true;
  lr.projected = 0;
  RETURN_IF_ERROR(Project(lr, st));
  // The basis's host copy is read by the queued copy: done before it goes.
  RETURN_IF_ERROR(device_.Synchronize(device_.Record(backend::Queue::kCompute)));
  ++builds_;
  build_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return absl::OkStatus();
}

absl::Status LowRankKeyCache::Project(LowRankLayer& lr, const LayerRows& st) {
  if (!lr.ready) return absl::OkStatus();
  const int64_t C = options_.chunk_tokens, chunks = st.length / C;
  if (chunks <= lr.projected) return absl::OkStatus();
  RETURN_IF_ERROR(EnsureCoeffs(lr, chunks));
  key_rows_.clear();
  positions_.clear();
  for (int64_t p = lr.projected * C; p < chunks * C; ++p) {
    key_rows_.push_back(rows_.K(st, p));
    positions_.push_back(p);
  }
  device_.ops().ProjectKeys(Shape(lr), key_rows_.data(), positions_,
                            static_cast<float*>(lr.coeffs.data) + lr.projected * C * rank_);
  lr.projected = chunks;
  return absl::OkStatus();
}

void LowRankKeyCache::Reconstruct(const LowRankLayer& lr, absl::Span<const int64_t> chunks,
                                  absl::Span<const int32_t> heads, absl::Span<void* const> dst) {
  const int64_t C = options_.chunk_tokens;
  item_coeffs_.clear();
  item_first_.clear();
  for (int64_t c : chunks) {
    item_coeffs_.push_back(static_cast<const float*>(lr.coeffs.data) + c * C * rank_);
    item_first_.push_back(c * C);
  }
  device_.ops().ReconstructKeys(Shape(lr), item_coeffs_.data(), item_first_, heads, C, dst.data());
}

absl::Status LowRankKeyCache::Duplicate(const LowRankLayer& from, LowRankLayer& to) {
  RETURN_IF_ERROR(DuplicateBuffer(device_, from.basis, /*contents=*/true, &to.basis));
  RETURN_IF_ERROR(DuplicateBuffer(device_, from.coeffs, /*contents=*/true, &to.coeffs));
  to.cap = from.cap;
  to.projected = from.projected;
  to.ready = from.ready;
  return absl::OkStatus();
}

void LowRankKeyCache::Free(LowRankLayer& lr) {
  device_.Free(lr.basis);
  device_.Free(lr.coeffs);
  lr = LowRankLayer();
}

}  // namespace dd::engine
