// SparseKvCache's chunk selection for a layer's decode reads, batch-wide: for every read, its
// landmark scores (one KeyScores call per KV head) and its top chunks (one TopChunks call, a
// list per KV head) go to the sequence's selection buffer on the device; the chosen ids come to
// the host together — read in place where the host may, else one copy per read and one sync —
// and the transfers start; then the speculative rows' predictions, which start from the real
// rows' shortlists, the same way. Two syncs per layer for the batch, not two per sequence, and
// only ids cross. The same scores and the same order as one sequence at a time: the same
// choices.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/sparse_kv_cache.h"

namespace dd::engine {

namespace {
// A sequence's selection buffer: the scores of every KV head's query heads × every chunk, then
// (64-byte aligned) a chunk id per KV head and chunk.
int64_t ScoresPart(const model::ModelConfig& config, int64_t chunks) {
  const int64_t bytes = config.n_head * (chunks + 1) * static_cast<int64_t>(sizeof(float));
  return (bytes + 63) / 64 * 64;
}
}  // namespace

int64_t SparseKvCache::ScoresBytes(const model::ModelConfig& config, const SparseOptions& options,
                                   int64_t total_tokens) {
  const int64_t chunks = total_tokens / options.chunk_tokens;
  return ScoresPart(config, chunks) + config.n_head_kv * (chunks + 1) * static_cast<int64_t>(sizeof(int64_t));
}

int64_t SparseKvCache::IdsOffset(const model::ModelConfig& config, int64_t chunks) { return ScoresPart(config, chunks); }

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

void SparseKvCache::RankChunks(const Seq& s, const Selection& cands, int64_t take, bool sorted) {
  const int64_t n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  const float* scores = static_cast<const float*>(s.scores.data);
  int64_t* ids = reinterpret_cast<int64_t*>(static_cast<char*>(s.scores.data) + s.ids_offset);
  thread_local std::vector<backend::ChunkScores> lists;
  lists.resize(n_kv);
  for (int64_t g = 0; g < n_kv; ++g) {
    lists[g] = {scores + g * s.score_stride, cands[g], ids + g * s.id_stride, take, sorted};
  }
  ops_.TopChunks(lists, gs, options_.budget_tokens / options_.chunk_tokens);
}

absl::Status SparseKvCache::IdsToHost(bool predictions) {
  if (host_visible_) return absl::OkStatus();
  const int64_t n_kv = config_.n_head_kv;
  bool any = false;
  for (size_t i = 0; i < n_reads_; ++i) {
    DecodeRead& r = reads_[i];
    if (predictions && !r.predict_pending) continue;
    const Seq& s = seqs_[r.seq];
    // Every head's ids, up to the last head's.
    const Selection& cands = predictions ? r.spec_cands : r.cands;
    const int64_t used = (n_kv - 1) * s.id_stride +
                         std::min(static_cast<int64_t>(cands[n_kv - 1].size()), predictions ? k_sel() : r.take);
    r.ids_host.resize(used);
    RETURN_IF_ERROR(device_.CopyToHost(backend::Queue::kCompute, s.scores, s.ids_offset, r.ids_host.data(),
                                       used * static_cast<int64_t>(sizeof(int64_t))));
    any = true;
  }
  return any ? device_.Synchronize(device_.Record(backend::Queue::kCompute)) : absl::OkStatus();
}

const int64_t* SparseKvCache::IdsOf(const Seq& s, const DecodeRead& r) const {
  return host_visible_ ? reinterpret_cast<const int64_t*>(static_cast<const char*>(s.scores.data) + s.ids_offset)
                       : r.ids_host.data();
}

SparseKvCache::Selection SparseKvCache::Chosen(const int64_t* ids, int64_t stride, const Selection& cands,
                                               int64_t take, Selection* ranked, Selection* shortlist) const {
  const int64_t n_kv = config_.n_head_kv;
  Selection sel(n_kv);
  if (ranked != nullptr) ranked->resize(n_kv);
  if (shortlist != nullptr) shortlist->resize(n_kv);
  for (int64_t g = 0; g < n_kv; ++g) {
    const int64_t* head = ids + g * stride;
    const int64_t t = std::min(static_cast<int64_t>(cands[g].size()), take), k = std::min(t, k_sel());
    sel[g].assign(head, head + k);
    if (ranked != nullptr) (*ranked)[g] = sel[g];  // in score order (RankChunks' `sorted`)
    std::sort(sel[g].begin(), sel[g].end());
    if (shortlist != nullptr) (*shortlist)[g].assign(head, head + t);
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
  RankChunks(s, r.spec_cands, k_sel(), /*sorted=*/options_.predictor == Predictor::kUnion);
  r.predict_pending = true;
}

void SparseKvCache::FinishPrediction(const Seq& s, DecodeRead& r) {
  r.predict_pending = false;
  const bool union_of = options_.predictor == Predictor::kUnion;
  Selection ranked;
  r.predicted = Chosen(IdsOf(s, r), s.id_stride, r.spec_cands, k_sel(), union_of ? &ranked : nullptr, nullptr);
  if (r.real_row >= 0 && union_of) r.predicted = UnionOf(ranked, r.ranked, r.next);
}

void SparseKvCache::ScoreOwnSelection(const Seq& s, const LayerState& st, const float* q, DecodeRead& r) {
  const bool spec_follows = r.real_row >= 0 && r.spec_row >= 0;
  const bool shortlist = spec_follows && options_.spec_candidates > 0;
  r.take = shortlist ? options_.spec_candidates * k_sel() : k_sel();
  ScoreChunks(s, st, q, r.w, nullptr, &r.cands);
  RankChunks(s, r.cands, r.take, /*sorted=*/spec_follows && Ranks());
}

absl::Status SparseKvCache::SelectAndStart(const model::AttentionCall& call) {
  RETURN_IF_ERROR(IdsToHost(/*predictions=*/false));
  bool predictions = false;
  for (size_t i = 0; i < n_reads_; ++i) {
    DecodeRead& r = reads_[i];
    Seq& s = seqs_[r.seq];
    const bool spec_follows = r.real_row >= 0 && r.spec_row >= 0;
    const bool shortlist = spec_follows && options_.spec_candidates > 0;
    r.sel = Chosen(IdsOf(s, r), s.id_stride, r.cands, r.take, spec_follows && Ranks() ? &r.ranked : nullptr,
                   shortlist ? &r.shortlist : nullptr);
    if (options_.selection_model.enabled) ModelSelection(s, call, r);
    if (r.real_row >= 0) {
      RETURN_IF_ERROR(StartRealRead(s, call, r));
    } else {
      RETURN_IF_ERROR(StartPreDecodeRead(s, call, r));
    }
    // Scored after the read's own scores were taken (they share the buffer).
    if (r.spec_row >= 0) ScorePrediction(s, call, r);
    predictions = predictions || r.predict_pending;
  }
  if (predictions) {
    RETURN_IF_ERROR(IdsToHost(/*predictions=*/true));
    for (size_t i = 0; i < n_reads_; ++i) {
      if (reads_[i].predict_pending) FinishPrediction(seqs_[reads_[i].seq], reads_[i]);
    }
  }
  if (options_.selection_model.enabled) {
    for (size_t i = 0; i < n_reads_; ++i) {
      if (reads_[i].spec_row >= 0) reads_[i].predicted = std::move(reads_[i].model_predicted);
    }
  }
  return absl::OkStatus();
}

void SparseKvCache::ModelSelection(Seq& s, const model::AttentionCall& call, DecodeRead& r) {
  // Positions as the engine's windows use them: a real row at p attends WindowFor(p + 1); a
  // speculative row alone at p (pre-decoding the token the real row at p will read) attends
  // WindowFor(p). A first selection is drawn within WindowFor(p), which lies in both, so the
  // real row at p attends the same chunks whether pre-decoding came first (dualdecoder) or not.
  const SelectionModel& m = options_.selection_model;
  LayerState& st = s.layers[call.layer];
  const bool real = r.real_row >= 0;
  const int64_t pos = call.rows[real ? r.real_row : r.spec_row].pos;
  const int64_t n_kv = config_.n_head_kv, k = k_sel();
  SelectionModel::Key key{r.seq, call.layer, 0, pos};
  if (st.model_pos != pos) {
    const Window first = WindowFor(pos);
    st.model_sel.assign(n_kv, {});
    for (int64_t g = 0; g < n_kv; ++g) {
      key.head = g;
      st.model_sel[g] = m.First(key, first.sel_begin, first.sel_end, k);
    }
  }
  r.sel = std::move(st.model_sel);
  st.model_pos = pos;
  if (!real) {  // pre-decoding: the prediction is the real row's S at this same position
    // A plan drawn for the real row (within WindowFor(pos + 1)) kept to this row's window: a
    // chunk past it is in the row's dense part (today pre-decoding follows a prefill, with no
    // plan, so nothing is dropped).
    const Window own = WindowFor(pos);
    for (auto& v : r.sel) std::erase_if(v, [&](int64_t c) { return c < own.sel_begin || c >= own.sel_end; });
    st.model_sel = r.sel;
    r.model_predicted = r.sel;
    return;
  }
  // The real row at pos + 1 attends WindowFor(pos + 2).
  const Window next = WindowFor(pos + 2);
  st.model_sel.assign(n_kv, {});
  if (r.spec_row >= 0) r.model_predicted.assign(n_kv, {});
  key.pos = pos + 1;
  for (int64_t g = 0; g < n_kv; ++g) {
    key.head = g;
    st.model_sel[g] = m.Next(key, r.sel[g], next.sel_begin, next.sel_end, k);
    if (r.spec_row >= 0) {
      r.model_predicted[g] = m.Predict(key, r.sel[g], st.model_sel[g], next.sel_begin, next.sel_end);
    }
  }
  st.model_pos = pos + 1;
}

}  // namespace dd::engine
