#include "decode-worker/engine/causal_attention.h"

#include <algorithm>
#include <cstring>

#include "dd/kernels/cpu_ops.h"

namespace dd::engine {
namespace {
constexpr int64_t kBlockRows = 16;
}  // namespace

void AttendCausal(const model::AttentionCall& call, const model::ModelConfig& config, int64_t r0, int64_t r1,
                  int64_t lo, absl::Span<const KvRun> runs, ThreadPool& pool, AttentionScratch* scratch) {
  const int64_t hd = config.head_dim, n_kv = config.n_head_kv, gs = config.n_head / n_kv;
  const int64_t kv_dim = n_kv * hd, q_dim = config.n_head * hd;
  const int64_t nr = r1 - r0;
  int64_t n_keys = 0;
  for (const KvRun& run : runs) n_keys += run.len;
  // Key j of the concatenation, per KV head g: keys[g * n_keys + j].
  scratch->keys.resize(n_kv * n_keys);
  scratch->values.resize(n_kv * n_keys);
  for (int64_t g = 0, j = 0; g < n_kv; ++g) {
    for (const KvRun& run : runs) {
      for (int64_t t = 0; t < run.len; ++t, ++j) {
        scratch->keys[j] = run.k + t * kv_dim + g * hd;
        scratch->values[j] = run.v + t * kv_dim + g * hd;
      }
    }
  }
  const int64_t n_blocks = (nr + kBlockRows - 1) / kBlockRows;
  // Causal blocks grow with position; pair cheap and expensive ones in each thread's range
  // (0, last, 1, last-1, ...) so the contiguous split stays balanced.
  auto block_of = [n_blocks](int64_t i) { return i % 2 == 0 ? i / 2 : n_blocks - 1 - i / 2; };
  pool.ParallelFor(n_kv * n_blocks, [&](int64_t tb, int64_t te) {
    thread_local std::vector<float> q, s;
    thread_local std::vector<float*> outs;
    for (int64_t t = tb; t < te; ++t) {
      const int64_t g = t / n_blocks, b = block_of(t % n_blocks);
      const int64_t ra = b * kBlockRows, rb = std::min(nr, ra + kBlockRows);
      const int64_t nq = (rb - ra) * gs;
      int64_t j0[kBlockRows], j1[kBlockRows];  // visible keys [j0, j1) per row
      for (int64_t r = ra; r < rb; ++r) {
        const int64_t pos = call.rows[r0 + r].pos;
        const int64_t first = call.sliding ? std::max<int64_t>(0, pos - call.window + 1) : 0;
        j0[r - ra] = first - lo;
        j1[r - ra] = pos - lo + 1;
      }
      const int64_t jmin = *std::min_element(j0, j0 + (rb - ra));
      const int64_t jmax = *std::max_element(j1, j1 + (rb - ra));
      const int64_t ld = jmax - jmin;
      q.resize(nq * hd);
      s.resize(nq * ld);
      outs.resize(nq);
      for (int64_t r = ra; r < rb; ++r) {
        std::memcpy(&q[(r - ra) * gs * hd], call.q + (r0 + r) * q_dim + g * gs * hd, gs * hd * sizeof(float));
        for (int64_t h = 0; h < gs; ++h) outs[(r - ra) * gs + h] = call.out + (r0 + r) * q_dim + (g * gs + h) * hd;
      }
      const float* const* keys = scratch->keys.data() + g * n_keys + jmin;
      kernels::AttentionScores(q.data(), nq, hd, keys, ld, s.data(), ld);
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t r = qi / gs, a = j0[r] - jmin, e = j1[r] - jmin;
        float* row = &s[qi * ld];
        kernels::ScaledSoftmax(row + a, e - a, call.scale);
        std::fill(row, row + a, 0.0f);
        std::fill(row + e, row + ld, 0.0f);
      }
      kernels::AttentionWeightedSum(s.data(), ld, nq, scratch->values.data() + g * n_keys + jmin, ld, hd, outs.data());
    }
  });
}

}  // namespace dd::engine
