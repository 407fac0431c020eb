#include "decode-worker/engine/device_check.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace dd::engine {
namespace {

// Fixed prose, cycled to the prompt lengths: real text gives the peaked distributions a
// served request has, so the argmax comparison means something.
constexpr char kCheckText[] =
    "The lighthouse keeper wrote the weather in a narrow book every evening: the wind, the height "
    "of the waves, the ships that passed and the color of the sky before the lamp was lit. When the "
    "fog came in from the sea he rang the bell every half minute until morning, and in the spring "
    "he painted the iron rail that ran around the gallery. Years later the book was found in a "
    "drawer, and the town learned how many storms had passed without anyone ashore noticing. ";
constexpr int64_t kPromptTokens[2] = {192, 160};
constexpr int64_t kPrefillChunk = 64;
constexpr int64_t kSparseBudget = 64;

std::vector<int32_t> CheckPrompt(const model::Tokenizer& tok, int64_t n, int64_t offset) {
  std::vector<int32_t> text = tok.Encode(kCheckText, /*add_bos=*/false, /*parse_special=*/false);
  std::vector<int32_t> out;
  if (tok.add_bos() && tok.bos_id() >= 0) out.push_back(tok.bos_id());
  for (int64_t i = 0; static_cast<int64_t>(out.size()) < n; ++i) {
    out.push_back(text.empty() ? static_cast<int32_t>(i % 256) : text[(offset + i) % text.size()]);
  }
  return out;
}

// The check's engine: the configured mode and kernels, nothing that reaches outside the process.
EngineOptions CheckOptions(const EngineOptions& configured, const std::string& device) {
  EngineOptions o = configured;
  o.device = device;
  o.device_why = "device check";
  if (device == "cpu") o.cuda_graphs = o.cuda_copy_engine_prefetch = false;
  o.kv_store = "inproc://";
  o.kv_store_token.clear();
  o.prefix_block_tokens = 0;
  o.device_memory_bytes = 0;
  o.prefill_chunk = kPrefillChunk;
  o.sparse.budget_tokens = kSparseBudget;
  o.sparse.selection_model = {};
  if (o.sparse.predictor == Predictor::kOracleToken) o.sparse.predictor = Predictor::kSpeculative;
  return o;
}

// One run: the prompts prefilled together, then `steps` batched decode steps; each row's
// logits go to `row`. An empty *fed (the reference) is filled with the greedy tokens the run
// feeds, step by step; otherwise its tokens are fed (teacher forcing).
absl::Status Run(const model::LoadedModel& model, const EngineOptions& o,
                 const std::vector<std::vector<int32_t>>& prompts, int64_t steps,
                 std::vector<std::vector<int32_t>>* fed,
                 const std::function<void(int seq, int step, const float* logits)>& row) {
  const bool greedy = fed->empty();
  if (greedy) fed->assign(steps, std::vector<int32_t>(2));
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(model, o));
  const int64_t n_vocab = model.config.n_vocab;
  const std::vector<int32_t> seqs = {0, 1};
  ASSIGN_OR_RETURN(std::vector<std::vector<float>> last, engine->PrefillBatch(seqs, prompts));
  std::vector<int32_t> next(2);
  for (int s = 0; s < 2; ++s) {
    row(s, 0, last[s].data());
    if (greedy) (*fed)[0][s] = Argmax(last[s].data(), n_vocab);
    next[s] = (*fed)[0][s];
  }
  std::vector<float> logits;
  for (int64_t k = 1; k <= steps; ++k) {
    RETURN_IF_ERROR(engine->DecodeStep(seqs, next, &logits));
    for (int s = 0; s < 2; ++s) {
      const float* l = logits.data() + s * n_vocab;
      row(s, static_cast<int>(k), l);
      if (k == steps) continue;
      if (greedy) (*fed)[k][s] = Argmax(l, n_vocab);
      next[s] = (*fed)[k][s];
    }
  }
  return absl::OkStatus();
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

absl::StatusOr<DeviceCheckReport> CheckDevice(const model::LoadedModel& model, const EngineOptions& options,
                                              const DeviceCheckOptions& check) {
  if (!(check.tolerance > 0) || check.decode_steps < 1 || check.decode_steps > 256) {
    return absl::InvalidArgumentError(absl::StrCat("device check: tolerance must be > 0 and decode steps in [1, 256], got ",
                                                   check.tolerance, " and ", check.decode_steps));
  }
  DeviceCheckReport r;
  r.device = options.device;
  r.mode = std::string(DecodeModeName(options.mode));
  r.decode_steps = check.decode_steps;
  r.tolerance = check.tolerance;
  const int64_t n_vocab = model.config.n_vocab;
  std::vector<std::vector<int32_t>> prompts;
  for (int s = 0; s < 2; ++s) {
    const int64_t ctx = model.config.n_ctx_train > 0 ? model.config.n_ctx_train : kPromptTokens[0] * 4;
    const int64_t n = std::min<int64_t>(kPromptTokens[s], ctx - check.decode_steps - 1);
    if (n < 2) return absl::InvalidArgumentError("device check: the model's context is too short");
    prompts.push_back(CheckPrompt(*model.tokenizer, n, 17 * s));
    r.prompt_tokens.push_back(n);
  }
  const int64_t rows_per_seq = check.decode_steps + 1;
  // The reference: greedy on the cpu, every row's logits kept.
  std::vector<float> ref(static_cast<size_t>(2 * rows_per_seq * n_vocab));
  std::vector<std::vector<int32_t>> fed;  // the cpu's tokens, filled by its run
  auto t0 = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(Run(model, CheckOptions(options, "cpu"), prompts, check.decode_steps, &fed,
                      [&](int s, int k, const float* l) {
                        std::copy(l, l + n_vocab, ref.data() + (s * rows_per_seq + k) * n_vocab);
                      }));
  r.cpu_seconds = Seconds(t0);
  t0 = std::chrono::steady_clock::now();
  std::vector<DeviceCheckRow> rows;
  RETURN_IF_ERROR(Run(model, CheckOptions(options, options.device), prompts, check.decode_steps, &fed,
                      [&](int s, int k, const float* l) {
                        const float* c = ref.data() + (s * rows_per_seq + k) * n_vocab;
                        DeviceCheckRow row{.seq = s, .step = k};
                        double sum = 0, sum2 = 0;
                        bool finite = true;
                        for (int64_t i = 0; i < n_vocab; ++i) {
                          finite = finite && std::isfinite(l[i]);
                          row.max_abs_diff = std::max(row.max_abs_diff, std::fabs(double{l[i]} - c[i]));
                          sum += c[i];
                          sum2 += double{c[i]} * c[i];
                        }
                        const double mean = sum / n_vocab;
                        row.cpu_std = std::sqrt(std::max(0.0, sum2 / n_vocab - mean * mean));
                        row.cpu_token = Argmax(c, n_vocab);
                        row.device_token = Argmax(l, n_vocab);
                        if (!finite) row.max_abs_diff = INFINITY;
                        if (row.device_token != row.cpu_token) {
                          row.near_tie = std::fabs(double{c[row.cpu_token]} - c[row.device_token]) <=
                                         2 * row.max_abs_diff;
                        }
                        row.ok = finite && row.max_abs_diff <= check.tolerance * std::max(row.cpu_std, 1e-6) &&
                                 (row.device_token == row.cpu_token || row.near_tie);
                        rows.push_back(row);
                      }));
  r.device_seconds = Seconds(t0);
  std::sort(rows.begin(), rows.end(),
            [](const DeviceCheckRow& a, const DeviceCheckRow& b) { return std::tie(a.step, a.seq) < std::tie(b.step, b.seq); });
  r.rows = std::move(rows);
  r.passed = true;
  for (const DeviceCheckRow& row : r.rows) {
    r.worst_relative_diff = std::max(r.worst_relative_diff, row.max_abs_diff / std::max(row.cpu_std, 1e-6));
    if (row.device_token != row.cpu_token) ++r.token_mismatches;
    if (!row.ok && r.passed) {
      r.passed = false;
      r.reason = absl::StrFormat(
          "sequence %d, %s: logits differ from the cpu's by up to %.4g (%.3g of the row's standard deviation, "
          "tolerance %.3g)%s",
          row.seq, row.step == 0 ? std::string("prompt's last row") : absl::StrCat("decode step ", row.step),
          row.max_abs_diff, row.max_abs_diff / std::max(row.cpu_std, 1e-6), r.tolerance,
          row.device_token != row.cpu_token && !row.near_tie
              ? absl::StrCat(", token ", row.device_token, " instead of ", row.cpu_token)
              : "");
    }
  }
  return r;
}

std::string DeviceCheckReport::Summary() const {
  const int64_t total = static_cast<int64_t>(rows.size());
  return absl::StrFormat(
      "device check %s: %s against cpu, %s mode, %d logit rows: worst difference %.3g of a row's standard "
      "deviation (tolerance %.3g), tokens %d/%d equal%s; %.2f s (cpu %.2f s, %s %.2f s)",
      passed ? "passed" : "FAILED", device, mode, total, worst_relative_diff, tolerance, total - token_mismatches,
      total, passed ? "" : absl::StrCat("; ", reason), cpu_seconds + device_seconds, cpu_seconds, device,
      device_seconds);
}

std::string DeviceCheckReport::Table() const {
  std::string out = absl::StrFormat("%-4s %-4s %10s %10s %12s %10s %s\n", "seq", "step", "cpu", device,
                                    "max|diff|", "/std", "");
  for (const DeviceCheckRow& row : rows) {
    absl::StrAppendFormat(&out, "%-4d %-4d %10d %10d %12.4g %10.3g %s\n", row.seq, row.step, row.cpu_token,
                          row.device_token, row.max_abs_diff, row.max_abs_diff / std::max(row.cpu_std, 1e-6),
                          row.ok ? (row.near_tie ? "ok (near tie)" : "ok") : "FAIL");
  }
  return out + Summary() + "\n";
}

}  // namespace dd::engine
