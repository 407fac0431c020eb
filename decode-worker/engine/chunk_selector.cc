#include "decode-worker/engine/chunk_selector.h"

#include <algorithm>

#include "common/status_macros.h"

namespace dd::engine {

namespace {
// A sequence's selection buffer: the scores of every KV head's query heads × every chunk, then
// (64-byte aligned) a chunk id per KV head and chunk.
int64_t ScoresPart(const model::ModelConfig& config, int64_t chunks) {
  const int64_t bytes = config.n_head * (chunks + 1) * static_cast<int64_t>(sizeof(float));
  return (bytes + 63) / 64 * 64;
}
}  // namespace

ChunkSelector::ChunkSelector(const model::ModelConfig& config, const SparseOptions& options, backend::Device& device)
    : config_(config), options_(options), model_(options.selection_model), device_(device) {}

int64_t ChunkSelector::ScoresBytes(const model::ModelConfig& config, const SparseOptions& options,
                                   int64_t total_tokens) {
  const int64_t chunks = total_tokens / options.chunk_tokens;
  return ScoresPart(config, chunks) + config.n_head_kv * (chunks + 1) * static_cast<int64_t>(sizeof(int64_t));
}

absl::Status ChunkSelector::EnsureScores(SeqScores& s, int64_t total_tokens) {
  if (s.buf) return absl::OkStatus();
  const int64_t chunks = total_tokens / options_.chunk_tokens;
  s.score_stride = config_.n_head / config_.n_head_kv * (chunks + 1);
  s.id_stride = chunks + 1;
  s.ids_offset = ScoresPart(config_, chunks);
  ASSIGN_OR_RETURN(s.buf, AllocateOrEmpty(device_, backend::MemoryTag::kWorkspace,
                                          ScoresBytes(config_, options_, total_tokens)));
  return absl::OkStatus();
}

void ChunkSelector::Score(const SeqScores& s, const LayerRows& rows, const float* q, const Window& w,
                          const Selection* candidates, Selection* cands) {
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  cands->resize(n_kv);
  float* scores = static_cast<float*>(s.buf.data);
  const float* landmarks = static_cast<const float*>(rows.landmarks.data);
  for (int64_t g = 0; g < n_kv; ++g) {
    std::vector<int64_t>& chunks = (*cands)[g];
    chunks.clear();
    if (candidates != nullptr) {
      chunks = (*candidates)[g];
    } else {
      for (int64_t c = w.sel_begin; c < w.sel_end; ++c) chunks.push_back(c);
    }
    const int64_t n_cand = static_cast<int64_t>(chunks.size());
    landmarks_.resize(n_cand);
    for (int64_t i = 0; i < n_cand; ++i) landmarks_[i] = landmarks + (chunks[i] * n_kv + g) * hd;
    // The group's gs query heads in one blocked call (Dot's bits per pair).
    device_.ops().KeyScores(q + g * gs * hd, gs, hd, landmarks_.data(), n_cand, scores + g * s.score_stride, n_cand);
  }
}

void ChunkSelector::Rank(const SeqScores& s, const Selection& cands, int64_t take, bool sorted) {
  const int64_t n_kv = config_.n_head_kv, gs = config_.n_head / n_kv;
  const float* scores = static_cast<const float*>(s.buf.data);
  int64_t* ids = reinterpret_cast<int64_t*>(static_cast<char*>(s.buf.data) + s.ids_offset);
  lists_.resize(n_kv);
  for (int64_t g = 0; g < n_kv; ++g) lists_[g] = {scores + g * s.score_stride, cands[g], ids + g * s.id_stride, take, sorted};
  device_.ops().TopChunks(lists_, gs, k_sel());
}

absl::Status ChunkSelector::IdsToHost(absl::Span<DecodeRead> reads, bool predictions) {
  const int64_t n_kv = config_.n_head_kv;
  bool copied = false;
  for (DecodeRead& read : reads) {
    ReadPick& r = read.pick;
    if (predictions && !r.predict_pending) continue;
    const SeqScores& s = *r.scores;
    // Every head's ids, up to the last head's.
    const Selection& cands = predictions ? r.spec_cands : r.cands;
    const int64_t used = (n_kv - 1) * s.id_stride +
                         std::min(static_cast<int64_t>(cands[n_kv - 1].size()), predictions ? k_sel() : r.take);
    r.ids_host.resize(used);
    ASSIGN_OR_RETURN(const void* ids, device_.ReadOnHost(backend::Queue::kCompute, s.buf, s.ids_offset,
                                                         used * static_cast<int64_t>(sizeof(int64_t)),
                                                         r.ids_host.data()));
    r.ids = static_cast<const int64_t*>(ids);
    copied = copied || r.ids == r.ids_host.data();
  }
  // Read in place (the cpu), the ids are ready; copied, once the copies are.
  return copied ? device_.Synchronize(device_.Record(backend::Queue::kCompute)) : absl::OkStatus();
}

Selection ChunkSelector::Chosen(const int64_t* ids, int64_t stride, const Selection& cands, int64_t take,
                                Selection* ranked, Selection* shortlist) const {
  const int64_t n_kv = config_.n_head_kv;
  Selection sel(n_kv);
  if (ranked != nullptr) ranked->resize(n_kv);
  if (shortlist != nullptr) shortlist->resize(n_kv);
  for (int64_t g = 0; g < n_kv; ++g) {
    const int64_t* head = ids + g * stride;
    const int64_t t = std::min(static_cast<int64_t>(cands[g].size()), take), k = std::min(t, k_sel());
    sel[g].assign(head, head + k);
    if (ranked != nullptr) (*ranked)[g] = sel[g];  // in score order (Rank's `sorted`)
    std::sort(sel[g].begin(), sel[g].end());
    if (shortlist != nullptr) (*shortlist)[g].assign(head, head + t);
  }
  return sel;
}

Selection ChunkSelector::UnionOf(const Selection& a, const Selection& b, const Window& w) const {
  const size_t k = static_cast<size_t>(k_sel());
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

void ChunkSelector::ScoreOwn(const SeqScores& s, const LayerRows& rows, const float* q, bool spec_follows,
                             ReadPick& r) {
  r.scores = &s;
  r.predict_pending = false;
  const bool shortlist = spec_follows && options_.spec_candidates > 0;
  r.take = shortlist ? options_.spec_candidates * k_sel() : k_sel();
  Score(s, rows, q, r.w, nullptr, &r.cands);
  Rank(s, r.cands, r.take, /*sorted=*/spec_follows && Ranks());
}

void ChunkSelector::ChooseOwn(bool spec_follows, ReadPick& r) const {
  const bool shortlist = spec_follows && options_.spec_candidates > 0;
  r.sel = Chosen(r.ids, r.scores->id_stride, r.cands, r.take, spec_follows && Ranks() ? &r.ranked : nullptr,
                 shortlist ? &r.shortlist : nullptr);
}

void ChunkSelector::ScorePrediction(const LayerRows& rows, bool after_real, int64_t pos, const float* q, ReadPick& r) {
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
  Score(*r.scores, rows, q, r.next, candidates, &r.spec_cands);
  Rank(*r.scores, r.spec_cands, k_sel(), /*sorted=*/options_.predictor == Predictor::kUnion);
  r.predict_pending = true;
}

void ChunkSelector::FinishPrediction(bool after_real, ReadPick& r) const {
  r.predict_pending = false;
  const bool union_of = options_.predictor == Predictor::kUnion;
  Selection ranked;
  r.predicted = Chosen(r.ids, r.scores->id_stride, r.spec_cands, k_sel(), union_of ? &ranked : nullptr, nullptr);
  if (after_real && union_of) r.predicted = UnionOf(ranked, r.ranked, r.next);
}

void ChunkSelector::ModelSelection(ModelDraw& draw, int32_t seq, int64_t layer, int64_t pos, bool real,
                                   bool spec_follows, ReadPick& r) const {
  // Positions as the engine's windows use them: a real row at p attends WindowFor(p + 1); a
  // speculative row alone at p (pre-decoding the token the real row at p will read) attends
  // WindowFor(p). A first selection is drawn within WindowFor(p), which lies in both, so the
  // real row at p attends the same chunks whether pre-decoding came first (dualdecoder) or not.
  const int64_t n_kv = config_.n_head_kv, k = k_sel();
  SelectionModel::Key key{seq, layer, 0, pos};
  if (draw.pos != pos) {
    const Window first = WindowFor(pos);
    draw.sel.assign(n_kv, {});
    for (int64_t g = 0; g < n_kv; ++g) {
      key.head = g;
      draw.sel[g] = model_.First(key, first.sel_begin, first.sel_end, k);
    }
  }
  r.sel = std::move(draw.sel);
  draw.pos = pos;
  if (!real) {  // pre-decoding: the prediction is the real row's S at this same position
    // A plan drawn for the real row (within WindowFor(pos + 1)) kept to this row's window: a
    // chunk past it is in the row's dense part (today pre-decoding follows a prefill, with no
    // plan, so nothing is dropped).
    const Window own = WindowFor(pos);
    for (auto& v : r.sel) std::erase_if(v, [&](int64_t c) { return c < own.sel_begin || c >= own.sel_end; });
    draw.sel = r.sel;
    r.model_predicted = r.sel;
    return;
  }
  // The real row at pos + 1 attends WindowFor(pos + 2).
  const Window next = WindowFor(pos + 2);
  draw.sel.assign(n_kv, {});
  if (spec_follows) r.model_predicted.assign(n_kv, {});
  key.pos = pos + 1;
  for (int64_t g = 0; g < n_kv; ++g) {
    key.head = g;
    draw.sel[g] = model_.Next(key, r.sel[g], next.sel_begin, next.sel_end, k);
    if (spec_follows) r.model_predicted[g] = model_.Predict(key, r.sel[g], draw.sel[g], next.sel_begin, next.sel_end);
  }
  draw.pos = pos + 1;
}

}  // namespace dd::engine
