#include "decode-worker/engine/dense_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "dd/kernels/cpu_ops.h"

namespace dd::engine {

DenseKvCache::DenseKvCache(const model::ModelConfig& config, ThreadPool& pool) : config_(config), pool_(pool) {}

DenseKvCache::Slot& DenseKvCache::GetSlot(int32_t seq) {
  if (seq >= static_cast<int32_t>(slots_.size())) slots_.resize(seq + 1);
  Slot& s = slots_[seq];
  if (s.k.empty()) {
    s.k.resize(config_.n_layer);
    s.v.resize(config_.n_layer);
  }
  return s;
}

void DenseKvCache::Reset(int32_t seq) {
  if (seq < static_cast<int32_t>(slots_.size())) slots_[seq] = Slot();
}

void DenseKvCache::Copy(int32_t src, int32_t dst) {
  if (src == dst) return;
  GetSlot(src);
  GetSlot(dst);
  slots_[dst] = slots_[src];
}

int64_t DenseKvCache::Length(int32_t seq) const {
  return seq < static_cast<int32_t>(slots_.size()) ? slots_[seq].length : 0;
}

int64_t DenseKvCache::bytes_reserved() const {
  int64_t total = 0;
  for (const Slot& s : slots_) {
    for (const auto& k : s.k) total += k.capacity() * sizeof(float);
    for (const auto& v : s.v) total += v.capacity() * sizeof(float);
  }
  return total;
}

absl::Status DenseKvCache::Attend(const model::AttentionCall& call) {
  const int64_t n = static_cast<int64_t>(call.rows.size());
  int64_t r0 = 0;
  while (r0 < n) {
    int64_t r1 = r0 + 1;
    while (r1 < n && call.rows[r1].seq == call.rows[r0].seq) ++r1;
    const int32_t seq = call.rows[r0].seq;
    if (seq < 0) return absl::InvalidArgumentError(absl::StrCat("negative sequence slot ", seq));
    Slot& slot = GetSlot(seq);
    // Rows must continue the sequence: positions length, length+1, ... (layer 0 sets length).
    const int64_t base = call.layer == 0 ? slot.length : slot.length - (r1 - r0);
    for (int64_t r = r0; r < r1; ++r) {
      if (call.rows[r].pos != base + (r - r0)) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, ": row position ", call.rows[r].pos,
                                                       " does not continue the cache (expected ", base + (r - r0), ")"));
      }
    }
    AttendGroup(call, slot, r0, r1);
    if (call.layer == 0) slot.length += r1 - r0;
    r0 = r1;
  }
  return absl::OkStatus();
}

void DenseKvCache::AttendGroup(const model::AttentionCall& call, Slot& slot, int64_t r0, int64_t r1) {
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  const int64_t kv_dim = n_kv * hd, q_dim = config_.n_head * hd;
  const int64_t nr = r1 - r0;
  const int64_t p0 = call.rows[r0].pos, p1 = call.rows[r1 - 1].pos;
  std::vector<float>& K = slot.k[call.layer];
  std::vector<float>& V = slot.v[call.layer];
  const size_t need = static_cast<size_t>((p1 + 1) * kv_dim);
  if (K.capacity() < need) {
    const size_t cap = std::max(need, K.capacity() * 2);
    K.reserve(cap);
    V.reserve(cap);
  }
  K.resize(need);
  V.resize(need);
  std::memcpy(&K[p0 * kv_dim], call.k + r0 * kv_dim, nr * kv_dim * sizeof(float));
  std::memcpy(&V[p0 * kv_dim], call.v + r0 * kv_dim, nr * kv_dim * sizeof(float));

  // Keys any row of the group may see: [lo, p1].
  const int64_t lo = call.sliding ? std::max<int64_t>(0, p0 - call.window + 1) : 0;
  const int64_t n_keys = p1 + 1 - lo;
  const int64_t nq = nr * gs;  // query vectors per KV head
  qbuf_.resize(nq * hd);
  scores_.resize(nq * n_keys);
  for (int64_t g = 0; g < n_kv; ++g) {
    for (int64_t r = 0; r < nr; ++r) {
      std::memcpy(&qbuf_[r * gs * hd], call.q + (r0 + r) * q_dim + g * gs * hd, gs * hd * sizeof(float));
    }
    kernels::WeightView keys{kernels::DType::kF32, reinterpret_cast<const uint8_t*>(&K[lo * kv_dim + g * hd]),
                             n_keys, hd, kv_dim * static_cast<int64_t>(sizeof(float))};
    kernels::MatMul(keys, qbuf_.data(), nq, hd, nullptr, scores_.data(), n_keys, pool_);
    pool_.ParallelFor(nq, [&](int64_t b, int64_t e) {
      for (int64_t qi = b; qi < e; ++qi) {
        const int64_t r = qi / gs, h = g * gs + qi % gs;
        const int64_t pos = call.rows[r0 + r].pos;
        const int64_t first = call.sliding ? std::max<int64_t>(0, pos - call.window + 1) : 0;
        float* s = &scores_[qi * n_keys];
        const int64_t j0 = first - lo, j1 = pos - lo + 1;  // visible keys [j0, j1)
        float mx = -INFINITY;
        for (int64_t j = j0; j < j1; ++j) {
          s[j] *= call.scale;
          mx = std::max(mx, s[j]);
        }
        float sum = 0;
        for (int64_t j = j0; j < j1; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        const float inv = 1.0f / sum;
        float* out = call.out + (r0 + r) * q_dim + h * hd;
        std::fill(out, out + hd, 0.0f);
        for (int64_t j = j0; j < j1; ++j) {
          const float p = s[j] * inv;
          const float* vj = &V[(lo + j) * kv_dim + g * hd];
          for (int64_t t = 0; t < hd; ++t) out[t] += p * vj[t];
        }
      }
    });
  }
}

}  // namespace dd::engine
