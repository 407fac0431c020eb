// The sim device's ops: each call is compute-queue work that runs the cpu kernels and declares
// the ranges it reads and writes, weights included (host memory is not checked). Host spans
// and pointer lists are copied at the call, since the caller may reuse them once it returns.
#include <algorithm>
#include <memory>
#include <vector>

#include "sim/sim_device.h"

namespace dd::backend::sim {
namespace {

constexpr int64_t kF = sizeof(float);

// Rows of `width` floats `stride` apart: the span from the first to the end of the last.
int64_t RowsBytes(int64_t n_rows, int64_t stride, int64_t width) {
  return n_rows > 0 ? ((n_rows - 1) * stride + width) * kF : 0;
}

int64_t MatrixBytes(const kernels::WeightView& w) { return w.rows * w.row_bytes; }

}  // namespace

void SimOps::Embed(const kernels::WeightView& table, absl::Span<const int32_t> tokens, float scale, float* x) {
  Accesses acc;
  acc.Read(table.data, MatrixBytes(table));
  acc.Write(x, static_cast<int64_t>(tokens.size()) * table.cols * kF);
  std::vector<int32_t> t(tokens.begin(), tokens.end());
  device_.Submit(Queue::kCompute, "Embed", std::move(acc),
                 [this, table, t, scale, x] { cpu_.Embed(table, t, scale, x); });
}

void SimOps::RopeAngles(const float* inv_freq, int64_t half, absl::Span<const int64_t> positions, float* cos,
                        float* sin) {
  Accesses acc;
  const int64_t n = static_cast<int64_t>(positions.size());
  acc.Write(cos, n * half * kF);
  acc.Write(sin, n * half * kF);
  std::vector<int64_t> p(positions.begin(), positions.end());
  std::vector<float> f(inv_freq, inv_freq + half);
  device_.Submit(Queue::kCompute, "RopeAngles", std::move(acc),
                 [this, f, half, p, cos, sin] { cpu_.RopeAngles(f.data(), half, p, cos, sin); });
}

void SimOps::RmsNormRows(const float* x, const float* w, float eps, int64_t n_rows, int64_t d, float* y) {
  Accesses acc;
  acc.Read(x, n_rows * d * kF);
  if (w != nullptr) acc.Read(w, d * kF);
  acc.Write(y, n_rows * d * kF);
  device_.Submit(Queue::kCompute, "RmsNormRows", std::move(acc),
                 [this, x, w, eps, n_rows, d, y] { cpu_.RmsNormRows(x, w, eps, n_rows, d, y); });
}

void SimOps::RmsNormSelected(const float* x, absl::Span<const int64_t> rows, const float* w, float eps, int64_t d,
                             float* y) {
  Accesses acc;
  for (int64_t r : rows) acc.Read(x + r * d, d * kF);
  if (w != nullptr) acc.Read(w, d * kF);
  acc.Write(y, static_cast<int64_t>(rows.size()) * d * kF);
  std::vector<int64_t> list(rows.begin(), rows.end());
  device_.Submit(Queue::kCompute, "RmsNormSelected", std::move(acc),
                 [this, x, list, w, eps, d, y] { cpu_.RmsNormSelected(x, list, w, eps, d, y); });
}

void SimOps::Linear(const kernels::WeightView& w, LinearKind kind, const float* x, int64_t n_rows, int64_t x_stride,
                    const float* bias, float* y, int64_t y_stride) {
  Accesses acc;
  acc.Read(w.data, MatrixBytes(w));
  acc.Read(x, RowsBytes(n_rows, x_stride, w.cols));
  if (bias != nullptr) acc.Read(bias, w.rows * kF);
  acc.Write(y, RowsBytes(n_rows, y_stride, w.rows));
  device_.Submit(Queue::kCompute, "Linear", std::move(acc), [this, w, kind, x, n_rows, x_stride, bias, y, y_stride] {
    cpu_.Linear(w, kind, x, n_rows, x_stride, bias, y, y_stride);
  });
}

void SimOps::HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                          const float* norm_w, float eps, const float* cos, const float* sin, int64_t half,
                          bool neox) {
  Accesses acc;
  acc.Read(x, RowsBytes(n_rows, row_stride, n_heads * head_dim));
  acc.Write(x, RowsBytes(n_rows, row_stride, n_heads * head_dim));
  if (norm_w != nullptr) acc.Read(norm_w, head_dim * kF);
  acc.Read(cos, n_rows * half * kF);
  acc.Read(sin, n_rows * half * kF);
  device_.Submit(Queue::kCompute, "HeadNormRope", std::move(acc),
                 [this, x, n_rows, row_stride, n_heads, head_dim, norm_w, eps, cos, sin, half, neox] {
                   cpu_.HeadNormRope(x, n_rows, row_stride, n_heads, head_dim, norm_w, eps, cos, sin, half, neox);
                 });
}

void SimOps::GatedMul(GatedActivation act, const float* gate, const float* up, float* out, int64_t n_rows,
                      int64_t n) {
  Accesses acc;
  acc.Read(gate, n_rows * n * kF);
  acc.Read(up, n_rows * n * kF);
  acc.Write(out, n_rows * n * kF);
  device_.Submit(Queue::kCompute, "GatedMul", std::move(acc),
                 [this, act, gate, up, out, n_rows, n] { cpu_.GatedMul(act, gate, up, out, n_rows, n); });
}

void SimOps::Add(float* x, const float* y, int64_t n) {
  Accesses acc;
  acc.Read(x, n * kF);
  acc.Read(y, n * kF);
  acc.Write(x, n * kF);
  device_.Submit(Queue::kCompute, "Add", std::move(acc), [this, x, y, n] { cpu_.Add(x, y, n); });
}

void SimOps::Softcap(float* x, int64_t n, float cap) {
  Accesses acc;
  acc.Read(x, n * kF);
  acc.Write(x, n * kF);
  device_.Submit(Queue::kCompute, "Softcap", std::move(acc), [this, x, n, cap] { cpu_.Softcap(x, n, cap); });
}

void SimOps::AttendCausal(const CausalAttention& a) {
  const int64_t q_dim = a.shape.n_head * a.shape.head_dim, kv_dim = a.shape.n_head_kv * a.shape.head_dim;
  const int64_t n = static_cast<int64_t>(a.positions.size()), eb = KvDtypeBytes(a.shape.kv);
  Accesses acc;
  acc.Read(a.q, n * q_dim * kF);
  for (const KvRun& run : a.runs) {
    acc.Read(run.k, run.len * kv_dim * eb);
    acc.Read(run.v, run.len * kv_dim * eb);
  }
  acc.Write(a.out, n * q_dim * kF);
  std::vector<int64_t> positions(a.positions.begin(), a.positions.end());
  std::vector<KvRun> runs(a.runs.begin(), a.runs.end());
  // The test fault: a lone decode row sees its keys up to the one before its own (the runs end
  // at the row's position, so the last run loses one key), where the window still starts at or
  // after lo and a key is left to see.
  const int64_t first_before =
      positions.size() == 1 ? (a.sliding ? std::max<int64_t>(0, positions[0] - a.window) : 0) : 0;
  if (fault_ == SimFault::kDecodeAttentionOffByOne && positions.size() == 1 && !runs.empty() &&
      positions[0] > a.lo && first_before >= a.lo) {
    positions[0] -= 1;
    if (--runs.back().len == 0) runs.pop_back();
  }
  device_.Submit(Queue::kCompute, "AttendCausal", std::move(acc), [this, a, positions, runs] {
    CausalAttention copy = a;
    copy.positions = positions;
    copy.runs = runs;
    cpu_.AttendCausal(copy);
  });
}

void SimOps::AttendGroups(absl::Span<const AttentionGroup> groups, const AttentionShape& shape, float scale) {
  const int64_t hd = shape.head_dim, q_dim = shape.n_head * hd, eb = KvDtypeBytes(shape.kv);
  // Deep copies: rows, lists and their key / value pointer arrays.
  struct Copy {
    std::vector<std::vector<ListQuery>> rows;
    std::vector<std::vector<const void*>> keys, values;
    std::vector<std::vector<KeyValueList>> lists;
  };
  auto copy = std::make_shared<Copy>();
  Accesses acc;
  for (const AttentionGroup& g : groups) {
    copy->rows.emplace_back(g.rows.begin(), g.rows.end());
    if (fault_ == SimFault::kDecodeAttentionOffByOne) {  // the test fault: each row's newest key unseen
      for (ListQuery& r : copy->rows.back()) {
        bool spare = true;
        for (const KeyValueList& l : g.lists) spare = spare && l.n > r.hidden_tail + 1;
        if (spare) ++r.hidden_tail;
      }
    }
    for (const ListQuery& r : g.rows) {
      acc.Read(r.q, q_dim * kF);
      acc.Write(r.out, q_dim * kF);
    }
    copy->lists.emplace_back();
    for (const KeyValueList& l : g.lists) {
      copy->keys.emplace_back(l.keys, l.keys + l.n);
      copy->values.emplace_back(l.values, l.values + l.n);
      copy->lists.back().push_back({copy->keys.back().data(), copy->values.back().data(), l.n});
      for (int64_t j = 0; j < l.n; ++j) {
        acc.Read(l.keys[j], hd * eb);
        acc.Read(l.values[j], hd * eb);
      }
    }
  }
  device_.Submit(Queue::kCompute, "AttendGroups", std::move(acc), [this, copy, shape, scale] {
    std::vector<AttentionGroup> g;
    for (size_t i = 0; i < copy->rows.size(); ++i) g.push_back({copy->rows[i], copy->lists[i]});
    cpu_.AttendGroups(g, shape, scale);
  });
}

void SimOps::KeyScores(const float* q, int64_t nq, int64_t head_dim, const float* const* keys, int64_t nk, float* s,
                       int64_t ld) {
  Accesses acc;
  acc.Read(q, nq * head_dim * kF);
  for (int64_t j = 0; j < nk; ++j) acc.Read(keys[j], head_dim * kF);
  acc.Write(s, RowsBytes(nq, ld, nk));
  std::vector<const float*> k(keys, keys + nk);
  device_.Submit(Queue::kCompute, "KeyScores", std::move(acc),
                 [this, q, nq, head_dim, k, nk, s, ld] { cpu_.KeyScores(q, nq, head_dim, k.data(), nk, s, ld); });
}

void SimOps::ChunkMeans(const void* const* rows, KvDtype t, int64_t n, int64_t chunk, int64_t kv_dim, float* out) {
  Accesses acc;
  for (int64_t i = 0; i < n * chunk; ++i) acc.Read(rows[i], kv_dim * KvDtypeBytes(t));
  acc.Write(out, n * kv_dim * kF);
  std::vector<const void*> list(rows, rows + n * chunk);
  device_.Submit(Queue::kCompute, "ChunkMeans", std::move(acc),
                 [this, list, t, n, chunk, kv_dim, out] { cpu_.ChunkMeans(list.data(), t, n, chunk, kv_dim, out); });
}

void SimOps::StoreKv(const float* x, int64_t n, KvDtype t, void* out) {
  Accesses acc;
  acc.Read(x, n * kF);
  acc.Write(out, n * KvDtypeBytes(t));
  device_.Submit(Queue::kCompute, "StoreKv", std::move(acc), [this, x, n, t, out] { cpu_.StoreKv(x, n, t, out); });
}

int64_t SimOps::KvOverflows() { return cpu_.KvOverflows(); }

void SimOps::ProjectKeys(const LowRankKeys& f, const void* const* rows, absl::Span<const int64_t> positions,
                         float* out) {
  const int64_t n = static_cast<int64_t>(positions.size());
  Accesses acc;
  acc.Read(f.basis, f.rank * f.kv_dim() * kF);
  for (int64_t i = 0; i < n; ++i) acc.Read(rows[i], f.kv_dim() * KvDtypeBytes(f.kv));
  acc.Write(out, n * f.rank * kF);
  std::vector<const void*> list(rows, rows + n);
  std::vector<int64_t> pos(positions.begin(), positions.end());
  std::vector<float> freq(f.inv_freq, f.inv_freq + f.half);  // host memory, read at the call
  device_.Submit(Queue::kCompute, "ProjectKeys", std::move(acc), [this, f, list, pos, freq, out] {
    LowRankKeys g = f;
    g.inv_freq = freq.data();
    cpu_.ProjectKeys(g, list.data(), pos, out);
  });
}

void SimOps::ReconstructKeys(const LowRankKeys& f, const float* const* coeffs, absl::Span<const int64_t> first,
                             absl::Span<const int32_t> heads, int64_t chunk, void* const* out) {
  const int64_t n = static_cast<int64_t>(first.size());
  Accesses acc;
  acc.Read(f.basis, f.rank * f.kv_dim() * kF);
  for (int64_t i = 0; i < n; ++i) {
    acc.Read(coeffs[i], chunk * f.rank * kF);
    acc.Write(out[i], chunk * f.head_dim * KvDtypeBytes(f.kv));
  }
  std::vector<const float*> from(coeffs, coeffs + n);
  std::vector<int64_t> firsts(first.begin(), first.end());
  std::vector<int32_t> hs(heads.begin(), heads.end());
  std::vector<void*> to(out, out + n);
  std::vector<float> freq(f.inv_freq, f.inv_freq + f.half);
  device_.Submit(Queue::kCompute, "ReconstructKeys", std::move(acc), [this, f, from, firsts, hs, chunk, to, freq] {
    LowRankKeys g = f;
    g.inv_freq = freq.data();
    cpu_.ReconstructKeys(g, from.data(), firsts, hs, chunk, to.data());
  });
}

void SimOps::TopChunks(absl::Span<const ChunkScores> lists, int64_t rows, int64_t k) {
  // Deep copies: the lists and their chunk ids (host memory, read when the work runs).
  struct Copy {
    std::vector<std::vector<int64_t>> chunks;
    std::vector<ChunkScores> lists;
  };
  auto copy = std::make_shared<Copy>();
  Accesses acc;
  for (const ChunkScores& l : lists) {
    const int64_t n = static_cast<int64_t>(l.chunks.size());
    acc.Read(l.scores, rows * n * kF);
    acc.Write(l.ids, std::min(n, l.take) * static_cast<int64_t>(sizeof(int64_t)));
    copy->chunks.emplace_back(l.chunks.begin(), l.chunks.end());
  }
  for (size_t i = 0; i < lists.size(); ++i) {
    ChunkScores l = lists[i];
    l.chunks = copy->chunks[i];
    copy->lists.push_back(l);
  }
  device_.Submit(Queue::kCompute, "TopChunks", std::move(acc), [this, copy, rows, k] { cpu_.TopChunks(copy->lists, rows, k); });
}

void SimOps::DequantizeRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, float* out) {
  Accesses acc;
  acc.Read(w.data, MatrixBytes(w));
  acc.Write(out, static_cast<int64_t>(ids.size()) * w.cols * kF);
  std::vector<int32_t> list(ids.begin(), ids.end());
  device_.Submit(Queue::kCompute, "DequantizeRows", std::move(acc),
                 [this, w, list, out] { cpu_.DequantizeRows(w, list, out); });
}

void SimOps::DotRows(absl::Span<const float* const> rows, const float* x, int64_t d, float* out) {
  Accesses acc;
  for (const float* r : rows) acc.Read(r, d * kF);
  acc.Read(x, d * kF);
  acc.Write(out, static_cast<int64_t>(rows.size()) * kF);
  std::vector<const float*> list(rows.begin(), rows.end());
  device_.Submit(Queue::kCompute, "DotRows", std::move(acc), [this, list, x, d, out] { cpu_.DotRows(list, x, d, out); });
}

void SimOps::ScoreRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, const float* x, float* out) {
  Accesses acc;
  acc.Read(w.data, MatrixBytes(w));
  acc.Read(x, w.cols * kF);
  acc.Write(out, static_cast<int64_t>(ids.size()) * kF);
  std::vector<int32_t> list(ids.begin(), ids.end());
  device_.Submit(Queue::kCompute, "ScoreRows", std::move(acc), [this, w, list, x, out] { cpu_.ScoreRows(w, list, x, out); });
}

void SimOps::ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) {
  Accesses acc;
  acc.Read(x, rows * n * kF);
  acc.Write(out, rows * static_cast<int64_t>(sizeof(int32_t)));
  device_.Submit(Queue::kCompute, "ArgmaxRows", std::move(acc), [this, x, rows, n, out] { cpu_.ArgmaxRows(x, rows, n, out); });
}

}  // namespace dd::backend::sim
