// CPU model benchmark: prefill tokens/s at several prompt lengths, decode tokens/s at several
// batch sizes and context lengths, peak RSS. Writes one JSON object (bench/run model).
//
// Decode at batch B and context C: one sequence is prefilled to C tokens and forked into B
// slots (identical KV, independent continuation), so the figure is the decode cost at that
// context, not B more prefills.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/service/engine_flags.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, text_file, "/usr/share/common-licenses/GPL-3", "Natural text for prompts");
ABSL_FLAG(std::vector<std::string>, prefill, std::vector<std::string>({"1024", "8192"}), "Prompt lengths to prefill");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"1024", "8192"}), "Contexts for decode (empty: no decode, prefill only)");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "8"}), "Decode batch sizes");
ABSL_FLAG(int32_t, decode_steps, 16, "Decode steps per measurement");
ABSL_FLAG(std::string, out, "", "Write JSON here (default stdout)");

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
using dd::bench::Ints;
}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto loaded = dd::worker::LoadModelFromFlags();
  if (!loaded.ok()) {
    std::cerr << "model_bench: " << loaded.status().message() << "\n";
    return 1;
  }
  const auto& model = **loaded;
  auto prompts = dd::bench::TextPrompts::Load(model, absl::GetFlag(FLAGS_text_file));
  if (!prompts.ok()) {
    std::cerr << "model_bench: " << prompts.status().message() << "\n";
    return 1;
  }
  auto prompt_of = [&](int64_t n) { return prompts->Of(n); };
  // The engine's flags (--threads, --matmul, --mode, ...), resolved as ddctl resolves them.
  auto options = dd::worker::EngineOptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "model_bench: " << options.status().message() << "\n";
    return 1;
  }
  const dd::engine::EngineOptions& eo = *options;
  auto created = dd::engine::Engine::Create(model, eo);
  if (!created.ok()) {
    std::cerr << "model_bench: " << created.status().message() << "\n";
    return 1;
  }
  dd::engine::Engine& engine = **created;
  nlohmann::json result;
  result["model"] = model.config.name;
  result["model_path"] = model.source_path;
  result["threads"] = eo.threads > 0 ? eo.threads : static_cast<int>(std::thread::hardware_concurrency());
  result["prefill_chunk"] = eo.prefill_chunk;
  result["matmul"] = eo.matmul == dd::model::Transformer::MatMulKind::kF32 ? "f32" : "int8";
  result["device"] = eo.device;
  result["mode"] = std::string(dd::engine::DecodeModeName(eo.mode));
  for (int64_t n : Ints(absl::GetFlag(FLAGS_prefill), "--prefill", 1)) {
    auto p = prompt_of(n);
    const auto t0 = Clock::now();
    auto r = engine.Prefill(0, p);
    const auto t1 = Clock::now();
    if (!r.ok()) {
      std::cerr << "prefill " << n << ": " << r.status().message() << "\n";
      return 1;
    }
    // Memory at the end of the prefill: what the engine holds, what its plan projected, and
    // the process's resident set (the model's mmapped pages included).
    const double mib = 1024.0 * 1024.0;
    const dd::engine::RequestBytes req = engine.memory_plan().Request(n, n);
    const double projected = (engine.memory_plan().weight_bytes() + req.kv + req.workspace + req.prefill_extra) / mib;
    const double kv_mib = engine.kv_bytes() / mib, rss_mib = dd::bench::ResidentMiB();
    engine.Release(0);
    const double tps = n / Seconds(t0, t1);
    result["prefill"].push_back({{"prompt_tokens", n}, {"seconds", Seconds(t0, t1)}, {"tokens_per_s", tps},
                                 {"kv_mib", kv_mib}, {"projected_device_mib", projected},
                                 {"rss_mib", rss_mib}});
    std::fprintf(stderr, "prefill %6lld tokens: %8.1f tokens/s\n", static_cast<long long>(n), tps);
  }
  const int steps = absl::GetFlag(FLAGS_decode_steps);
  // An empty --contexts= measures prefill alone (bench/compare_prefill.py runs it so).
  const std::vector<std::string>& context_flag = absl::GetFlag(FLAGS_contexts);
  const std::vector<int64_t> contexts =
      context_flag.empty() ? std::vector<int64_t>{} : Ints(context_flag, "--contexts", 1);
  for (int64_t ctx : contexts) {
    auto p = prompt_of(ctx);
    auto r = engine.Prefill(0, p);
    if (!r.ok()) {
      std::cerr << "prefill " << ctx << ": " << r.status().message() << "\n";
      return 1;
    }
    const int32_t first = dd::engine::Argmax(r->data(), model.config.n_vocab);
    for (int64_t b : Ints(absl::GetFlag(FLAGS_batches), "--batches", 1)) {
      dd::bench::DecodeRun run(engine, b, first);
      absl::Status st = run.Start();
      if (st.ok()) st = run.Steps(steps);
      if (!st.ok()) {
        std::cerr << "decode: " << st.message() << "\n";
        return 1;
      }
      double seconds = 0;
      for (double ms : run.step_ms()) seconds += ms / 1000;
      const double tps = b * steps / seconds;
      result["decode"].push_back({{"context", ctx}, {"batch", b}, {"steps", steps},
                                  {"step_ms", 1000 * seconds / steps}, {"tokens_per_s", tps}});
      std::fprintf(stderr, "decode ctx %6lld batch %2lld: %8.2f tokens/s (%.1f ms/step)\n",
                   static_cast<long long>(ctx), static_cast<long long>(b), tps, 1000 * seconds / steps);
    }
    engine.Release(0);
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  result["peak_rss_mib"] = ru.ru_maxrss / 1024.0;
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::cout << result.dump(2) << "\n";
  } else {
    std::ofstream(out) << result.dump(2) << "\n";
  }
  return 0;
}
