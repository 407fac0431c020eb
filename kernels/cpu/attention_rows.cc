#include "cpu/attention_rows.h"

#include <algorithm>
#include <cstring>

#include "dd/kernels/cpu_ops.h"

namespace dd::backend::cpu {
namespace {
constexpr int64_t kBlockRows = 16;

// Rows [r0, r0 + nr) of `a` see keys [j0, j1) of the concatenation starting at `lo`.
void VisibleKeys(const CausalAttention& a, int64_t r0, int64_t nr, int64_t lo, int64_t* j0, int64_t* j1) {
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t pos = a.positions[r0 + r];
    const int64_t first = a.sliding ? std::max<int64_t>(0, pos - a.window + 1) : 0;
    j0[r] = first - lo;
    j1[r] = pos - lo + 1;
  }
}

// The query heads of KV head g for rows [ra, rb) of `a`, contiguous (row-major, then head)
// in q, and where each one's output goes.
void GroupQueries(const CausalAttention& a, int64_t g, int64_t ra, int64_t rb, float* q, float** outs) {
  const AttentionShape& c = a.shape;
  const int64_t hd = c.head_dim, gs = c.n_head / c.n_head_kv, q_dim = c.n_head * hd;
  for (int64_t r = ra; r < rb; ++r) {
    std::memcpy(q + (r - ra) * gs * hd, a.q + r * q_dim + g * gs * hd, gs * hd * sizeof(float));
    for (int64_t h = 0; h < gs; ++h) outs[(r - ra) * gs + h] = a.out + r * q_dim + (g * gs + h) * hd;
  }
}

// Softmax of one query's scores over its visible keys [a, e) of a row of `ld`; 0 elsewhere.
void SoftmaxVisible(float* row, int64_t ld, int64_t a, int64_t e, float scale) {
  kernels::ScaledSoftmax(row + a, e - a, scale);
  std::fill(row, row + a, 0.0f);
  std::fill(row + e, row + ld, 0.0f);
}

constexpr int64_t kKeyTile = 256;  // keys per score task of the few-rows paths

// Head-dim elements per weighted-sum task: 64, halved (down to 16) until there are at least
// two tasks per thread.
int64_t PieceFor(int64_t hd, int64_t n_kv, const ThreadPool& pool) {
  int64_t piece = 64;
  while (piece > 16 && n_kv * ((hd + piece - 1) / piece) < 2 * pool.active()) piece /= 2;
  return piece;
}

// Few rows, all KV heads: scores in parallel over key tiles, softmax over queries, weighted
// sums over pieces of the head dimension. Same kernels, so the same bits as the blocked path.
void AttendFewRows(const CausalAttention& a, int64_t nr, int64_t n_keys, ThreadPool& pool,
                   AttentionScratch* scratch) {
  const int64_t hd = a.shape.head_dim, n_kv = a.shape.n_head_kv, gs = a.shape.n_head / n_kv;
  const int64_t nq = nr * gs;
  std::vector<int64_t>& j0 = scratch->j0;
  std::vector<int64_t>& j1 = scratch->j1;
  j0.resize(nr);
  j1.resize(nr);
  VisibleKeys(a, 0, nr, a.lo, j0.data(), j1.data());
  const int64_t jmin = *std::min_element(j0.begin(), j0.end()), jmax = *std::max_element(j1.begin(), j1.end());
  const int64_t ld = jmax - jmin;
  scratch->q.resize(n_kv * nq * hd);
  scratch->scores.resize(n_kv * nq * ld);
  scratch->outs.resize(n_kv * nq);
  for (int64_t g = 0; g < n_kv; ++g) {
    GroupQueries(a, g, 0, nr, &scratch->q[g * nq * hd], &scratch->outs[g * nq]);
  }
  const int64_t n_tiles = (ld + kKeyTile - 1) / kKeyTile;
  pool.ParallelFor(n_kv * n_tiles, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t g = t / n_tiles, jt = (t % n_tiles) * kKeyTile;
      kernels::AttentionScores(&scratch->q[g * nq * hd], nq, hd, scratch->keys.data() + g * n_keys + jmin + jt,
                               a.shape.kv, std::min(kKeyTile, ld - jt), &scratch->scores[g * nq * ld + jt], ld);
    }
  });
  pool.ParallelFor(n_kv * nq, [&](int64_t b, int64_t e) {
    for (int64_t qi = b; qi < e; ++qi) {
      const int64_t r = (qi % nq) / gs;
      SoftmaxVisible(&scratch->scores[qi * ld], ld, j0[r] - jmin, j1[r] - jmin, a.scale);
    }
  });
  const int64_t piece = PieceFor(hd, n_kv, pool);
  const int64_t n_pieces = (hd + piece - 1) / piece;
  pool.ParallelFor(n_kv * n_pieces, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t g = t / n_pieces, e0 = (t % n_pieces) * piece;
      kernels::AttentionWeightedSum(&scratch->scores[g * nq * ld], ld, nq,
                                    scratch->values.data() + g * n_keys + jmin, a.shape.kv, ld, e0,
                                    std::min(hd, e0 + piece), &scratch->outs[g * nq]);
    }
  });
}
}  // namespace

void AttendCausal(const CausalAttention& a, ThreadPool& pool, AttentionScratch* scratch) {
  const int64_t hd = a.shape.head_dim, n_kv = a.shape.n_head_kv, gs = a.shape.n_head / n_kv;
  const int64_t kv_dim = n_kv * hd, nr = static_cast<int64_t>(a.positions.size());
  const int64_t eb = KvDtypeBytes(a.shape.kv);
  int64_t n_keys = 0;
  for (const KvRun& run : a.runs) n_keys += run.len;
  // Key j of the concatenation, per KV head g: keys[g * n_keys + j].
  scratch->keys.resize(n_kv * n_keys);
  scratch->values.resize(n_kv * n_keys);
  for (int64_t g = 0, j = 0; g < n_kv; ++g) {
    for (const KvRun& run : a.runs) {
      for (int64_t t = 0; t < run.len; ++t, ++j) {
        const int64_t at = (t * kv_dim + g * hd) * eb;
        scratch->keys[j] = static_cast<const char*>(run.k) + at;
        scratch->values[j] = static_cast<const char*>(run.v) + at;
      }
    }
  }
  const int64_t n_blocks = (nr + kBlockRows - 1) / kBlockRows;
  if (n_kv * n_blocks < 2 * pool.active()) {
    AttendFewRows(a, nr, n_keys, pool, scratch);
    return;
  }
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
      VisibleKeys(a, ra, rb - ra, a.lo, j0, j1);
      const int64_t jmin = *std::min_element(j0, j0 + (rb - ra));
      const int64_t jmax = *std::max_element(j1, j1 + (rb - ra));
      const int64_t ld = jmax - jmin;
      q.resize(nq * hd);
      s.resize(nq * ld);
      outs.resize(nq);
      GroupQueries(a, g, ra, rb, q.data(), outs.data());
      const void* const* keys = scratch->keys.data() + g * n_keys + jmin;
      kernels::AttentionScores(q.data(), nq, hd, keys, a.shape.kv, ld, s.data(), ld);
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t r = qi / gs;
        SoftmaxVisible(&s[qi * ld], ld, j0[r] - jmin, j1[r] - jmin, a.scale);
      }
      kernels::AttentionWeightedSum(s.data(), ld, nq, scratch->values.data() + g * n_keys + jmin, a.shape.kv, ld, 0,
                                    hd, outs.data());
    }
  });
}

void AttendGroups(absl::Span<const AttentionGroup> groups, const AttentionShape& shape, float scale, ThreadPool& pool,
                  AttentionScratch* scratch) {
  const int64_t hd = shape.head_dim, n_kv = shape.n_head_kv, gs = shape.n_head / n_kv;
  const int64_t n_groups = static_cast<int64_t>(groups.size()), n_pairs = n_groups * n_kv;
  if (n_groups == 0) return;
  // Pair p = (group i, KV head g), p = i * n_kv + g. Its queries are the group's rows' query
  // heads of g (nq = rows × gs); its scores nq rows of lists[g].n floats at scores[offset[p]];
  // its score tasks start at first_tile[p]; its queries at first_query[p] of the flat order.
  std::vector<int64_t>& offset = scratch->offsets;  // kept across calls: this runs per layer
  std::vector<int64_t>& first_tile = scratch->first_tiles;
  std::vector<int64_t>& first_query = scratch->first_queries;
  offset.assign(n_pairs + 1, 0);
  first_tile.assign(n_pairs + 1, 0);
  first_query.assign(n_pairs + 1, 0);
  int64_t q_floats = 0;
  for (int64_t i = 0; i < n_groups; ++i) {
    const int64_t nq = static_cast<int64_t>(groups[i].rows.size()) * gs;
    if (groups[i].rows.size() > 1) q_floats += n_kv * nq * hd;
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t p = i * n_kv + g, n = groups[i].lists[g].n;
      offset[p + 1] = offset[p] + nq * n;
      first_tile[p + 1] = first_tile[p] + (n + kKeyTile - 1) / kKeyTile;
      first_query[p + 1] = first_query[p] + nq;
    }
  }
  scratch->scores.resize(offset[n_pairs]);
  scratch->outs.resize(first_query[n_pairs]);
  scratch->q.resize(q_floats);
  // Each pair's queries contiguous, row by row, outputs likewise. A group of one row already
  // has each KV head's query heads contiguous in its query (the common case: no copy).
  scratch->group_q.resize(n_pairs);
  for (int64_t i = 0, q_at = 0; i < n_groups; ++i) {
    const absl::Span<const ListQuery> rows = groups[i].rows;
    const int64_t nr = static_cast<int64_t>(rows.size());
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t p = i * n_kv + g;
      if (nr > 1) {
        for (int64_t r = 0; r < nr; ++r) {
          std::memcpy(&scratch->q[q_at + r * gs * hd], rows[r].q + g * gs * hd, gs * hd * sizeof(float));
        }
        scratch->group_q[p] = &scratch->q[q_at];
        q_at += nr * gs * hd;
      } else {
        scratch->group_q[p] = rows[0].q + g * gs * hd;
      }
      for (int64_t r = 0; r < nr; ++r) {
        for (int64_t h = 0; h < gs; ++h) scratch->outs[first_query[p] + r * gs + h] = rows[r].out + (g * gs + h) * hd;
      }
    }
  }
  auto pair_of = [](const std::vector<int64_t>& starts, int64_t t) {
    return std::upper_bound(starts.begin(), starts.end(), t) - starts.begin() - 1;
  };
  pool.ParallelFor(first_tile[n_pairs], [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t p = pair_of(first_tile, t);
      const KeyValueList& list = groups[p / n_kv].lists[p % n_kv];
      const int64_t j = (t - first_tile[p]) * kKeyTile, nq = first_query[p + 1] - first_query[p];
      kernels::AttentionScores(scratch->group_q[p], nq, hd, list.keys + j, shape.kv, std::min(kKeyTile, list.n - j),
                               &scratch->scores[offset[p] + j], list.n);
    }
  });
  pool.ParallelFor(first_query[n_pairs], [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t p = pair_of(first_query, t), i = p / n_kv, qi = t - first_query[p];
      const int64_t n = groups[i].lists[p % n_kv].n;
      const int64_t visible = std::max<int64_t>(0, n - groups[i].rows[qi / gs].hidden_tail);
      SoftmaxVisible(&scratch->scores[offset[p] + qi * n], n, 0, visible, scale);
    }
  });
  const int64_t piece = PieceFor(hd, n_pairs, pool);
  const int64_t n_pieces = (hd + piece - 1) / piece;
  pool.ParallelFor(n_pairs * n_pieces, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t p = t / n_pieces, e0 = (t % n_pieces) * piece;
      const KeyValueList& list = groups[p / n_kv].lists[p % n_kv];
      const int64_t nq = first_query[p + 1] - first_query[p];
      kernels::AttentionWeightedSum(&scratch->scores[offset[p]], list.n, nq, list.values, shape.kv, list.n, e0,
                                    std::min(hd, e0 + piece), &scratch->outs[first_query[p]]);
    }
  });
}

}  // namespace dd::backend::cpu
