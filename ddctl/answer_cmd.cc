// ddctl answer: many questions over one shared context, the context prefilled once.
//
// The context (--prompt_file) is prefilled into one slot; each question of --questions_file
// (JSON lines) forks that slot, prefills its own text and either generates an answer (greedy
// by default, as `ddctl generate`) or scores given continuations by their log-likelihood,
// teacher-forced through the mode's own decode steps. The answer equals what `ddctl generate`
// gives for context + question as one prompt (the shared tokens are the longest common prefix
// of every question's tokenization with the context's; the kernels are batch-invariant, so
// how the prompt is cut does not change the bits: tests/eval/test_answer_cli.py).
//
// Output, one JSON object per line on stdout: first {"type": "context", ...}, then one
// {"type": "answer", ...} per question in file order, each flushed as it finishes.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "ddctl/commands.h"
#include "nlohmann/json.hpp"

namespace dd::ddctl {
namespace {

// Bounds on the questions file, checked before anything is allocated from it.
constexpr int64_t kMaxFileBytes = 256ll << 20;
constexpr int64_t kMaxQuestions = 100000;
constexpr int64_t kMaxNewTokens = 1024;
constexpr size_t kMaxStops = 16;
// Slots one group of questions may hold at once (a question's fork plus one per choice),
// --answer_group: each holds a copy of the context's KV (in sparse modes a copy in the KV
// store, where a pool reserves every layer's blocks), so this bounds memory.
constexpr int64_t kMaxGroupSlots = 64;
constexpr size_t kMaxChoices = 15;  // each is a fork of the question's slot

struct Question {
  std::string id, text;
  int64_t max_new_tokens = 0;  // 0: no generation (choices only)
  std::vector<std::string> stop;
  std::vector<std::string> choices;
  std::vector<int32_t> ids;                  // context + text, as one prompt
  std::vector<std::vector<int32_t>> choice;  // each choice's tokens after `ids`
};

absl::StatusOr<std::vector<Question>> ReadQuestions(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("answer needs --questions_file (JSON lines)");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read questions file ", path));
  if (static_cast<int64_t>(in.tellg()) > kMaxFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("questions file ", path, " is larger than ", kMaxFileBytes >> 20, " MiB"));
  }
  in.seekg(0);
  std::vector<Question> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto where = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(path, " line ", n, ": ", what));
    };
    if (static_cast<int64_t>(out.size()) == kMaxQuestions) return where(absl::StrCat("more than ", kMaxQuestions, " questions"));
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return where("not a JSON object");
    Question q;
    if (!j.contains("id") || !j["id"].is_string()) return where("\"id\" (a string) is missing");
    if (!j.contains("text") || !j["text"].is_string()) return where("\"text\" (a string) is missing");
    q.id = j["id"].get<std::string>();
    q.text = j["text"].get<std::string>();
    if (j.contains("max_new_tokens")) {
      if (!j["max_new_tokens"].is_number_integer()) return where("\"max_new_tokens\" is not an integer");
      q.max_new_tokens = j["max_new_tokens"].get<int64_t>();
      if (q.max_new_tokens < 0 || q.max_new_tokens > kMaxNewTokens) {
        return where(absl::StrCat("\"max_new_tokens\" ", q.max_new_tokens, " is outside [0, ", kMaxNewTokens, "]"));
      }
    }
    for (const char* key : {"stop", "choices"}) {
      if (!j.contains(key)) continue;
      const nlohmann::json& a = j[key];
      const size_t limit = std::string(key) == "stop" ? kMaxStops : kMaxChoices;
      if (!a.is_array() || a.size() > limit) return where(absl::StrCat("\"", key, "\" is not an array of at most ", limit, " strings"));
      for (const auto& s : a) {
        if (!s.is_string() || s.get<std::string>().empty()) return where(absl::StrCat("\"", key, "\" holds a non-string or empty string"));
        (std::string(key) == "stop" ? q.stop : q.choices).push_back(s.get<std::string>());
      }
    }
    if (q.max_new_tokens == 0 && q.choices.empty()) return where("neither \"max_new_tokens\" > 0 nor \"choices\": nothing to do");
    out.push_back(std::move(q));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat("questions file ", path, " holds no question"));
  return out;
}

int64_t CommonPrefix(absl::Span<const int32_t> a, absl::Span<const int32_t> b) {
  int64_t n = 0;
  while (n < static_cast<int64_t>(std::min(a.size(), b.size())) && a[n] == b[n]) ++n;
  return n;
}

double LogProb(const float* logits, int64_t n, int32_t token) {
  double mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(logits[i] - mx);
  return logits[token] - mx - std::log(sum);
}

// Prefills the rest of every question of `group` on its own fork of slot 0, in shared forward
// passes of at most `chunk` rows; returns each question's last-row logits.
absl::StatusOr<std::vector<std::vector<float>>> PrefillQuestions(engine::Engine& e, absl::Span<const Question> group,
                                                                 absl::Span<const int32_t> slots, int64_t shared,
                                                                 int64_t chunk) {
  std::vector<std::vector<float>> logits(group.size());
  std::vector<engine::Engine::PrefillPiece> pieces;
  std::vector<size_t> owner;
  int64_t rows = 0;
  auto flush = [&]() -> absl::Status {
    if (pieces.empty()) return absl::OkStatus();
    std::vector<std::vector<float>> last;
    RETURN_IF_ERROR(e.PrefillParts(pieces, &last));
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (!last[i].empty()) logits[owner[i]] = std::move(last[i]);
    }
    pieces.clear();
    owner.clear();
    rows = 0;
    return absl::OkStatus();
  };
  for (size_t m = 0; m < group.size(); ++m) {
    RETURN_IF_ERROR(e.Fork(0, slots[m]));
    const int64_t n = static_cast<int64_t>(group[m].ids.size());
    for (int64_t b = shared; b < n; b += chunk) {
      const int64_t len = std::min(chunk, n - b);
      if (rows + len > chunk) RETURN_IF_ERROR(flush());
      pieces.push_back({slots[m], group[m].ids, b, b + len});
      owner.push_back(m);
      rows += len;
    }
  }
  RETURN_IF_ERROR(flush());
  return logits;
}

// Answers one group of questions and prints their lines; releases every slot it used.
absl::Status AnswerGroup(engine::Engine& e, absl::Span<const Question> group, int64_t shared, int64_t chunk,
                         const CliConfig& cfg, bool dual) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int64_t V = e.config().n_vocab;
  std::vector<int32_t> qslot(group.size());
  int32_t next_slot = 1;
  for (auto& s : qslot) s = next_slot++;
  std::vector<int32_t> used = qslot;
  auto release = [&] {
    for (int32_t s : used) e.Release(s);
  };
  auto status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(std::vector<std::vector<float>> logits, PrefillQuestions(e, group, qslot, shared, chunk));
    // Choices: a fork of the question per choice, teacher-forced together.
    struct Row {
      size_t q, c;
      int32_t slot;
    };
    std::vector<Row> rows;
    std::vector<std::vector<double>> lp(group.size());
    size_t longest = 0;
    for (size_t m = 0; m < group.size(); ++m) {
      lp[m].assign(group[m].choice.size(), 0.0);
      for (size_t c = 0; c < group[m].choice.size(); ++c) {
        // A question that generates nothing scores its first choice on its own slot (one KV
        // copy fewer); the others on forks of it.
        int32_t slot = qslot[m];
        if (c > 0 || group[m].max_new_tokens > 0) {
          slot = next_slot++;
          used.push_back(slot);
          RETURN_IF_ERROR(e.Fork(qslot[m], slot));
        }
        rows.push_back({m, c, slot});
        lp[m][c] = LogProb(logits[m].data(), V, group[m].choice[c][0]);
        longest = std::max(longest, group[m].choice[c].size());
      }
    }
    std::vector<float> out;
    for (size_t i = 1; i < longest; ++i) {
      std::vector<int32_t> seqs, feed;
      std::vector<const Row*> live;
      for (const Row& r : rows) {
        const auto& toks = group[r.q].choice[r.c];
        if (i < toks.size()) {
          seqs.push_back(r.slot);
          feed.push_back(toks[i - 1]);
          live.push_back(&r);
        }
      }
      RETURN_IF_ERROR(e.DecodeStep(seqs, feed, &out));
      for (size_t k = 0; k < live.size(); ++k) {
        lp[live[k]->q][live[k]->c] += LogProb(out.data() + k * V, V, group[live[k]->q].choice[live[k]->c][i]);
      }
    }
    // Answers: every question that generates, one batched decode step per token.
    std::vector<engine::Sampler> samplers;
    std::vector<engine::TextStream> streams;
    samplers.reserve(group.size());
    streams.reserve(group.size());
    std::vector<std::string> reason(group.size(), "max_tokens");
    std::vector<bool> active(group.size(), false);
    for (size_t m = 0; m < group.size(); ++m) {
      samplers.emplace_back(cfg.generate.sampling);
      streams.emplace_back(e.tokenizer(), group[m].stop, cfg.generate.stop_ids, cfg.generate.stop_at_eos);
      active[m] = group[m].max_new_tokens > 0;
    }
    for (int64_t k = 0;; ++k) {
      std::vector<int32_t> seqs, feed;
      std::vector<size_t> who;
      for (size_t m = 0; m < group.size(); ++m) {
        if (!active[m]) continue;
        const int32_t next = samplers[m].Sample(logits[m].data(), V);
        if (std::string stop = streams[m].Push(next); !stop.empty()) {
          reason[m] = std::move(stop);
          active[m] = false;
        } else if (k + 1 == group[m].max_new_tokens) {
          active[m] = false;
        } else {
          seqs.push_back(qslot[m]);
          feed.push_back(next);
          who.push_back(m);
        }
      }
      if (seqs.empty()) break;
      RETURN_IF_ERROR(e.DecodeStep(seqs, feed, &out));
      for (size_t r = 0; r < who.size(); ++r) logits[who[r]].assign(out.begin() + r * V, out.begin() + (r + 1) * V);
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / group.size();
    for (size_t m = 0; m < group.size(); ++m) {
      const Question& q = group[m];
      nlohmann::json j = {{"type", "answer"}, {"id", q.id}, {"prompt_tokens", q.ids.size()}, {"seconds", seconds}};
      if (!q.choice.empty()) {
        std::vector<int64_t> nt;
        for (const auto& c : q.choice) nt.push_back(static_cast<int64_t>(c.size()));
        j["choice_logprobs"] = lp[m];
        j["choice_tokens"] = nt;
      }
      if (q.max_new_tokens > 0) {
        streams[m].Finish();
        j["text"] = streams[m].text();
        j["tokens"] = streams[m].tokens();
        j["stop_reason"] = reason[m];
        if (dual) j["hit_rate_after_first"] = e.kv().SeqHitRate(qslot[m]);
      }
      std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
    }
    return absl::OkStatus();
  }();
  release();
  return status;
}

}  // namespace

absl::Status RunAnswer(const CliConfig& cfg) {
  RETURN_IF_ERROR(cfg.generate.sampling.Validate());
  if (cfg.prompt_file.empty()) return absl::InvalidArgumentError("answer needs --prompt_file (the shared context)");
  if (cfg.answer_group < 1 || cfg.answer_group > kMaxGroupSlots) {
    return absl::InvalidArgumentError(absl::StrCat("--answer_group must be in [1, ", kMaxGroupSlots, "], got ", cfg.answer_group));
  }
  ASSIGN_OR_RETURN(std::string context, ReadPrompt(cfg));
  ASSIGN_OR_RETURN(std::vector<Question> qs, ReadQuestions(cfg.questions_file));
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  ASSIGN_OR_RETURN(const engine::EngineOptions engine_options, CheckedEngineOptions(*model, cfg));
  ASSIGN_OR_RETURN(auto engine_ptr, engine::Engine::Create(*model, engine_options));
  engine::Engine& e = *engine_ptr;
  const auto& tok = e.tokenizer();
  const bool bos = tok.add_bos() && !cfg.raw_prompt;
  const int64_t n_ctx = model->config.n_ctx_train;
  const std::vector<int32_t> ctx_ids = tok.Encode(context, bos, /*parse_special=*/true);
  int64_t shared = static_cast<int64_t>(ctx_ids.size());
  int64_t total = 0;  // the longest any slot grows
  for (size_t i = 0; i < qs.size(); ++i) {
    Question& q = qs[i];
    q.ids = tok.Encode(context + q.text, bos, /*parse_special=*/true);
    if (absl::Status st = e.ValidatePrompt(q.ids); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("question ", q.id, ": ", st.message()));
    }
    int64_t longest_choice = 0;
    for (const std::string& c : q.choices) {
      std::vector<int32_t> all = tok.Encode(context + q.text + c, bos, /*parse_special=*/true);
      if (CommonPrefix(all, q.ids) != static_cast<int64_t>(q.ids.size()) || all.size() == q.ids.size()) {
        return absl::InvalidArgumentError(absl::StrCat("question ", q.id, ": choice '", c,
                                                       "' changes the tokens of the question before it (start the "
                                                       "choice with a space, end the question without one)"));
      }
      q.choice.emplace_back(all.begin() + q.ids.size(), all.end());
      longest_choice = std::max<int64_t>(longest_choice, q.choice.back().size());
    }
    // At least one token of each question is prefilled on its own fork (its logits start the answer).
    shared = std::min({shared, CommonPrefix(ctx_ids, q.ids), static_cast<int64_t>(q.ids.size()) - 1});
    const int64_t grow = static_cast<int64_t>(q.ids.size()) + std::max(q.max_new_tokens, longest_choice);
    if (grow > n_ctx) {
      return absl::InvalidArgumentError(absl::StrCat("question ", q.id, ": ", q.ids.size(), " prompt tokens + ",
                                                     grow - q.ids.size(), " to generate or score exceed the model context of ",
                                                     n_ctx));
    }
    total = std::max(total, grow);
  }
  if (shared < 1) return absl::InvalidArgumentError("the questions share no token with the context");
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  constexpr int32_t kBase = 0;
  const std::vector<int32_t> base(ctx_ids.begin(), ctx_ids.begin() + shared);
  RETURN_IF_ERROR(e.Admit(kBase, shared, total));
  ASSIGN_OR_RETURN(int64_t done, e.StartPrefill(kBase, base));
  const int64_t chunk = std::max<int64_t>(1, cfg.engine.prefill_chunk);
  auto last_report = t0;
  const bool tty = isatty(fileno(stderr));
  std::vector<std::vector<float>> unused;
  while (done < shared) {
    const engine::Engine::PrefillPiece piece{kBase, base, done, std::min(shared, done + chunk)};
    RETURN_IF_ERROR(e.PrefillParts(absl::MakeConstSpan(&piece, 1), &unused));
    done = piece.end;
    if (Clock::now() - last_report >= std::chrono::seconds(5)) {
      last_report = Clock::now();
      std::fprintf(stderr, "%s[ddctl] answer: context prefill %lld/%lld tokens%s", tty ? "\r" : "",
                   static_cast<long long>(done), static_cast<long long>(shared), tty ? "" : "\n");
    }
  }
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const bool dual = cfg.engine.mode == engine::DecodeMode::kDualDecoder;
  nlohmann::json head = {{"type", "context"},       {"model", model->config.name},
                         {"mode", std::string(engine::DecodeModeName(cfg.engine.mode))},
                         {"context_tokens", ctx_ids.size()}, {"shared_tokens", shared},
                         {"questions", qs.size()},  {"prefill_s", prefill_s},
                         {"prefix_reused_tokens", e.prefix_reused_tokens()}};
  if (cfg.engine.mode != engine::DecodeMode::kFull) head["budget_tokens"] = cfg.engine.sparse.budget_tokens;
  std::cout << head.dump() << std::endl;
  // Questions in groups: each group's question prefills, choice scoring and answers run as
  // batched forward passes over its slots (a CPU step costs about the same for a few rows as
  // for one while weight reads dominate). Same bits as one at a time: the kernels are
  // batch-invariant.
  for (size_t g = 0; g < qs.size();) {
    size_t end = g, slots = 0;
    auto need = [](const Question& q) {
      return std::max<size_t>(1, q.choice.size() + (q.max_new_tokens > 0 ? 1 : 0));
    };
    while (end < qs.size() && (end == g || slots + need(qs[end]) <= static_cast<size_t>(cfg.answer_group))) {
      slots += need(qs[end]);
      ++end;
    }
    RETURN_IF_ERROR(AnswerGroup(e, absl::MakeSpan(qs).subspan(g, end - g), shared, chunk, cfg, dual));
    g = end;
  }
  e.Release(kBase);
  return absl::OkStatus();
}

}  // namespace dd::ddctl
