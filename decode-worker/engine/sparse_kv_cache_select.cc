// SparseKvCache's chunk selection for a layer's decode reads, batch-wide: every read's landmark
// scores are enqueued (one KeyScores call per KV head into the sequence's score buffer), come
// to the host together — read in place where the host may, else one copy per read and one sync
// — and top-k runs on the host; then the speculative rows' predictions, which start from the
// real rows' shortlists, the same way. Two syncs per layer for the batch, not two per sequence.
// The scores and the top-k are those of one sequence at a time, so the same bits and choices.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/sparse_kv_cache.h"

namespace dd::engine {

int64_t SparseKvCache::ScoresBytes(const model::ModelConfig& config, const SparseOptions& options,
                                   int64_t total_tokens) {
  // Every KV head's query heads × every selectable chunk of the request.
  return config.n_head * (total_tokens / options.chunk_tokens + 1) * static_cast<int64_t>(sizeof(float));
}

void SparseKvCache::ScoreChunks(const Seq& s, const LayerState& st, const float* q, const Window& w,
                                const Selection* candidates, Selection* cands) {
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  cands->resize(n_kv);
  thread_local std::vector<const float*> landmarks;
  float* scores = static_cast<float*>(s.scores.data);
  for (int64_t g = 0; g < n_kv; ++g) {
    std::vector<int64_t>& chunks = (*cands)[g];
    chunks.clear();
    if (candidates != nullptr) {
      chunks = (*candidates)[g];
    } else {
      for (int64_t c = w.sel_begin; c < w.sel_end; ++c) chunks.push_back(c);
    }
    const int64_t n_cand = static_cast<int64_t>(chunks.size());
    landmarks.resize(n_cand);
    for (int64_t i = 0; i < n_cand; ++i) landmarks[i] = LandmarkAt(st, chunks[i], g);
    // The group's gs query heads in one blocked call (Dot's bits per pair).
    ops_.KeyScores(q + g * gs * hd, gs, hd, landmarks.data(), n_cand, scores + g * s.score_stride, n_cand);
  }
}

absl::Status SparseKvCache::ScoresToHost(bool predictions) {
  if (host_visible_) return absl::OkStatus();
  const int64_t n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  bool any = false;
  for (size_t i = 0; i < n_reads_; ++i) {
    DecodeRead& r = reads_[i];
    if (predictions && !r.predict_pending) continue;
    const Selection& cands = predictions ? r.spec_cands : r.cands;
    const Seq& s = seqs_[r.seq];
    const int64_t used = (n_kv - 1) * s.score_stride + gs * static_cast<int64_t>(cands[n_kv - 1].size());
    r.scores_host.resize(used);
    RETURN_IF_ERROR(device_.CopyToHost(backend::Queue::kCompute, s.scores, 0, r.scores_host.data(),
                                       used * static_cast<int64_t>(sizeof(float))));
    any = true;
  }
  return any ? device_.Synchronize(device_.Record(backend::Queue::kCompute)) : absl::OkStatus();
}

const float* SparseKvCache::ScoresOf(const Seq& s, const DecodeRead& r) const {
  return host_visible_ ? static_cast<const float*>(s.scores.data) : r.scores_host.data();
}

SparseKvCache::Selection SparseKvCache::TopChunks(const float* scores, int64_t stride, const Selection& cands,
                                                  Selection* ranked, Selection* shortlist) const {
  const int64_t n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  const int64_t k_sel = options_.budget_tokens / options_.chunk_tokens;
  const int64_t k_short = options_.spec_candidates * k_sel;
  // Score order: higher first, ties by lower chunk index (a strict total order, so the top k
  // of the top k_short are the top k), as one integer key per chunk, smaller = better: the
  // score's bits mapped to an unsigned order (−0 counted as +0, so they tie as floats do),
  // inverted, above the chunk index. nth_element on these is several times faster than on
  // (score, chunk) pairs with a comparator.
  const auto key_of = [](float score, int64_t chunk) {
    uint32_t u;
    const float canonical = score + 0.0f;  // −0 → +0
    std::memcpy(&u, &canonical, sizeof(u));
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with the float
    return (static_cast<uint64_t>(~u) << 32) | static_cast<uint32_t>(chunk);
  };
  const auto chunk_of = [](uint64_t key) { return static_cast<int64_t>(key & 0xffffffffu); };
  // A chunk index is below the position count (a chunk holds at least one token), so it fits
  // the key's low 32 bits.
  static_assert(model::ModelConfig::kMaxContext <= (int64_t{1} << 32), "chunk index outgrows the key's low 32 bits");
  Selection sel(n_kv);
  if (shortlist != nullptr) shortlist->resize(n_kv);  // each head's list cleared below (capacity kept)
  if (ranked != nullptr) ranked->resize(n_kv);
  thread_local std::vector<uint64_t> cand;
  for (int64_t g = 0; g < n_kv; ++g) {
    const std::vector<int64_t>& chunks = cands[g];
    const int64_t n_cand = static_cast<int64_t>(chunks.size());
    const float* head = scores + g * stride;
    cand.resize(n_cand);
    for (int64_t i = 0; i < n_cand; ++i) {
      float best = -INFINITY;
      for (int64_t h = 0; h < gs; ++h) best = std::max(best, head[h * n_cand + i]);
      cand[i] = key_of(best, chunks[i]);
    }
    if (shortlist != nullptr) {
      (*shortlist)[g].clear();
      if (static_cast<int64_t>(cand.size()) > k_short) std::nth_element(cand.begin(), cand.begin() + k_short, cand.end());
      const int64_t n_short = std::min<int64_t>(k_short, static_cast<int64_t>(cand.size()));
      for (int64_t i = 0; i < n_short; ++i) (*shortlist)[g].push_back(chunk_of(cand[i]));
      cand.resize(n_short);
    }
    if (static_cast<int64_t>(cand.size()) > k_sel) {
      std::nth_element(cand.begin(), cand.begin() + k_sel, cand.end());
      cand.resize(k_sel);
    }
    for (uint64_t key : cand) sel[g].push_back(chunk_of(key));
    std::sort(sel[g].begin(), sel[g].end());
    if (ranked != nullptr) {
      std::sort(cand.begin(), cand.end());
      (*ranked)[g].clear();
      for (uint64_t key : cand) (*ranked)[g].push_back(chunk_of(key));
    }
  }
  return sel;
}

SparseKvCache::Selection SparseKvCache::UnionOf(const Selection& a, const Selection& b, const Window& w) const {
  const size_t k = static_cast<size_t>(options_.budget_tokens / options_.chunk_tokens);
  Selection out(a.size());
  for (size_t g = 0; g < a.size(); ++g) {
    std::vector<int64_t>& o = out[g];
    auto take = [&](int64_t c) {
      if (c >= w.sel_begin && c < w.sel_end && o.size() < k && std::find(o.begin(), o.end(), c) == o.end()) o.push_back(c);
    };
    const std::vector<int64_t>& bg = g < b.size() ? b[g] : a[g];
    for (size_t i = 0; i < std::max(a[g].size(), bg.size()) && o.size() < k; ++i) {
      if (i < a[g].size()) take(a[g][i]);
      if (i < bg.size()) take(bg[i]);
    }
    std::sort(o.begin(), o.end());
  }
  return out;
}

void SparseKvCache::ScorePrediction(Seq& s, const model::AttentionCall& call, DecodeRead& r) {
  LayerState& st = s.layers[call.layer];
  const bool after_real = r.real_row >= 0;
  const int64_t pos = call.rows[r.spec_row].pos;
  const float* q = call.q + r.spec_row * config_.n_head * config_.head_dim;
  st.seeded = !after_real;
  // Predicted selection for the next step, whose real row sits at `pos`.
  r.next = WindowFor(pos + 1);
  if (after_real && options_.predictor == Predictor::kPrevious) {
    r.predicted = UnionOf(r.ranked, r.ranked, r.next);  // the real row's S, within the next window
    return;
  }
  // After a real row (which kept its shortlist): its best chunks plus those selectable only
  // from the next step on (at most one chunk more).
  const Selection* candidates = nullptr;
  if (after_real && options_.spec_candidates > 0) {
    const int64_t real_end = WindowFor(pos).sel_end;
    for (auto& list : r.shortlist) {
      for (int64_t c = real_end; c < r.next.sel_end; ++c) list.push_back(c);
    }
    candidates = &r.shortlist;
  }
  ScoreChunks(s, st, q, r.next, candidates, &r.spec_cands);
  r.predict_pending = true;
}

void SparseKvCache::FinishPrediction(const Seq& s, DecodeRead& r) {
  r.predict_pending = false;
  const bool union_of = options_.predictor == Predictor::kUnion;
  Selection ranked;
  r.predicted = TopChunks(ScoresOf(s, r), s.score_stride, r.spec_cands, union_of ? &ranked : nullptr, nullptr);
  if (r.real_row >= 0 && union_of) r.predicted = UnionOf(ranked, r.ranked, r.next);
}

absl::Status SparseKvCache::SelectAndStart(const model::AttentionCall& call) {
  RETURN_IF_ERROR(ScoresToHost(/*predictions=*/false));
  bool predictions = false;
  for (size_t i = 0; i < n_reads_; ++i) {
    DecodeRead& r = reads_[i];
    Seq& s = seqs_[r.seq];
    const bool spec_follows = r.real_row >= 0 && r.spec_row >= 0;
    const bool rank = spec_follows && (options_.predictor == Predictor::kPrevious || options_.predictor == Predictor::kUnion);
    const bool shortlist = spec_follows && options_.spec_candidates > 0;
    r.sel = TopChunks(ScoresOf(s, r), s.score_stride, r.cands, rank ? &r.ranked : nullptr,
                      shortlist ? &r.shortlist : nullptr);
    if (r.real_row >= 0) {
      RETURN_IF_ERROR(StartRealRead(s, call, r));
    } else {
      RETURN_IF_ERROR(StartPreDecodeRead(s, call, r));
    }
    // Scored after the read's own scores were taken (they share the buffer).
    if (r.spec_row >= 0) ScorePrediction(s, call, r);
    predictions = predictions || r.predict_pending;
  }
  if (!predictions) return absl::OkStatus();
  RETURN_IF_ERROR(ScoresToHost(/*predictions=*/true));
  for (size_t i = 0; i < n_reads_; ++i) {
    if (reads_[i].predict_pending) FinishPrediction(seqs_[reads_[i].seq], reads_[i]);
  }
  return absl::OkStatus();
}

}  // namespace dd::engine
