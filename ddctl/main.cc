// ddctl: the DualDecoder command-line client. `ddctl generate` runs the embedded default
// (in-process engine, CPU) on a prompt; the other commands inspect models.
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "ddctl/commands.h"
#include "decode-worker/service/engine_flags.h"
#include "proto/cluster_auth.h"

ABSL_FLAG(std::string, prompt, "", "Prompt text");
ABSL_FLAG(std::string, prompt_file, "", "Read the prompt from this file");
ABSL_FLAG(int64_t, max_new_tokens, 64, "Maximum tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "Top-k sampling (0 = off)");
ABSL_FLAG(double, top_p, 1.0, "Top-p (nucleus) sampling, in (0, 1]");
ABSL_FLAG(double, min_p, 0.0, "Min-p sampling: keep tokens at least this fraction as likely as the best (0 = off)");
ABSL_FLAG(double, repetition_penalty, 1.0,
          "Divide a positive logit (multiply a negative one) of every token in the prompt or output by this (1 = off)");
ABSL_FLAG(double, frequency_penalty, 0.0, "Subtract this x a token's count in the output from its logit, in [-2, 2]");
ABSL_FLAG(double, presence_penalty, 0.0, "Subtract this from the logit of every token in the output, in [-2, 2]");
ABSL_FLAG(uint64_t, seed, 0, "Sampling seed; synth-model: the weights' seed (0 is taken as 1)");
ABSL_FLAG(std::string, shape, "", "synth-model: the shape (llama-3.1-8b, gemma3-270m, smollm2-135m)");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Stop strings (comma-separated)");
ABSL_FLAG(std::string, stop_ids, "", "Token ids that end the output (comma-separated), like EOS");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past end-of-generation tokens");
ABSL_FLAG(std::string, oracle_tokens, "", "predictor oracle: the tokens an earlier greedy run generated (comma-separated)");
ABSL_FLAG(int64_t, context, 4096, "fidelity: prompt tokens prefilled before scoring");
ABSL_FLAG(int64_t, score_tokens, 64, "fidelity: teacher-forced positions scored after --context");
ABSL_FLAG(std::string, budgets, "",
          "fidelity: comma-separated budgets, each a sparse run against one shared full run (default --budget)");
ABSL_FLAG(std::string, reference_kv_dtype, "",
          "fidelity: the full run's KV type (default: --kv_dtype); with --mode full and another --kv_dtype, the "
          "loss of that KV type alone");
ABSL_FLAG(std::string, key_ranks, "",
          "fidelity: comma-separated ranks, each a run at --budget with every sparse layer's keys rebuilt from a "
          "low-rank key cache of that rank (0 = keys fetched: the sparse run itself)");
ABSL_FLAG(std::string, key_reconstructions, "",
          "fidelity: comma-separated key reconstructions, each a run at --budget: off, auto, all, or layers:L+L+...");
ABSL_FLAG(std::string, each_sparse_layer, "",
          "fidelity: comma-separated global layers, each a run at --budget with only that layer sparse");
ABSL_FLAG(std::string, questions_file, "", "answer: JSON lines of questions over the --prompt_file context");
ABSL_FLAG(int64_t, answer_group, 16,
          "answer: sequences run together (a question's fork plus one per choice); each copies the context's KV");
ABSL_FLAG(bool, json, false, "Print a machine-readable JSON summary instead of streaming text");
ABSL_FLAG(bool, raw_prompt, false, "Do not add the BOS token to the prompt");
ABSL_FLAG(bool, chat, false, "generate: send the prompt as a user message in the model's chat format");
ABSL_FLAG(std::string, system, "", "generate --chat: a system message before it");
ABSL_FLAG(std::string, tokens, "", "logits: comma-separated token ids");
ABSL_FLAG(std::string, positions, "", "logits: comma-separated positions (default all)");
ABSL_FLAG(std::string, out, "", "logits: output .npy path; synth-model: the .gguf file to write");
ABSL_FLAG(std::string, text, "", "tokenize: text to tokenize");
ABSL_FLAG(std::string, server, "",
          "generate/health/stats/workers: a router or `ddctl serve` at HOST:PORT (generate: a comma-separated list "
          "of router replicas to fail over between)");
ABSL_FLAG(std::string, worker, "", "stats: a decode worker at HOST:PORT");
ABSL_FLAG(std::string, service, "", "grpc-health: the service to ask about (default: the whole server)");
ABSL_FLAG(std::string, model_name, "", "generate --server: the model to ask for (default: the one served)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "serve: gRPC address for clients (port 0 = pick one)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "serve: Prometheus /metrics address (empty = off)");
ABSL_FLAG(std::string, api_key_file, "",
          "generate/stats/workers --server: file holding the API key (tenant or operator; one line, mode 0600); "
          "default $DD_API_KEY");
ABSL_FLAG(std::string, internal_listen, "127.0.0.1:0",
          "serve: address of the internal services (worker registry, Worker.Submit/Cancel/Stats), apart from the "
          "public API; they require the cluster secret");
ABSL_FLAG(int64_t, deadline_ms, 0, "generate --server: request deadline in ms (0 = none)");
ABSL_FLAG(std::string, request_id, "",
          "generate --server: the request's id, reported back in its usage and named by a reconnect (empty: ddctl "
          "makes one)");
ABSL_FLAG(int64_t, reconnect_ms, 60000,
          "generate --server: how long to keep reconnecting when the stream breaks (UNAVAILABLE), going round the "
          "routers in --server HOST:PORT,HOST:PORT and resuming after the tokens received; 0 = one router, no retry");
ABSL_FLAG(bool, events, false, "generate --server: print each streamed message as a JSON line, then the summary");

namespace {

constexpr char kUsage[] =
    "ddctl COMMAND [flags]\n"
    "  generate   run the embedded default engine on --prompt / --prompt_file, streaming text\n"
    "  logits     write logits of --tokens at --positions to --out (.npy)\n"
    "  tokenize   print the token ids of --text\n"
    "  info       print the model's configuration\n"
    "  synth-model   write a random-weight model of a real model's shape (--shape) to --out,\n"
    "             for benchmarks only (it generates noise)\n"
    "  answer     many questions (--questions_file, JSON lines) over one context (--prompt_file),\n"
    "             the context prefilled once; one JSON line per answer\n"
    "  fidelity   teacher-force --prompt_file through full and --mode (or full in --reference_kv_dtype\n"
    "             and --kv_dtype), print per-position KL (JSON)\n"
    "  device-check   the start-up check of --device (auto, sim, cuda) in --mode against the cpu:\n"
    "             a short greedy decode on both, logits compared row by row; exit 1 if it fails\n"
    "  serve      the embedded server: router + worker + in-process pool on --listen (gRPC)\n"
    "  generate --server HOST:PORT   stream a generation from a router or `ddctl serve`\n"
    "  health | stats | workers --server HOST:PORT   router health, counters, worker registry\n"
    "  cancel --server HOST:PORT --request_id ID   end a stream started with that id, wherever it runs\n"
    "  stats --worker HOST:PORT      a decode worker's load and counters\n"
    "  grpc-health --server HOST:PORT [--service NAME]   gRPC's standard health check (any server)\n";

// Comma-separated token ids into *out; false (after saying which) on anything else.
bool ParseIds(const std::string& text, const char* flag, std::vector<int32_t>* out) {
  for (absl::string_view t : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(t, &id) || id < 0) {
      std::cerr << "ddctl: --" << flag << ": '" << t << "' is not a token id\n";
      return false;
    }
    out->push_back(id);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << kUsage << "(expected exactly one command)\n";
    return 2;
  }
  const std::string cmd = args[1];
  dd::ddctl::CliConfig cfg;
  cfg.prompt = absl::GetFlag(FLAGS_prompt);
  cfg.prompt_file = absl::GetFlag(FLAGS_prompt_file);
  cfg.generate.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  cfg.generate.sampling.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  cfg.generate.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  cfg.generate.sampling.top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p));
  cfg.generate.sampling.seed = absl::GetFlag(FLAGS_seed);
  cfg.generate.sampling.min_p = static_cast<float>(absl::GetFlag(FLAGS_min_p));
  cfg.generate.sampling.repetition_penalty = static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty));
  cfg.generate.sampling.frequency_penalty = static_cast<float>(absl::GetFlag(FLAGS_frequency_penalty));
  cfg.generate.sampling.presence_penalty = static_cast<float>(absl::GetFlag(FLAGS_presence_penalty));
  cfg.generate.stop_strings = absl::GetFlag(FLAGS_stop);
  if (!ParseIds(absl::GetFlag(FLAGS_stop_ids), "stop_ids", &cfg.generate.stop_ids)) return 2;
  cfg.generate.stop_at_eos = !absl::GetFlag(FLAGS_ignore_eos);
  auto engine_options = dd::worker::EngineOptionsFromFlags(/*serving=*/cmd == "serve");
  if (!engine_options.ok()) {
    std::cerr << "ddctl: " << engine_options.status().message() << "\n";
    return 2;
  }
  cfg.engine = *engine_options;
  if (!ParseIds(absl::GetFlag(FLAGS_oracle_tokens), "oracle_tokens", &cfg.generate.oracle_tokens)) return 2;
  if (cfg.engine.sparse.predictor == dd::engine::Predictor::kOracleToken && cfg.generate.oracle_tokens.empty()) {
    std::cerr << "ddctl: --predictor oracle needs --oracle_tokens (the tokens of an earlier greedy run)\n";
    return 2;
  }
  cfg.json = absl::GetFlag(FLAGS_json);
  cfg.raw_prompt = absl::GetFlag(FLAGS_raw_prompt);
  cfg.chat = absl::GetFlag(FLAGS_chat);
  cfg.system = absl::GetFlag(FLAGS_system);
  cfg.tokens = absl::GetFlag(FLAGS_tokens);
  cfg.positions = absl::GetFlag(FLAGS_positions);
  cfg.out = absl::GetFlag(FLAGS_out);
  cfg.text = absl::GetFlag(FLAGS_text);
  cfg.context = absl::GetFlag(FLAGS_context);
  cfg.score_tokens = absl::GetFlag(FLAGS_score_tokens);
  cfg.fidelity_budgets = absl::GetFlag(FLAGS_budgets);
  cfg.fidelity_layers = absl::GetFlag(FLAGS_each_sparse_layer);
  cfg.fidelity_key_ranks = absl::GetFlag(FLAGS_key_ranks);
  cfg.fidelity_reconstructions = absl::GetFlag(FLAGS_key_reconstructions);
  cfg.fidelity_reference_kv_dtype = absl::GetFlag(FLAGS_reference_kv_dtype);
  cfg.questions_file = absl::GetFlag(FLAGS_questions_file);
  cfg.answer_group = absl::GetFlag(FLAGS_answer_group);

  cfg.server = absl::GetFlag(FLAGS_server);
  cfg.worker = absl::GetFlag(FLAGS_worker);
  cfg.service = absl::GetFlag(FLAGS_service);
  cfg.model_name = absl::GetFlag(FLAGS_model_name);
  cfg.listen = absl::GetFlag(FLAGS_listen);
  cfg.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  cfg.internal_listen = absl::GetFlag(FLAGS_internal_listen);
  cfg.deadline_ms = absl::GetFlag(FLAGS_deadline_ms);
  cfg.request_id = absl::GetFlag(FLAGS_request_id);
  cfg.reconnect_ms = std::max<int64_t>(0, absl::GetFlag(FLAGS_reconnect_ms));
  cfg.events = absl::GetFlag(FLAGS_events);
  cfg.shape = absl::GetFlag(FLAGS_shape);
  if (auto tls = dd::TlsFilesFromFlags(); tls.ok()) {
    cfg.tls = *std::move(tls);
  } else {
    std::cerr << "ddctl: " << tls.status().message() << "\n";
    return 2;
  }
  if (const std::string path = absl::GetFlag(FLAGS_api_key_file); !path.empty()) {
    auto key = dd::LoadClusterSecret(path);  // same format and checks as the cluster secret
    if (!key.ok()) {
      std::cerr << "ddctl: --api_key_file: " << key.status().message() << "\n";
      return 2;
    }
    cfg.api_key = *key;
  } else if (const char* env = std::getenv("DD_API_KEY"); env != nullptr) {
    cfg.api_key = env;
  }
  if (auto secret = dd::ClusterSecretFromFlags(); secret.ok()) {
    cfg.cluster_secret = *secret;
  } else {
    std::cerr << "ddctl: " << secret.status().message() << "\n";
    return 2;
  }

  absl::Status st;
  if (cmd == "generate" && !cfg.server.empty()) st = dd::ddctl::RunRemoteGenerate(cfg);
  else if (cmd == "generate") st = dd::ddctl::RunGenerate(cfg);
  else if (cmd == "serve") st = dd::ddctl::RunServe(cfg);
  else if (cmd == "health") st = dd::ddctl::RunHealth(cfg);
  else if (cmd == "cancel") st = dd::ddctl::RunCancel(cfg);
  else if (cmd == "grpc-health") st = dd::ddctl::RunGrpcHealth(cfg);
  else if (cmd == "stats") st = dd::ddctl::RunStats(cfg);
  else if (cmd == "workers") st = dd::ddctl::RunWorkers(cfg);
  else if (cmd == "logits") st = dd::ddctl::RunLogits(cfg);
  else if (cmd == "tokenize") st = dd::ddctl::RunTokenize(cfg);
  else if (cmd == "info") st = dd::ddctl::RunInfo(cfg);
  else if (cmd == "synth-model") st = dd::ddctl::RunSynthModel(cfg);
  else if (cmd == "fidelity") st = dd::ddctl::RunFidelity(cfg);
  else if (cmd == "answer") st = dd::ddctl::RunAnswer(cfg);
  else if (cmd == "device-check") st = dd::ddctl::RunDeviceCheck(cfg);
  else {
    std::cerr << "ddctl: unknown command '" << cmd << "'\n" << kUsage;
    return 2;
  }
  if (!st.ok()) {
    std::cerr << "ddctl " << cmd << ": error: " << st.message() << "\n";
    return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
