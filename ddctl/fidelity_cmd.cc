// ddctl fidelity: the same text teacher-forced through `full` and through a sparse mode, side
// by side in one process. The first --context tokens of the prompt are prefilled; each of the
// next --score_tokens tokens is then fed as a decode step (the true token, not a sampled
// one), and the next-token distributions of the two engines are compared at every step.
// --budgets (or --each_sparse_layer, --key_ranks, --key_reconstructions) compares several sparse engines with one
// full run: full prefills and teacher-forces once, each variant after it; one JSON line per
// variant.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "ddctl/commands.h"
#include "nlohmann/json.hpp"

namespace dd::ddctl {
namespace {

// log-softmax of `logits` in double.
std::vector<double> LogSoftmax(const float* logits, int64_t n) {
  double mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(logits[i] - mx);
  const double lse = mx + std::log(sum);
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = logits[i] - lse;
  return out;
}

// One engine per --key_reconstructions entry: off, auto, all or layers:L+L+...
absl::StatusOr<std::vector<engine::EngineOptions>> ReconstructionVariants(const CliConfig& cfg) {
  std::vector<engine::EngineOptions> out;
  for (absl::string_view part : absl::StrSplit(cfg.fidelity_reconstructions, ',', absl::SkipWhitespace())) {
    if (out.size() >= 64) return absl::InvalidArgumentError("at most 64 variants per fidelity run");
    engine::EngineOptions o = cfg.engine;
    if (absl::Status st = engine::ApplyKeyReconstructionSpec(part, &o.sparse.key_reconstruction); !st.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--key_reconstructions: ", st.message()));
    }
    out.push_back(o);
  }
  return out;
}

// The sparse engines to compare with full: one per --budgets entry, one per
// --each_sparse_layer entry with only that global layer sparse (at --budget), or one per
// --key_ranks entry with every sparse layer's keys rebuilt at that rank (0: fetched).
absl::StatusOr<std::vector<engine::EngineOptions>> Variants(const CliConfig& cfg) {
  const int lists = !cfg.fidelity_budgets.empty() + !cfg.fidelity_layers.empty() + !cfg.fidelity_key_ranks.empty() +
                    !cfg.fidelity_reconstructions.empty();
  if (lists > 1) {
    return absl::InvalidArgumentError("pass one of --budgets, --each_sparse_layer, --key_ranks and --key_reconstructions");
  }
  if (!cfg.fidelity_reconstructions.empty()) return ReconstructionVariants(cfg);
  const bool layers = !cfg.fidelity_layers.empty(), ranks = !cfg.fidelity_key_ranks.empty();
  const std::string& list = layers ? cfg.fidelity_layers : ranks ? cfg.fidelity_key_ranks : cfg.fidelity_budgets;
  const char* flag = layers ? "--each_sparse_layer" : ranks ? "--key_ranks" : "--budgets";
  std::vector<engine::EngineOptions> out;
  for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    int64_t x = 0;
    if (!absl::SimpleAtoi(part, &x) || x < 0 || (layers && x >= engine::SparseOptions::kMaxLayers)) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", part, "' is not a ",
                                                     layers ? "layer index" : ranks ? "rank" : "budget in tokens"));
    }
    if (out.size() >= 64) return absl::InvalidArgumentError("at most 64 variants per fidelity run");
    engine::EngineOptions o = cfg.engine;
    if (layers) {
      o.sparse.sparse_layers.reset();
      o.sparse.sparse_layers.set(x);
    } else if (ranks) {
      o.sparse.key_reconstruction.mode = x > 0 ? engine::KeyReconstructionMode::kAll : engine::KeyReconstructionMode::kOff;
      o.sparse.key_reconstruction.rank = x;
    } else {
      o.sparse.budget_tokens = x;
    }
    out.push_back(o);
  }
  if (out.empty()) out.push_back(cfg.engine);
  return out;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / v.size();
}

}  // namespace

absl::Status RunFidelity(const CliConfig& cfg) {
  KvDtype reference_kv = cfg.engine.kv_dtype;
  if (!cfg.fidelity_reference_kv_dtype.empty()) {
    ASSIGN_OR_RETURN(reference_kv, ParseKvDtype(cfg.fidelity_reference_kv_dtype, "reference_kv_dtype"));
  }
  if (cfg.engine.mode == engine::DecodeMode::kFull && reference_kv == cfg.engine.kv_dtype) {
    return absl::InvalidArgumentError(
        "fidelity compares a sparse mode with full, or another KV type with --reference_kv_dtype: pass --mode "
        "sparse or dualdecoder, or --kv_dtype and --reference_kv_dtype of different types");
  }
  if (cfg.context <= 0 || cfg.score_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--context and --score_tokens must be positive, got ", cfg.context,
                                                   " and ", cfg.score_tokens));
  }
  ASSIGN_OR_RETURN(std::vector<engine::EngineOptions> variants, Variants(cfg));
  ASSIGN_OR_RETURN(std::string text, ReadPrompt(cfg));
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  // Every run on the device the start-up check leaves (checked in the configured mode).
  ASSIGN_OR_RETURN(const engine::EngineOptions checked, CheckedEngineOptions(*model, cfg));
  for (engine::EngineOptions& o : variants) {
    o.device = checked.device;
    o.device_why = checked.device_why;
    o.cuda_graphs = checked.cuda_graphs;
    o.cuda_copy_engine_prefetch = checked.cuda_copy_engine_prefetch;
  }
  const std::vector<int32_t> ids = model->tokenizer->Encode(text, !cfg.raw_prompt, true);
  const int64_t need = cfg.context + cfg.score_tokens;
  if (static_cast<int64_t>(ids.size()) < need) {
    return absl::InvalidArgumentError(absl::StrCat("the prompt has ", ids.size(), " tokens; --context ", cfg.context,
                                                   " + --score_tokens ", cfg.score_tokens, " needs ", need));
  }
  if (need > model->config.n_ctx_train) {
    return absl::InvalidArgumentError(absl::StrCat("--context + --score_tokens = ", need,
                                                   " exceeds the model context of ", model->config.n_ctx_train));
  }
  // Full's logits at every scored position are kept for all variants: bounded before allocating.
  const int64_t V = model->config.n_vocab;
  constexpr int64_t kMaxFullLogitsBytes = int64_t{4} << 30;
  if (cfg.score_tokens > kMaxFullLogitsBytes / (V * static_cast<int64_t>(sizeof(float)))) {
    return absl::InvalidArgumentError(absl::StrCat("--score_tokens ", cfg.score_tokens, " would keep ", cfg.score_tokens,
                                                   " x ", V, " full-attention logits (over 4 GiB); score fewer positions"));
  }
  // Every variant's engine is created (and its options checked) before the long full run.
  std::vector<std::unique_ptr<engine::Engine>> sparse;
  for (const engine::EngineOptions& o : variants) {
    ASSIGN_OR_RETURN(auto e, engine::Engine::Create(*model, o));
    sparse.push_back(std::move(e));
  }
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + cfg.context);
  int32_t seq = 0;
  // Full attention once: its logits at every scored position, kept for all variants.
  std::vector<float> full_logits;
  {
    engine::EngineOptions full_opts = checked;
    full_opts.mode = engine::DecodeMode::kFull;
    full_opts.kv_dtype = reference_kv;
    full_opts.prefix_block_tokens = 0;  // the pool (and its prefix reuse) serves the sparse engine only
    full_opts.kv_store = "inproc://";
    ASSIGN_OR_RETURN(auto full, engine::Engine::Create(*model, full_opts));
    ASSIGN_OR_RETURN(std::vector<float> lf, full->Prefill(0, prompt));
    full_logits.reserve(cfg.score_tokens * V);
    for (int64_t i = 0; i < cfg.score_tokens; ++i) {
      full_logits.insert(full_logits.end(), lf.begin(), lf.end());
      if (i + 1 == cfg.score_tokens) break;
      RETURN_IF_ERROR(full->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&ids[cfg.context + i], 1), &lf));
    }
  }
  for (size_t k = 0; k < sparse.size(); ++k) {
    engine::Engine& e = *sparse[k];
    ASSIGN_OR_RETURN(std::vector<float> ls, e.Prefill(0, prompt));
    std::vector<double> kl, nll_full, nll_sparse;
    for (int64_t i = 0; i < cfg.score_tokens; ++i) {
      // Both distributions predict token context + i; then that true token is fed.
      const int32_t truth = ids[cfg.context + i];
      const std::vector<double> pf = LogSoftmax(&full_logits[i * V], V), ps = LogSoftmax(ls.data(), V);
      double d = 0;
      for (int64_t v = 0; v < V; ++v) d += std::exp(pf[v]) * (pf[v] - ps[v]);
      kl.push_back(std::max(0.0, d));
      nll_full.push_back(-pf[truth]);
      nll_sparse.push_back(-ps[truth]);
      if (i + 1 == cfg.score_tokens) break;
      RETURN_IF_ERROR(e.DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&truth, 1), &ls));
    }
    // What it moved: every variant's, for the key reconstructions to compare.
    const engine::KvLayerStats moved = e.kv().total_stats();
    const int64_t block_bytes = e.kv().block_bytes();
    sparse[k].reset();  // frees its KV before the next variant prefills
    nlohmann::json j;
    j["selected_chunks"] = moved.selected;
    j["reconstructed_chunks"] = moved.reconstructed;
    j["urgent_bytes"] = engine::MovedBytes(moved.urgent, moved.urgent_values, block_bytes);
    j["prefetch_bytes"] = engine::MovedBytes(moved.prefetched, moved.prefetched_values, block_bytes);
    j["hit_rate"] = moved.hit_rate();
    j["mode"] = std::string(engine::DecodeModeName(cfg.engine.mode));
    j["kv_dtype"] = std::string(KvDtypeName(variants[k].kv_dtype));
    j["reference_kv_dtype"] = std::string(KvDtypeName(reference_kv));
    j["budget_tokens"] = variants[k].sparse.budget_tokens;
    if (!cfg.fidelity_layers.empty()) {
      for (int64_t l = 0; l < engine::SparseOptions::kMaxLayers; ++l) {
        if (variants[k].sparse.sparse_layers.test(l)) j["sparse_layers"].push_back(l);
      }
    }
    const engine::KeyReconstructionOptions& kr = variants[k].sparse.key_reconstruction;
    j["key_reconstruction"] = std::string(engine::KeyReconstructionName(kr.mode));
    if (kr.enabled()) j["key_rank"] = kr.RankFor(model->config.n_head_kv * model->config.head_dim);
    if (kr.mode == engine::KeyReconstructionMode::kLayers) {
      for (int64_t l = 0; l < engine::KeyReconstructionOptions::kMaxLayers; ++l) {
        if (kr.layers.test(l)) j["reconstruct_layers"].push_back(l);
      }
    }
    j["context"] = cfg.context;
    j["scored"] = kl.size();
    j["kl_mean"] = Mean(kl);
    j["kl_max"] = *std::max_element(kl.begin(), kl.end());
    j["ppl_full"] = std::exp(Mean(nll_full));
    j["ppl_sparse"] = std::exp(Mean(nll_sparse));
    j["kl"] = kl;
    std::cout << j.dump() << "\n" << std::flush;  // one line per variant
  }
  return absl::OkStatus();
}

}  // namespace dd::ddctl
