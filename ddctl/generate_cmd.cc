#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "common/thread_pool.h"
#include "dd/backend/registry.h"
#include "ddctl/commands.h"
#include "ddctl/npy.h"
#include "decode-worker/model/chat_template.h"
#include "decode-worker/service/engine_flags.h"
#include "nlohmann/json.hpp"

namespace dd::ddctl {

absl::StatusOr<std::unique_ptr<model::LoadedModel>> Load(const CliConfig&) { return worker::LoadModelFromFlags(); }

absl::StatusOr<engine::EngineOptions> CheckedEngineOptions(const model::LoadedModel& model, const CliConfig& cfg) {
  engine::EngineOptions o = cfg.engine;
  RETURN_IF_ERROR(worker::ApplyDeviceCheck(model, &o));
  return o;
}

std::string DeviceWhy(const engine::EngineOptions& o) {
  return o.device_why.empty() || o.device_why == "requested" ? "" : absl::StrCat(" (", o.device_why, ")");
}

absl::StatusOr<std::string> ReadPrompt(const CliConfig& cfg) {
  if (!cfg.prompt.empty() && !cfg.prompt_file.empty()) {
    return absl::InvalidArgumentError("give either --prompt or --prompt_file, not both");
  }
  if (!cfg.prompt_file.empty()) {
    std::ifstream in(cfg.prompt_file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read prompt file ", cfg.prompt_file));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  if (cfg.prompt.empty()) return absl::InvalidArgumentError("no prompt: pass --prompt TEXT or --prompt_file PATH");
  return cfg.prompt;
}

namespace {

template <typename T>
absl::StatusOr<std::vector<T>> ParseList(const std::string& s, absl::string_view flag) {
  std::vector<T> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipWhitespace())) {
    T v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", part, "' is not an integer"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

absl::Status RunGenerate(const CliConfig& cfg) {
  RETURN_IF_ERROR(cfg.generate.sampling.Validate());
  if (cfg.generate.max_new_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("--max_new_tokens must be > 0, got ", cfg.generate.max_new_tokens));
  }
  ASSIGN_OR_RETURN(std::string prompt, ReadPrompt(cfg));
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  ASSIGN_OR_RETURN(const engine::EngineOptions engine_options, CheckedEngineOptions(*model, cfg));
  ASSIGN_OR_RETURN(auto engine_ptr, engine::Engine::Create(*model, engine_options));
  engine::Engine& engine = *engine_ptr;
  const auto& tok = engine.tokenizer();
  const std::string mode_name(engine::DecodeModeName(cfg.engine.mode));
  std::vector<int32_t> ids;
  if (cfg.chat) {
    ASSIGN_OR_RETURN(const model::ChatTemplate chat, model::ChatTemplateFor(*model));
    std::vector<model::ChatMessage> messages;
    if (!cfg.system.empty()) messages.push_back({"system", cfg.system});
    messages.push_back({"user", prompt});
    ASSIGN_OR_RETURN(ids, model::RenderChat(chat, tok, messages));
  } else {
    ids = tok.Encode(prompt, tok.add_bos() && !cfg.raw_prompt, /*parse_special=*/true);
  }
  if (!cfg.json) {
    std::fprintf(stderr, "[ddctl] model %s (%s, %lld layers), prompt %zu tokens, mode %s, device %s%s\n",
                 model->config.name.c_str(), model->config.arch_name.c_str(),
                 static_cast<long long>(model->config.n_layer), ids.size(), mode_name.c_str(),
                 std::string(engine.device_name()).c_str(), DeviceWhy(engine_options).c_str());
  }
  // Progress for long prompts: a line on stderr at most every 2 s (rewritten in place on a TTY).
  engine::GenerateOptions options = cfg.generate;
  const bool tty = isatty(fileno(stderr));
  auto last_report = std::chrono::steady_clock::now();
  const auto prefill_start = last_report;
  options.on_prefill_progress = [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (cfg.json || done == total || now - last_report < std::chrono::seconds(2)) {
      if (done == total && tty && !cfg.json && now - prefill_start >= std::chrono::seconds(2)) std::fprintf(stderr, "\n");
      return;
    }
    last_report = now;
    const double s = std::chrono::duration<double>(now - prefill_start).count();
    std::fprintf(stderr, "%s[ddctl] prefill %lld/%lld tokens (%.0f tokens/s)%s", tty ? "\r" : "",
                 static_cast<long long>(done), static_cast<long long>(total), done / s, tty ? "" : "\n");
  };
  auto on_text = [&](absl::string_view piece) {
    if (!cfg.json) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
  };
  ASSIGN_OR_RETURN(engine::GenerateResult r, engine.Generate(ids, options, on_text));
  const double n = static_cast<double>(r.tokens.size());
  const double decode_tps = (r.tokens.size() > 1 && r.decode_s > 0) ? (n - 1) / r.decode_s : 0.0;
  const double prefill_tps = r.ttft_s > 0 ? r.prompt_tokens / r.ttft_s : 0.0;
  if (cfg.json) {
    nlohmann::json j;
    j["model"] = model->config.name;
    j["mode"] = mode_name;
    j["kv_dtype"] = std::string(KvDtypeName(cfg.engine.kv_dtype));
    j["kv_saturated_values"] = engine.kv_saturated_values();
    if (const engine::KvCache* sc = &engine.kv(); sc->selects_chunks()) {
      j["budget_tokens"] = cfg.engine.sparse.budget_tokens;
      j["fetched_chunks"] = sc->fetched_chunks();
      j["device_gathered_chunks"] = sc->device_gathered_chunks();
      j["staged_gathered_chunks"] = sc->staged_gathered_chunks();
      j["direct_chunks"] = sc->direct_chunks();
      nlohmann::json per_layer = nlohmann::json::array();
      for (size_t l = 0; l < sc->layer_stats().size(); ++l) {
        const auto& st = sc->layer_stats()[l];
        if (st.selected > 0 || st.prefetched > 0) {
          nlohmann::json e = {{"layer", l},           {"selected_chunks", st.selected}, {"urgent_chunks", st.urgent},
                              {"reused_chunks", st.reused}, {"evictions", st.evictions}};
          if (cfg.engine.mode == engine::DecodeMode::kDualDecoder) {
            e["hit_rate"] = st.hit_rate();
            e["hit_rate_after_first"] = st.hit_rate_after_first();
            e["prefetched_chunks"] = st.prefetched;
          }
          if (const engine::KeyReconstructionPolicy* kr = sc->key_reconstruction(); kr->enabled()) {
            e["reconstructed_chunks"] = st.reconstructed;  // attended with rebuilt keys
            e["rebuilt_chunks"] = st.rebuilt;              // keys computed (resident slots keep them)
            e["reconstructing_steps"] = st.reconstructing_steps;
            e["key_bytes_saved"] = (st.urgent_values + st.prefetched_values) * (sc->block_bytes() / 2);
            e["reconstruction_switches"] = kr->switches(static_cast<int64_t>(l));
          }
          per_layer.push_back(std::move(e));
        }
      }
      const auto total = sc->total_stats();
      if (cfg.engine.mode == engine::DecodeMode::kDualDecoder) {
        j["hit_rate"] = total.hit_rate();
        j["hit_rate_after_first"] = total.hit_rate_after_first();  // without the pre-decoded first step
        j["predictor"] = std::string(engine::PredictorName(cfg.engine.sparse.predictor));
        j["spec_head"] = std::string(engine::SpecHeadName(engine.spec_head()));
        j["spec_resyncs"] = engine.spec_resyncs();
      }
      const engine::KvFetch fetch = engine.options().sparse.fetch;
      j["kv_fetch"] = std::string(engine::KvFetchName(fetch));
      j["step_cache"] = fetch == engine::KvFetch::kResident;  // the resident set
      j["per_layer"] = per_layer;
      j["reused_chunks"] = total.reused;
      j["evictions"] = total.evictions;
      // Bytes per decode step: on the critical path (urgent) and in the background (prefetch).
      const double steps = r.tokens.size() > 1 ? static_cast<double>(r.tokens.size() - 1) : 1.0;
      const int64_t bb = sc->block_bytes();
      const int64_t prefetch = engine::MovedBytes(total.prefetched, total.prefetched_values, bb);
      const int64_t urgent = engine::MovedBytes(total.urgent, total.urgent_values, bb);
      j["bytes_per_step"] = {{"urgent", urgent / steps}, {"prefetch", prefetch / steps}};
      j["prefetch_bytes"] = prefetch;
      j["urgent_bytes"] = urgent;
      j["wasted_bytes"] = engine::MovedBytes(total.wasted, total.wasted_values, bb);
      const engine::KeyReconstructionOptions& kro = engine.options().sparse.key_reconstruction;
      nlohmann::json kr = {{"mode", std::string(engine::KeyReconstructionName(kro.mode))}};
      if (kro.enabled()) {
        const engine::LowRankKeyCache* lr = sc->low_rank_keys();
        kr["rank"] = lr->rank();
        kr["basis_builds"] = lr->builds();
        kr["basis_build_s"] = lr->build_ns() * 1e-9;
        kr["reconstructed_chunks"] = total.reconstructed;
        kr["rebuilt_chunks"] = total.rebuilt;
        kr["values_only_chunks"] = sc->values_only_chunks();
        kr["key_bytes_saved"] = (total.urgent_values + total.prefetched_values) * (bb / 2);
      }
      j["key_reconstruction"] = kr;
    }
    const engine::MemoryPlan& plan = engine.memory_plan();
    const engine::RequestBytes rb = plan.Request(r.prompt_tokens, r.prompt_tokens + cfg.generate.max_new_tokens);
    const engine::KvBytes held = plan.DecodeKv(r.prompt_tokens + cfg.generate.max_new_tokens);
    j["device_memory"] = {{"budget_bytes", cfg.engine.device_memory_bytes},
                          {"weights_bytes", plan.weight_bytes()},
                          {"workspace_bytes", plan.shared_workspace_bytes() + rb.workspace},
                          {"kv_bytes_per_request", rb.kv},
                          {"prefill_extra_bytes", rb.prefill_extra},
                          // Of kv_bytes_per_request: the KV rows, and what selection and key
                          // reconstruction keep beside them.
                          {"per_request", {{"kv_rows", held.kv},
                                           {"resident_slots", held.resident},
                                           {"landmarks", held.landmarks},
                                           {"low_rank_keys", held.low_rank}}}};
    j["text"] = r.text;
    j["tokens"] = r.tokens;
    j["prompt_tokens"] = r.prompt_tokens;
    j["prefix_reused_tokens"] = r.prefix_reused_tokens;
    j["generated_tokens"] = r.tokens.size();
    j["stop_reason"] = r.stop_reason;
    j["ttft_s"] = r.ttft_s;
    j["prefill_tokens_per_s"] = prefill_tps;
    j["decode_tokens_per_s"] = decode_tps;
    // Generated bytes need not be valid UTF-8 (a model can emit any byte token): replace.
    std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::printf("\n");
    std::fprintf(stderr,
                 "[ddctl] prompt %lld tokens, generated %zu tokens (stop: %s)\n"
                 "[ddctl] TTFT %.3f s (prefill %.1f tokens/s), decode %.2f tokens/s\n",
                 static_cast<long long>(r.prompt_tokens), r.tokens.size(), r.stop_reason.c_str(), r.ttft_s,
                 prefill_tps, decode_tps);
  }
  return absl::OkStatus();
}

absl::Status RunLogits(const CliConfig& cfg) {
  if (cfg.out.empty()) return absl::InvalidArgumentError("--out is required");
  ASSIGN_OR_RETURN(std::vector<int32_t> tokens, ParseList<int32_t>(cfg.tokens, "tokens"));
  ASSIGN_OR_RETURN(std::vector<int64_t> positions, ParseList<int64_t>(cfg.positions, "positions"));
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  ASSIGN_OR_RETURN(const engine::EngineOptions engine_options, CheckedEngineOptions(*model, cfg));
  ASSIGN_OR_RETURN(auto engine, engine::Engine::Create(*model, engine_options));
  ASSIGN_OR_RETURN(std::vector<float> logits, engine->PromptLogits(0, tokens, positions));
  const int64_t rows = positions.empty() ? static_cast<int64_t>(tokens.size()) : static_cast<int64_t>(positions.size());
  return WriteNpyF32(cfg.out, {rows, model->config.n_vocab}, logits.data());
}

absl::Status RunTokenize(const CliConfig& cfg) {
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  std::string text = cfg.text;
  if (!cfg.prompt_file.empty()) {
    ASSIGN_OR_RETURN(text, ReadPrompt(cfg));
  }
  const auto& tok = *model->tokenizer;
  std::vector<int32_t> ids = tok.Encode(text, tok.add_bos() && !cfg.raw_prompt, /*parse_special=*/true);
  std::printf("%s\n", absl::StrJoin(ids, ",").c_str());
  return absl::OkStatus();
}

absl::Status RunInfo(const CliConfig& cfg) {
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  const auto& c = model->config;
  nlohmann::json j;
  j["path"] = model->source_path;
  j["format"] = model->format;
  j["name"] = c.name;
  j["arch"] = c.arch_name;
  j["n_layer"] = c.n_layer;
  j["n_embd"] = c.n_embd;
  j["n_head"] = c.n_head;
  j["n_head_kv"] = c.n_head_kv;
  j["head_dim"] = c.head_dim;
  j["n_ff"] = c.n_ff;
  j["n_vocab"] = c.n_vocab;
  j["context_length"] = c.n_ctx_train;
  j["sliding_window"] = c.sliding_window;
  std::vector<int64_t> global;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    if (!c.layer_is_swa[l]) global.push_back(l);
  }
  j["global_layers"] = global;
  // The compute devices --device may name, each usable or the reason it is not.
  ThreadPool pool(1);
  nlohmann::json devices = nlohmann::json::object();
  for (const char* name : {"cpu", "sim", "cuda"}) {
    // A small budget: cuda would otherwise take 90% of the GPU's memory to answer.
    auto d = backend::CreateDevice(name, {.budget_bytes = 1 << 20, .pool = &pool});
    if (!d.ok()) {
      devices[name] = std::string(d.status().message());
    } else {
      devices[name] = "usable";
    }
  }
  j["devices"] = devices;
  // What the default --device (auto) takes here, and why.
  std::string why;
  const std::string chosen = backend::ResolveDeviceName("auto", &why);
  j["device_auto"] = absl::StrCat(chosen, " (", why, ")");
  if (chosen != "cpu") j["device_auto_check"] = "taken only if the start-up device check passes (ddctl device-check)";
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  return absl::OkStatus();
}

}  // namespace dd::ddctl
