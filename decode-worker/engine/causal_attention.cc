#include "decode-worker/engine/causal_attention.h"

#include <algorithm>
#include <cstring>

#include "dd/kernels/cpu_ops.h"

namespace dd::engine {

void AttendCausal(const model::AttentionCall& call, const model::ModelConfig& config, int64_t r0, int64_t r1,
                  int64_t lo, absl::Span<const KvRun> runs, ThreadPool& pool, AttentionScratch* scratch) {
  const int64_t hd = config.head_dim, n_kv = config.n_head_kv, gs = config.n_head / n_kv;
  const int64_t kv_dim = n_kv * hd, q_dim = config.n_head * hd;
  const int64_t nr = r1 - r0, nq = nr * gs;  // query vectors per KV head
  int64_t n_keys = 0;
  for (const KvRun& run : runs) n_keys += run.len;
  scratch->q.resize(nq * hd);
  scratch->scores.resize(nq * n_keys);
  for (int64_t g = 0; g < n_kv; ++g) {
    for (int64_t r = 0; r < nr; ++r) {
      std::memcpy(&scratch->q[r * gs * hd], call.q + (r0 + r) * q_dim + g * gs * hd, gs * hd * sizeof(float));
    }
    int64_t col = 0;
    for (const KvRun& run : runs) {
      if (run.len == 0) continue;
      kernels::WeightView keys{kernels::DType::kF32, reinterpret_cast<const uint8_t*>(run.k + g * hd), run.len, hd,
                               kv_dim * static_cast<int64_t>(sizeof(float))};
      kernels::MatMul(keys, scratch->q.data(), nq, hd, nullptr, scratch->scores.data() + col, n_keys, pool);
      col += run.len;
    }
    // Softmax per query, then P·V. Queries go in blocks that share each V row while it is in
    // L1 (the gs heads of a row see the same keys; neighbouring rows nearly so); every query
    // still accumulates its keys in ascending order, so a row's result does not depend on the
    // block it lands in.
    constexpr int64_t kBlock = 8;
    pool.ParallelFor((nq + kBlock - 1) / kBlock, [&](int64_t bb, int64_t be) {
      for (int64_t qb = bb * kBlock; qb < std::min(nq, be * kBlock); qb += kBlock) {
        const int64_t qe = std::min(nq, qb + kBlock);
        int64_t lo_j[kBlock], hi_j[kBlock], jmin = n_keys, jmax = 0;
        float* outs[kBlock];
        for (int64_t qi = qb; qi < qe; ++qi) {
          const int64_t r = qi / gs, h = g * gs + qi % gs;
          const int64_t pos = call.rows[r0 + r].pos;
          const int64_t first = call.sliding ? std::max<int64_t>(0, pos - call.window + 1) : 0;
          const int64_t j0 = first - lo, j1 = pos - lo + 1;  // visible keys [j0, j1)
          kernels::ScaledSoftmax(&scratch->scores[qi * n_keys] + j0, j1 - j0, call.scale);
          float* out = call.out + (r0 + r) * q_dim + h * hd;
          std::fill(out, out + hd, 0.0f);
          lo_j[qi - qb] = j0;
          hi_j[qi - qb] = j1;
          outs[qi - qb] = out;
          jmin = std::min(jmin, j0);
          jmax = std::max(jmax, j1);
        }
        // Walk the runs in order; key j of the concatenation is row (j - run_begin) of its run.
        size_t ri = 0;
        int64_t run_begin = 0;
        for (int64_t j = jmin; j < jmax; ++j) {
          while (j >= run_begin + runs[ri].len) run_begin += runs[ri++].len;
          const float* v = runs[ri].v + (j - run_begin) * kv_dim + g * hd;
          for (int64_t k = 0; k < qe - qb; ++k) {
            if (j >= lo_j[k] && j < hi_j[k]) kernels::Axpy(scratch->scores[(qb + k) * n_keys + j], v, outs[k], hd);
          }
        }
      }
    });
  }
}

}  // namespace dd::engine
