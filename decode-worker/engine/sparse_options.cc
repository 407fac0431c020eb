#include "decode-worker/engine/sparse_options.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"

namespace dd::engine {

absl::Status SparseOptions::Validate(const model::ModelConfig& config) const {
  const int64_t model_context = config.n_ctx_train;
  for (int64_t l = 0; l < kMaxLayers; ++l) {
    if (sparse_layers.test(l) && (l >= config.n_layer || config.layer_is_swa[l])) {
      std::vector<int64_t> global;
      for (int64_t g = 0; g < config.n_layer; ++g) {
        if (!config.layer_is_swa[g]) global.push_back(g);
      }
      return absl::InvalidArgumentError(absl::StrCat("sparse layer ", l, " is not a global layer of this model (",
                                                     absl::StrJoin(global, ","), ")"));
    }
  }
  if (chunk_tokens <= 0) return absl::InvalidArgumentError(absl::StrCat("chunk size must be > 0, got ", chunk_tokens));
  if (budget_tokens < chunk_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sparse budget ", budget_tokens, " tokens is smaller than one chunk (",
                                                   chunk_tokens, " tokens)"));
  }
  if (budget_tokens > model_context) {
    return absl::InvalidArgumentError(absl::StrCat("sparse budget ", budget_tokens, " tokens is larger than the model context (",
                                                   model_context, " tokens)"));
  }
  if (sink_tokens < 0 || sink_tokens % chunk_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sink tokens ", sink_tokens, " must be a non-negative multiple of the chunk size"));
  }
  if (window_tokens < 1) return absl::InvalidArgumentError(absl::StrCat("window tokens must be >= 1, got ", window_tokens));
  if (resident_margin_tokens < 0 || resident_margin_tokens % chunk_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat("resident margin ", resident_margin_tokens,
                                                   " tokens must be a non-negative multiple of the chunk size"));
  }
  // Bounded before the resident sets are sized from it (budget + margin slots per head).
  if (resident_margin_tokens > model_context) {
    return absl::InvalidArgumentError(absl::StrCat("resident margin ", resident_margin_tokens,
                                                   " tokens is larger than the model context (", model_context,
                                                   " tokens)"));
  }
  if (spec_candidates < kAutoSpecCandidates || spec_candidates > kMaxSpecCandidates) {
    return absl::InvalidArgumentError(absl::StrCat("speculative candidates must be in [-1, ", kMaxSpecCandidates,
                                                   "] (× the budget; 0 = every chunk, -1 = by the speculative head), got ",
                                                   spec_candidates));
  }
  const KeyReconstructionOptions& kr = key_reconstruction;
  const int64_t kv_dim = config.n_head_kv * config.head_dim;
  if (kr.rank < 0 || kr.rank > kv_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("key rank ", kr.rank, " must be in [1, ", kv_dim, "] (the keys' width; 0 = by the model)"));
  }
  if (!(kr.on_below >= 0 && kr.on_below <= kr.off_at && kr.off_at <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("key reconstruction thresholds: need 0 <= on_below (", kr.on_below,
                                                   ") <= off_at (", kr.off_at, ") <= 1"));
  }
  if (kr.min_steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("key reconstruction min steps must be >= 1, got ", kr.min_steps));
  }
  if (kr.mode == KeyReconstructionMode::kLayers && kr.layers.none()) {
    return absl::InvalidArgumentError("key reconstruction by layers names no layer");
  }
  for (int64_t l = 0; l < KeyReconstructionOptions::kMaxLayers; ++l) {
    if (!kr.layers.test(l)) continue;
    const bool sparse = l < config.n_layer && !config.layer_is_swa[l] &&
                        (sparse_layers.none() || (l < kMaxLayers && sparse_layers.test(l)));
    if (!sparse) return absl::InvalidArgumentError(absl::StrCat("reconstruct layer ", l, " is not a sparse layer"));
  }
  return absl::OkStatus();
}

int64_t KeyReconstructionOptions::RankFor(int64_t kv_dim) const {
  if (rank > 0) return std::min(rank, kv_dim);
  // Half the key width, rounded up to 8, at most kMaxDefaultRank: measured without loss on Gemma
  // and within f16's on SmolLM2; the cap is ShadowKV's rank for Llama-3-8B's 1024-wide keys
  // (docs/decisions/0052-low-rank-key-reconstruction.md).
  return std::min({kv_dim, (kv_dim / 2 + 7) / 8 * 8, kMaxDefaultRank});
}

absl::StatusOr<KeyReconstructionMode> ParseKeyReconstruction(absl::string_view name) {
  for (KeyReconstructionMode m : {KeyReconstructionMode::kOff, KeyReconstructionMode::kAuto, KeyReconstructionMode::kAll,
                                  KeyReconstructionMode::kLayers}) {
    if (name == KeyReconstructionName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown key reconstruction '", name, "' (off, auto, all, layers)"));
}

absl::Status ApplyKeyReconstructionSpec(absl::string_view spec, KeyReconstructionOptions* options) {
  const std::string whole(spec);
  options->layers.reset();
  if (absl::ConsumePrefix(&spec, "layers:")) {
    options->mode = KeyReconstructionMode::kLayers;
    for (absl::string_view l : absl::StrSplit(spec, '+')) {
      int64_t x = 0;
      if (!absl::SimpleAtoi(l, &x) || x < 0 || x >= KeyReconstructionOptions::kMaxLayers) {
        return absl::InvalidArgumentError(absl::StrCat("'", l, "' is not a layer index"));
      }
      options->layers.set(x);
    }
    return absl::OkStatus();
  }
  auto m = ParseKeyReconstruction(spec);
  if (!m.ok() || *m == KeyReconstructionMode::kLayers) {
    return absl::InvalidArgumentError(absl::StrCat("'", whole, "' is not off, auto, all or layers:L+L"));
  }
  options->mode = *m;
  return absl::OkStatus();
}

absl::string_view KeyReconstructionName(KeyReconstructionMode m) {
  switch (m) {
    case KeyReconstructionMode::kOff: return "off";
    case KeyReconstructionMode::kAuto: return "auto";
    case KeyReconstructionMode::kAll: return "all";
    case KeyReconstructionMode::kLayers: return "layers";
  }
  return "unknown";
}

Window WindowFor(const SparseOptions& o, int64_t n) {
  const int64_t C = o.chunk_tokens;
  Window w;
  w.sinks = std::min(n, o.sink_tokens);
  const int64_t window_start = std::max(w.sinks, n - o.window_tokens);
  const int64_t first_window_chunk = window_start / C;
  w.dense_from = std::max(w.sinks, first_window_chunk * C);
  w.sel_begin = o.sink_tokens / C;
  w.sel_end = std::max(w.sel_begin, first_window_chunk);
  return w;
}

absl::StatusOr<Predictor> ParsePredictor(absl::string_view name) {
  for (Predictor p : {Predictor::kSpeculative, Predictor::kPrevious, Predictor::kUnion, Predictor::kRandomToken,
                      Predictor::kOracleToken}) {
    if (name == PredictorName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown predictor '", name, "' (speculative, previous, union, random, oracle)"));
}

absl::string_view PredictorName(Predictor p) {
  switch (p) {
    case Predictor::kSpeculative: return "speculative";
    case Predictor::kPrevious: return "previous";
    case Predictor::kUnion: return "union";
    case Predictor::kRandomToken: return "random";
    case Predictor::kOracleToken: return "oracle";
  }
  return "unknown";
}

absl::string_view KvFetchName(KvFetch f) { return f == KvFetch::kResident ? "resident" : "on_demand"; }

}  // namespace dd::engine
