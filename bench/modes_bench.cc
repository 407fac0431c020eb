// Decode-modes benchmark (DESIGN §5, issue "sparse KV + dual-token"): full vs sparse vs
// dualdecoder, side by side in one run, per context, batch and link. Writes one JSON object.
//
// Each (mode, context) prefills one sequence once and forks it into the batch's slots, so a
// figure is the decode cost at that context. The `pcie5` link is calibrated in this run so
// that fetching one sparse layer's budget for one request takes as long as one layer of
// `full` compute at batch 1 (the design's "link time comparable to compute" regime,
// docs/decisions.md); `inmem` is an infinitely fast link.
#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/bench_util.h"
#include "decode-worker/engine/engine.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "Model path");
ABSL_FLAG(std::vector<std::string>, contexts, std::vector<std::string>({"4096"}), "Context lengths");
ABSL_FLAG(std::vector<std::string>, batches, std::vector<std::string>({"1", "4"}), "Batch sizes");
ABSL_FLAG(int64_t, budget, 1024, "Sparse budget in tokens");
ABSL_FLAG(int32_t, steps, 12, "Timed decode steps per run");
ABSL_FLAG(double, device_memory_gib, 1.0, "Device KV budget used to report each mode's max batch");
ABSL_FLAG(std::string, text_file, "/usr/share/common-licenses/GPL-3", "Natural text for prompts");
ABSL_FLAG(std::string, out, "", "Output JSON path");

namespace {
using Clock = std::chrono::steady_clock;
using dd::engine::DecodeMode;

using dd::bench::Ints;

using Totals = dd::engine::SparseKvCache::LayerStats;
Totals Sum(const dd::engine::Engine& e) { return e.sparse_cache() ? e.sparse_cache()->total_stats() : Totals(); }
}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto loaded = dd::model::LoadModel(absl::GetFlag(FLAGS_model));
  if (!loaded.ok()) {
    std::cerr << "modes_bench: " << loaded.status().message() << "\n";
    return 1;
  }
  const auto& model = **loaded;
  auto prompts = dd::bench::TextPrompts::Load(model, absl::GetFlag(FLAGS_text_file));
  if (!prompts.ok()) {
    std::cerr << "modes_bench: " << prompts.status().message() << "\n";
    return 1;
  }
  const int64_t V = model.config.n_vocab, budget = absl::GetFlag(FLAGS_budget);
  const int steps = absl::GetFlag(FLAGS_steps);
  const double budget_bytes = absl::GetFlag(FLAGS_device_memory_gib) * (1 << 30);
  nlohmann::json runs = nlohmann::json::array();
  double pcie_gbps = 0;
  for (int64_t ctx : Ints(absl::GetFlag(FLAGS_contexts))) {
    const std::vector<int32_t> prompt = prompts->Of(ctx);
    for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparse, DecodeMode::kDualDecoder}) {
      dd::engine::EngineOptions o;
      o.mode = mode;
      o.sparse.budget_tokens = budget;
      auto engine = dd::engine::Engine::Create(model, o);
      if (!engine.ok()) {
        std::cerr << engine.status().message() << "\n";
        return 1;
      }
      dd::engine::Engine& e = **engine;
      auto first = e.Prefill(0, prompt);
      if (!first.ok()) {
        std::cerr << first.status().message() << "\n";
        return 1;
      }
      const int32_t t0 = dd::engine::Argmax(first->data(), V);
      std::vector<std::string> links = {"inmem"};
      if (mode != DecodeMode::kFull) links.push_back("pcie5");
      for (const std::string& link : links) {
        dd::kvpool::LinkModel lm;
        if (link == "pcie5") lm = {.bandwidth_gbps = pcie_gbps, .latency_us = 10};
        e.SetLink(lm);
        for (int64_t b : Ints(absl::GetFlag(FLAGS_batches))) {
          std::vector<int32_t> seqs, tokens;
          for (int64_t s = 0; s < b; ++s) {
            if (auto fs = e.Fork(0, static_cast<int32_t>(s + 1)); !fs.ok()) {
              std::cerr << "fork: " << fs.message() << "\n";
              return 1;
            }
            seqs.push_back(static_cast<int32_t>(s + 1));
            tokens.push_back(t0);
          }
          std::vector<float> logits;
          if (auto ws = e.DecodeStep(seqs, tokens, &logits); !ws.ok()) {  // warm-up (and pre-decoding)
            std::cerr << "decode: " << ws.message() << "\n";
            return 1;
          }
          const Totals before = Sum(e);
          const int64_t wait0 = e.transfer_wait_ns();
          std::vector<double> step_ms;
          for (int i = 0; i < steps; ++i) {
            for (int64_t s = 0; s < b; ++s) tokens[s] = dd::engine::Argmax(&logits[s * V], V);
            const auto a = Clock::now();
            if (auto st = e.DecodeStep(seqs, tokens, &logits); !st.ok()) {
              std::cerr << st.message() << "\n";
              return 1;
            }
            step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
          }
          const Totals after = Sum(e);
          const double total_ms = [&] { double t = 0; for (double x : step_ms) t += x; return t; }();
          std::vector<double> sorted = step_ms;
          std::sort(sorted.begin(), sorted.end());
          const int64_t bb = e.sparse_cache() ? e.sparse_cache()->block_bytes() : 0;
          const double dev_per_req = static_cast<double>(e.kv_bytes()) / (b + 1);  // slot 0 holds the prompt too
          nlohmann::json r = {
              {"mode", std::string(dd::engine::DecodeModeName(mode))}, {"context", ctx}, {"batch", b},
              {"link", link}, {"link_gbps", link == "pcie5" ? pcie_gbps : 0.0}, {"budget_tokens", budget},
              {"tokens_per_s", b * steps / (total_ms / 1000)}, {"step_ms_p50", sorted[sorted.size() / 2]},
              {"hit_rate", after.predicted_for > before.predicted_for ? double(after.hits - before.hits) / (after.predicted_for - before.predicted_for) : 0.0},
              {"prefetch_bytes", (after.prefetched - before.prefetched) * bb},
              {"urgent_bytes", (after.urgent - before.urgent) * bb},
              {"wasted_bytes", (after.wasted - before.wasted) * bb},
              {"wait_ms_per_step", (e.transfer_wait_ns() - wait0) / 1e6 / steps},
              {"device_bytes_per_request", dev_per_req},
              {"max_batch_in_budget", static_cast<int64_t>(budget_bytes / dev_per_req)}};
          runs.push_back(r);
          std::fprintf(stderr, "%-11s ctx %6lld batch %2lld link %-5s: %7.2f tok/s  p50 %6.1f ms  hit %.3f  wait %.2f ms/step\n",
                       std::string(dd::engine::DecodeModeName(mode)).c_str(), static_cast<long long>(ctx),
                       static_cast<long long>(b), link.c_str(), r["tokens_per_s"].get<double>(),
                       r["step_ms_p50"].get<double>(), r["hit_rate"].get<double>(), r["wait_ms_per_step"].get<double>());
          for (int32_t s : seqs) e.Release(s);
          if (mode == DecodeMode::kFull && b == 1 && pcie_gbps == 0) {
            // Calibrate the pcie5 link: one sparse layer's budget for one request per layer-time.
            const double layer_ms = sorted[sorted.size() / 2] / model.config.n_layer;
            const double bytes = static_cast<double>(budget) / 8 * model.config.n_head_kv * 2 * 8 *
                                 model.config.head_dim * 4;
            pcie_gbps = bytes / (layer_ms * 1e6);
            std::fprintf(stderr, "pcie5-equivalent link: %.3f GB/s (%.0f KB per sparse layer in %.3f ms)\n", pcie_gbps,
                         bytes / 1024, layer_ms);
          }
        }
      }
    }
  }
  nlohmann::json doc = {{"model", model.config.name}, {"runs", runs}, {"pcie5_equivalent_gbps", pcie_gbps},
                        {"device_memory_gib", absl::GetFlag(FLAGS_device_memory_gib)}};
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) std::cout << doc.dump(2) << "\n";
  else std::ofstream(out) << doc.dump(2) << "\n";
  return 0;
}
