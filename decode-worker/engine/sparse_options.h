// The sparse manager's options and the small types its parts share: a selection, a decode
// row's window geometry, and one decode read (a sequence's decode rows of one sparse layer
// within an attention call). docs/architecture.md, "KV caches, landmarks and selection".
#pragma once

#include <bitset>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/selection_model.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

// What P' (the chunks prefetched for the next step) is predicted from (eval/predictors.py compares
// them; results are identical whatever the predictor, only hits and transfers change):
//   speculative  the speculative row's query (the design; the default);
//   previous     the real row's own selection of this step ("reuse the last selection");
//   union        half from each ranking, filled from the speculative one, at the same size;
//   random       the speculative row, fed a random token instead of the predicted one;
//   oracle       the speculative row, fed the true next token (replaying a finished run).
// The last two are chosen by the engine (which token feeds the speculative row).
enum class Predictor { kSpeculative, kPrevious, kUnion, kRandomToken, kOracleToken };
absl::StatusOr<Predictor> ParsePredictor(absl::string_view name);
absl::string_view PredictorName(Predictor p);

// How a sparse layer's selected chunks reach the device (fetch_policy.h):
//   on_demand  every step gathers its whole selection on the urgent path (`sparse`);
//   resident   chunks stay in a per-layer resident set across steps; only misses move urgently,
//              and dualdecoder's prediction is prefetched into it in the background
//              (`sparse-cached`, `dualdecoder`; docs/decisions/0012-resident-set.md).
enum class KvFetch { kOnDemand, kResident };
absl::string_view KvFetchName(KvFetch f);

// Keys rebuilt on the device from a low-rank key cache instead of fetched, so that only values
// move (docs/decisions/0052-low-rank-key-reconstruction.md). Changes results (the rebuilt keys
// are an approximation); the selection always scores the exact landmarks.
//   off     never (the default): exact sparse attention;
//   auto    per sparse layer, online: on once the layer's next-step hit rate, smoothed over
//           steps, falls below `on_below`; off again once it reaches `off_at`; at least
//           `min_steps` of the layer's steps between two switches. Only where predictions are
//           measured (dualdecoder); elsewhere it never turns on;
//   all     every sparse layer at every step;
//   layers  the sparse layers in `layers` (the paper's offline-profiled list), every step.
enum class KeyReconstructionMode { kOff, kAuto, kAll, kLayers };
absl::StatusOr<KeyReconstructionMode> ParseKeyReconstruction(absl::string_view name);
absl::string_view KeyReconstructionName(KeyReconstructionMode m);
struct KeyReconstructionOptions;
// `options` with the mode and layers of a spec — off, auto, all or layers:L+L+... (the variant
// lists of ddctl fidelity and the benchmarks); InvalidArgument naming the spec otherwise.
absl::Status ApplyKeyReconstructionSpec(absl::string_view spec, KeyReconstructionOptions* options);

struct KeyReconstructionOptions {
  static constexpr int64_t kMaxLayers = 256;
  KeyReconstructionMode mode = KeyReconstructionMode::kOff;
  std::bitset<kMaxLayers> layers{};
  // Coefficients per position (the basis's rows). 0: by the model's key width (RankFor).
  int64_t rank = 0;
  static constexpr int64_t kMaxDefaultRank = 160;
  double on_below = 0.80, off_at = 0.90;
  int64_t min_steps = 8;
  // Tests: the choice of (layer, the layer's decode step from 0) instead of the mode's rule
  // (the mode must not be off), so that runs in different modes switch at the same steps.
  bool (*schedule_for_testing)(int64_t layer, int64_t step) = nullptr;
  bool enabled() const { return mode != KeyReconstructionMode::kOff; }
  // Whether sparse layer `layer` may rebuild its keys (it keeps a low-rank key cache).
  bool MayReconstruct(int64_t layer) const {
    if (mode == KeyReconstructionMode::kLayers) return layer >= 0 && layer < kMaxLayers && layers.test(layer);
    return enabled();
  }
  // `rank`, or for 0 the default for keys of kv_dim floats (the KV heads stacked).
  int64_t RankFor(int64_t kv_dim) const;
};

struct SparseOptions {
  int64_t budget_tokens = 2048;  // selected tokens per step per KV head (a multiple of chunk)
  int64_t chunk_tokens = 8;
  int64_t sink_tokens = 16;
  int64_t window_tokens = 64;
  Predictor predictor = Predictor::kSpeculative;
  // dualdecoder: the speculative row after a real row scores only the landmarks of the real
  // row's best `spec_candidates` × budget chunks per KV head (plus chunks that became
  // selectable since), not every chunk: its prediction costs O(budget), not O(context).
  // Changes the prediction, never the results. 0 = every chunk. At most kMaxSpecCandidates.
  // kAutoSpecCandidates (the default): the Engine picks by the speculative head — 4 with the
  // full head (SmolLM2's hit rate on the license texts 95.4% vs 95.5% with every chunk, 94.3%
  // with 2, 82.0% with 1), 0 with the context head (Gemma at 16K: 86.7% with 4 vs 94.2%;
  // docs/decisions/0009-speculative-row-cost.md); SparseKvCache::Create refuses it unresolved.
  static constexpr int64_t kAutoSpecCandidates = -1;
  static constexpr int64_t kFullHeadSpecCandidates = 4;
  int64_t spec_candidates = kAutoSpecCandidates;
  static constexpr int64_t kMaxSpecCandidates = 64;
  // spec_candidates with kAutoSpecCandidates resolved for a speculative head (the one place
  // the rule above lives).
  int64_t SpecCandidatesFor(bool full_head) const {
    if (spec_candidates != kAutoSpecCandidates) return spec_candidates;
    return full_head ? kFullHeadSpecCandidates : 0;
  }
  // The fetch strategy (set by the Engine from the mode). Speculative rows need kResident.
  KvFetch fetch = KvFetch::kOnDemand;
  // Resident slots per KV head beyond the budget (in tokens, a multiple of the chunk): chunks
  // a step stops selecting stay this much longer, least recently used evicted first.
  int64_t resident_margin_tokens = 0;
  // None set: every global layer is sparse. Otherwise only these (global) layers are; the
  // other global layers attend over their whole KV like `full` (per-layer fidelity: the loss
  // one sparse layer causes). Not with prefix reuse (dense layers are not offloaded).
  static constexpr int64_t kMaxLayers = 256;
  std::bitset<kMaxLayers> sparse_layers{};
  // Benchmarks on synthetic weights: the chunks attended and predicted follow this stated model
  // instead of the landmark scores (which are still computed): selection_model.h. Off by
  // default; the predictor then plays no part.
  SelectionModel selection_model{};
  KeyReconstructionOptions key_reconstruction{};
  // InvalidArgument naming the field: budget smaller than a chunk or larger than the
  // model context, non-positive chunk, sinks/window not multiples of the chunk, a sparse layer
  // that is not a global layer of the model.
  absl::Status Validate(const model::ModelConfig& config) const;
  int64_t k_sel() const { return budget_tokens / chunk_tokens; }  // chunks per KV head
};

using Selection = std::vector<std::vector<int64_t>>;  // chunks per KV head, ascending

// A decode row's view of a sequence of n positions: sinks [0, sinks), selectable chunks
// [sel_begin, sel_end), and the dense window [dense_from, n) read from the device rows.
struct Window {
  int64_t sinks = 0, dense_from = 0, sel_begin = 0, sel_end = 0;
};
Window WindowFor(const SparseOptions& o, int64_t n);

// A sequence's selection buffer on the device: one selection's landmark scores (KV head g's
// from g × score_stride floats on) and, from ids_offset bytes on, its chosen chunk ids (head
// g's from g × id_stride on).
struct SeqScores {
  backend::DeviceBuffer buf;
  int64_t score_stride = 0, id_stride = 0, ids_offset = 0;
};

// The selector's part of a decode read (chunk_selector.h).
struct ReadPick {
  const SeqScores* scores = nullptr;  // the sequence's selection buffer
  Window w{};                         // the window the rows attend over
  Selection sel;                      // the chunks they attend, per KV head, ascending
  Selection cands;                    // the chunks scored for sel
  Selection ranked;                   // sel by score (previous and union predictors)
  Selection shortlist;                // the real row's best chunks, the speculative row's candidates
  int64_t take = 0;                   // ids ranked per head for sel (with the shortlist: more than k)
  Window next{};                      // the next step's window (the prediction's)
  Selection spec_cands;               // the chunks scored for the prediction
  bool predict_pending = false;       // the prediction is scored, not chosen yet
  const int64_t* ids = nullptr;       // the ranked ids on the host (ChunkSelector::IdsToHost)
  std::vector<int64_t> ids_host;      // where they are copied, where the host cannot read them in place
  Selection predicted;                // the speculative row's P' for the next step
  Selection model_predicted;          // the selection model's P' (replaces `predicted`)
};

// The fetch policy's part of a decode read (fetch_policy.h).
struct ReadFetch {
  std::vector<const uint8_t*> blocks;  // one per selected chunk, heads in order, where it lies
  // A read whose keys are rebuilt (FetchSeq::values_only): per block, whether its K half must be
  // rebuilt (a resident slot may hold them from an earlier step); empty: every block.
  std::vector<uint8_t> rebuild;
  ChunkStore::Landing urgent;        // the urgent blocks, not yet waited for
  bool wait_prefetch = false;        // it reads slots the layer's prefetch writes
  int64_t count_urgent = 0, count_reused = 0, count_evicted = 0;  // counted once landed
};

// One sequence's decode rows of a sparse layer within an attention call: an entry of the
// layer's attention plan. Kept across calls for their buffers.
struct DecodeRead {
  int32_t seq = 0;
  int64_t real_row = -1;  // the real decode row in the call, or -1 (pre-decoding)
  int64_t spec_row = -1;  // the speculative row after it, or -1
  ReadPick pick;
  ReadFetch fetch;
};

}  // namespace dd::engine
