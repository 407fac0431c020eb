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

ABSL_FLAG(std::string, model, "", "Model: a .gguf file or a Hugging Face safetensors directory "
          "(default: $DD_MODEL, else ~/.cache/dualdecoder/models/gemma-3-270m-q4_k_m.gguf)");
ABSL_FLAG(std::string, prompt, "", "Prompt text");
ABSL_FLAG(std::string, prompt_file, "", "Read the prompt from this file");
ABSL_FLAG(int64_t, max_new_tokens, 64, "Maximum tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 = greedy");
ABSL_FLAG(int32_t, top_k, 0, "Top-k sampling (0 = off)");
ABSL_FLAG(double, top_p, 1.0, "Top-p (nucleus) sampling, in (0, 1]");
ABSL_FLAG(uint64_t, seed, 0, "Sampling seed");
ABSL_FLAG(std::vector<std::string>, stop, {}, "Stop strings (comma-separated)");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past end-of-generation tokens");
ABSL_FLAG(int32_t, threads, 0, "Compute threads (0 = all cores)");
ABSL_FLAG(int64_t, prefill_chunk, 512, "Prefill chunk size in tokens");
ABSL_FLAG(std::string, matmul, "int8",
          "Weight matmul kernels: int8 (fast, activations quantized per 32) or f32 (exact)");
ABSL_FLAG(std::string, mode, "full", "Decode mode: full (all KV attended), sparse (top-k chunks fetched on demand) or dualdecoder (sparse with speculative-token prefetch)");
ABSL_FLAG(int64_t, budget, 2048, "sparse: tokens selected per step per KV head (multiple of 8)");
ABSL_FLAG(std::string, device_memory, "0",
          "Device-memory budget (e.g. 8GiB, 512MiB; 0 = unlimited): weights, workspace and the request's "
          "projected KV must fit, else the request is refused with the numbers");
ABSL_FLAG(std::string, kv_store, "inproc://",
          "sparse modes: where offloaded KV lives: inproc:// or shm://HOST:PORT (a dd-kv-pool on this host; "
          "token from $DD_KV_POOL_TOKEN)");
ABSL_FLAG(int64_t, prefix_block, 0,
          "Prefix reuse with a pool --kv_store (sparse modes): key prompts in blocks of this many tokens "
          "(e.g. 256); a prompt starting with a stored prefix skips prefilling it. 0 = off");
ABSL_FLAG(std::string, predictor, "speculative",
          "dualdecoder: what predicts the next step's chunks: speculative (default), previous, union, random, "
          "oracle (needs --oracle_tokens); for measuring hit rates, results do not change");
ABSL_FLAG(int64_t, prefetch_buffers, 2,
          "dualdecoder: prefetch buffers per request (2 = ping-pong); also the lead distance in sparse layers");
ABSL_FLAG(std::string, oracle_tokens, "", "predictor oracle: the tokens an earlier greedy run generated (comma-separated)");
ABSL_FLAG(int64_t, context, 4096, "fidelity: prompt tokens prefilled before scoring");
ABSL_FLAG(int64_t, score_tokens, 64, "fidelity: teacher-forced positions scored after --context");
ABSL_FLAG(bool, json, false, "Print a machine-readable JSON summary instead of streaming text");
ABSL_FLAG(bool, raw_prompt, false, "Do not add the BOS token to the prompt");
ABSL_FLAG(std::string, tokens, "", "logits: comma-separated token ids");
ABSL_FLAG(std::string, positions, "", "logits: comma-separated positions (default all)");
ABSL_FLAG(std::string, out, "", "logits: output .npy path");
ABSL_FLAG(std::string, text, "", "tokenize: text to tokenize");

namespace {

constexpr char kUsage[] =
    "ddctl COMMAND [flags]\n"
    "  generate   run the embedded default engine on --prompt / --prompt-file, streaming text\n"
    "  logits     write logits of --tokens at --positions to --out (.npy)\n"
    "  tokenize   print the token ids of --text\n"
    "  info       print the model's configuration\n"
    "  fidelity   teacher-force --prompt_file through full and --mode, print per-position KL (JSON)\n";

std::string DefaultModelPath(bool* defaulted) {
  *defaulted = false;
  std::string flag = absl::GetFlag(FLAGS_model);
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("DD_MODEL"); env != nullptr && *env != '\0') return env;
  *defaulted = true;
  const char* dir = std::getenv("DD_MODEL_DIR");
  if (dir != nullptr && *dir != '\0') return std::string(dir) + "/gemma-3-270m-q4_k_m.gguf";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/dualdecoder/models/gemma-3-270m-q4_k_m.gguf";
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
  cfg.model_path = DefaultModelPath(&cfg.model_path_defaulted);
  cfg.prompt = absl::GetFlag(FLAGS_prompt);
  cfg.prompt_file = absl::GetFlag(FLAGS_prompt_file);
  cfg.generate.max_new_tokens = absl::GetFlag(FLAGS_max_new_tokens);
  cfg.generate.sampling.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  cfg.generate.sampling.top_k = absl::GetFlag(FLAGS_top_k);
  cfg.generate.sampling.top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p));
  cfg.generate.sampling.seed = absl::GetFlag(FLAGS_seed);
  cfg.generate.stop_strings = absl::GetFlag(FLAGS_stop);
  cfg.generate.stop_at_eos = !absl::GetFlag(FLAGS_ignore_eos);
  cfg.engine.threads = absl::GetFlag(FLAGS_threads);
  cfg.engine.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  const std::string matmul = absl::GetFlag(FLAGS_matmul);
  if (matmul == "int8") {
    cfg.engine.matmul = dd::model::Transformer::MatMulKind::kInt8;
  } else if (matmul == "f32") {
    cfg.engine.matmul = dd::model::Transformer::MatMulKind::kF32;
  } else {
    std::cerr << "ddctl: --matmul must be int8 or f32, got '" << matmul << "'\n";
    return 2;
  }
  auto mode = dd::engine::ParseDecodeMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) {
    std::cerr << "ddctl: --mode: " << mode.status().message() << "\n";
    return 2;
  }
  cfg.engine.mode = *mode;
  cfg.engine.sparse.budget_tokens = absl::GetFlag(FLAGS_budget);
  auto device_memory = dd::engine::ParseByteSize(absl::GetFlag(FLAGS_device_memory), "device_memory");
  if (!device_memory.ok()) {
    std::cerr << "ddctl: " << device_memory.status().message() << "\n";
    return 2;
  }
  cfg.engine.device_memory_bytes = *device_memory;
  cfg.engine.kv_store = absl::GetFlag(FLAGS_kv_store);
  cfg.engine.prefix_block_tokens = absl::GetFlag(FLAGS_prefix_block);
  auto predictor = dd::engine::ParsePredictor(absl::GetFlag(FLAGS_predictor));
  if (!predictor.ok()) {
    std::cerr << "ddctl: --predictor: " << predictor.status().message() << "\n";
    return 2;
  }
  cfg.engine.sparse.predictor = *predictor;
  cfg.engine.sparse.prefetch_buffers = absl::GetFlag(FLAGS_prefetch_buffers);
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_oracle_tokens), ',', absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(t, &id) || id < 0) {
      std::cerr << "ddctl: --oracle_tokens: '" << t << "' is not a token id\n";
      return 2;
    }
    cfg.generate.oracle_tokens.push_back(id);
  }
  if (*predictor == dd::engine::Predictor::kOracleToken && cfg.generate.oracle_tokens.empty()) {
    std::cerr << "ddctl: --predictor oracle needs --oracle_tokens (the tokens of an earlier greedy run)\n";
    return 2;
  }
  if (const char* token = std::getenv("DD_KV_POOL_TOKEN"); token != nullptr) cfg.engine.kv_store_token = token;
  cfg.json = absl::GetFlag(FLAGS_json);
  cfg.raw_prompt = absl::GetFlag(FLAGS_raw_prompt);
  cfg.tokens = absl::GetFlag(FLAGS_tokens);
  cfg.positions = absl::GetFlag(FLAGS_positions);
  cfg.out = absl::GetFlag(FLAGS_out);
  cfg.text = absl::GetFlag(FLAGS_text);
  cfg.context = absl::GetFlag(FLAGS_context);
  cfg.score_tokens = absl::GetFlag(FLAGS_score_tokens);

  absl::Status st;
  if (cmd == "generate") st = dd::ddctl::RunGenerate(cfg);
  else if (cmd == "logits") st = dd::ddctl::RunLogits(cfg);
  else if (cmd == "tokenize") st = dd::ddctl::RunTokenize(cfg);
  else if (cmd == "info") st = dd::ddctl::RunInfo(cfg);
  else if (cmd == "fidelity") st = dd::ddctl::RunFidelity(cfg);
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
