// The sparse manager's chunk selection for a layer's decode reads, batch-wide
// (docs/architecture.md, "How to change the chunk selection"): for every read its landmark
// scores (one KeyScores call per KV head) and its top chunks (one TopChunks call, a list per
// KV head) go to the sequence's selection buffer on the device; the chosen ids come to the host
// together — read in place where the host may, else one copy per read and one sync. Then the
// speculative rows' predictions (P', the chunks the next step will need), which start from the
// real rows' shortlists, the same way, by the configured Predictor; or, on synthetic weights,
// the stated SelectionModel instead. Two syncs per layer for the batch, and only ids cross.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "dd/backend/ops.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_rows.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

// The selection model's draw for one (sequence, layer): the S it drew for the real row at
// position `pos` (-1: none).
struct ModelDraw {
  int64_t pos = -1;
  Selection sel;
};

class ChunkSelector {
 public:
  ChunkSelector(const model::ModelConfig& config, const SparseOptions& options, backend::Device& device);

  // Device bytes of a sequence's selection buffer for a request that may reach `total_tokens`
  // (part of the request's workspace in MemoryPlan).
  static int64_t ScoresBytes(const model::ModelConfig& config, const SparseOptions& options, int64_t total_tokens);
  // Allocates `s` (once) for a sequence that may reach `total_tokens`.
  absl::Status EnsureScores(SeqScores& s, int64_t total_tokens);

  Window WindowFor(int64_t n) const { return engine::WindowFor(options_, n); }
  // The read's own selection (the real row's, or a lone speculative row's) scored and ranked
  // from query `q` over `rows`' landmarks; `spec_follows`: a speculative row follows the
  // real row (it keeps a shortlist and, for the previous/union predictors, a ranking).
  void ScoreOwn(const SeqScores& s, const LayerRows& rows, const float* q, bool spec_follows, ReadPick& r);
  // Every read's ids on the host (own selections, or the pending predictions) in ReadPick::ids:
  // read in place where the host reads device memory (Device::ReadOnHost), else one copy per
  // read and one sync.
  absl::Status IdsToHost(absl::Span<DecodeRead> reads, bool predictions);
  // The read's S (and its ranking and shortlist) from the ids ScoreOwn left.
  void ChooseOwn(bool spec_follows, ReadPick& r) const;
  // The speculative row's prediction for the next step (its real row at pos + 1): scored
  // (or, for `previous`, taken at once from the real row's ranking), chosen by
  // FinishPrediction once every read's scores are in. Scored after the read's own selection
  // was chosen (they share the buffer).
  void ScorePrediction(const LayerRows& rows, bool after_real, int64_t pos, const float* q, ReadPick& r);
  void FinishPrediction(bool after_real, ReadPick& r) const;
  // The selection model: the read's S replaced by the model's, the next step's S drawn and,
  // where a speculative row follows, its prediction (in r.model_predicted).
  void ModelSelection(ModelDraw& draw, int32_t seq, int64_t layer, int64_t pos, bool real, bool spec_follows,
                      ReadPick& r) const;
  bool model_enabled() const { return model_.enabled; }
  void set_model(const SelectionModel& m) { model_ = m; }

 private:
  int64_t k_sel() const { return options_.k_sel(); }
  // The previous and union predictors read the real row's selection in score order.
  bool Ranks() const { return options_.predictor == Predictor::kPrevious || options_.predictor == Predictor::kUnion; }
  // Enqueues the landmark scores of query `q` (n_head × head_dim) into s: per KV head, the max
  // over its query heads is taken later; the chunks scored go to *cands — `candidates` (each in
  // the window's selectable range) or else the whole range.
  void Score(const SeqScores& s, const LayerRows& rows, const float* q, const Window& w, const Selection* candidates,
             Selection* cands);
  // Enqueues the top chunks of the scores Score left (Ops::TopChunks, one list per KV head):
  // the best `take` per head, the best k first, in score order when `sorted`.
  void Rank(const SeqScores& s, const Selection& cands, int64_t take, bool sorted);
  // The selection from Rank's ids: top k per KV head, ascending; `ranked` (optional, sorted
  // ids) the same by score; `shortlist` (optional) all `take` ids.
  Selection Chosen(const int64_t* ids, int64_t stride, const Selection& cands, int64_t take, Selection* ranked,
                   Selection* shortlist) const;
  // The union predictor: alternately from both rankings, within the next window, k per head.
  Selection UnionOf(const Selection& a, const Selection& b, const Window& w) const;

  const model::ModelConfig& config_;
  const SparseOptions& options_;
  SelectionModel model_;
  backend::Device& device_;
  std::vector<const float*> landmarks_;     // one KeyScores call's keys
  std::vector<backend::ChunkScores> lists_;  // one TopChunks call's lists
};

}  // namespace dd::engine
