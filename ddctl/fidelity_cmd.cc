// ddctl fidelity: the same text teacher-forced through `full` and through a sparse mode, side
// by side in one process. The first --context tokens of the prompt are prefilled; each of the
// next --score_tokens tokens is then fed as a decode step (the true token, not a sampled
// one), and the next-token distributions of the two engines are compared at every step.
#include <cmath>
#include <iostream>
#include <vector>

#include "absl/strings/str_cat.h"
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

}  // namespace

absl::Status RunFidelity(const CliConfig& cfg) {
  if (cfg.engine.mode == engine::DecodeMode::kFull) {
    return absl::InvalidArgumentError("fidelity compares a sparse mode with full: pass --mode sparse or dualdecoder");
  }
  if (cfg.context <= 0 || cfg.score_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--context and --score_tokens must be positive, got ", cfg.context,
                                                   " and ", cfg.score_tokens));
  }
  ASSIGN_OR_RETURN(std::string text, ReadPrompt(cfg));
  ASSIGN_OR_RETURN(auto model, Load(cfg));
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
  engine::EngineOptions full_opts = cfg.engine;
  full_opts.mode = engine::DecodeMode::kFull;
  full_opts.prefix_block_tokens = 0;  // the pool (and its prefix reuse) serves the sparse engine only
  full_opts.kv_store = "inproc://";
  ASSIGN_OR_RETURN(auto full, engine::Engine::Create(*model, full_opts));
  ASSIGN_OR_RETURN(auto sparse, engine::Engine::Create(*model, cfg.engine));
  const std::vector<int32_t> prompt(ids.begin(), ids.begin() + cfg.context);
  ASSIGN_OR_RETURN(std::vector<float> lf, full->Prefill(0, prompt));
  ASSIGN_OR_RETURN(std::vector<float> ls, sparse->Prefill(0, prompt));
  const int64_t V = model->config.n_vocab;
  std::vector<double> kl, nll_full, nll_sparse;
  int32_t seq = 0;
  for (int64_t i = 0; i < cfg.score_tokens; ++i) {
    // Both distributions predict token context + i; then that true token is fed.
    const int32_t truth = ids[cfg.context + i];
    const std::vector<double> pf = LogSoftmax(lf.data(), V), ps = LogSoftmax(ls.data(), V);
    double d = 0;
    for (int64_t v = 0; v < V; ++v) d += std::exp(pf[v]) * (pf[v] - ps[v]);
    kl.push_back(std::max(0.0, d));
    nll_full.push_back(-pf[truth]);
    nll_sparse.push_back(-ps[truth]);
    if (i + 1 == cfg.score_tokens) break;
    RETURN_IF_ERROR(full->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&truth, 1), &lf));
    RETURN_IF_ERROR(sparse->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&truth, 1), &ls));
  }
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / v.size();
  };
  nlohmann::json j;
  j["mode"] = std::string(engine::DecodeModeName(cfg.engine.mode));
  j["budget_tokens"] = cfg.engine.sparse.budget_tokens;
  j["context"] = cfg.context;
  j["scored"] = kl.size();
  j["kl_mean"] = mean(kl);
  j["kl_max"] = *std::max_element(kl.begin(), kl.end());
  j["ppl_full"] = std::exp(mean(nll_full));
  j["ppl_sparse"] = std::exp(mean(nll_sparse));
  j["kl"] = kl;
  std::cout << j.dump(2) << "\n";
  return absl::OkStatus();
}

}  // namespace dd::ddctl
