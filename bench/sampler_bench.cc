// The sampler alone on a model's real next-token distributions: the logits of every position of
// a text prompt (teacher-forced), each sampled under several settings, beside a sampler that
// sorts the whole vocabulary (the way this engine sampled before, and the cost the partial
// selection avoids). Prints JSON: microseconds per token per setting.
//   dd-bench-sampler --model gemma --text_file /usr/share/common-licenses/GPL-3 [--rows 64] [--reps 5]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/sampler.h"
#include "decode-worker/service/engine_flags.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, text_file, "/usr/share/common-licenses/GPL-3", "Natural text for the prompt");
ABSL_FLAG(int64_t, rows, 64, "Prompt positions whose logits are sampled");
ABSL_FLAG(int64_t, reps, 5, "Passes over the rows per setting");

namespace {

using dd::engine::SamplingParams;

// Temperature and top-p by sorting every token first: the cost this benchmark compares against.
int32_t FullSortSample(const float* logits, int64_t n, float temperature, float top_p, std::mt19937_64& rng,
                       std::vector<std::pair<float, int32_t>>& c) {
  c.resize(n);
  for (int64_t i = 0; i < n; ++i) c[i] = {logits[i] / temperature, static_cast<int32_t>(i)};
  std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  const float mx = c[0].first;
  double total = 0;
  for (auto& x : c) total += (x.first = std::exp(x.first - mx));
  double acc = 0;
  int64_t keep = n;
  for (int64_t i = 0; i < n; ++i) {
    acc += c[i].first / total;
    if (acc >= top_p) {
      keep = i + 1;
      break;
    }
  }
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += c[i].first;
  const double u = std::uniform_real_distribution<double>(0.0, kept)(rng);
  acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += c[i].first;
    if (u < acc) return c[i].second;
  }
  return c[keep - 1].second;
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The engine's flags (--model, --threads, ...), resolved as ddctl resolves them.
  auto model = dd::worker::LoadModelFromFlags();
  auto options = dd::worker::EngineOptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "dd-bench-sampler: " << options.status() << "\n";
    return 1;
  }
  if (!model.ok()) {
    std::cerr << "dd-bench-sampler: " << model.status() << "\n";
    return 1;
  }
  std::ifstream in(absl::GetFlag(FLAGS_text_file));
  std::stringstream ss;
  ss << in.rdbuf();
  const auto& tok = *(*model)->tokenizer;
  std::vector<int32_t> ids = tok.Encode(ss.str(), tok.add_bos(), false);
  const int64_t rows = std::min<int64_t>(absl::GetFlag(FLAGS_rows), static_cast<int64_t>(ids.size()));
  if (rows < 2) {
    std::cerr << "dd-bench-sampler: the text file has too few tokens\n";
    return 1;
  }
  ids.resize(rows);
  auto engine = dd::engine::Engine::Create(**model, *options);
  if (!engine.ok()) {
    std::cerr << "dd-bench-sampler: " << engine.status() << "\n";
    return 1;
  }
  auto logits = (*engine)->PromptLogits(0, ids, {});
  if (!logits.ok()) {
    std::cerr << "dd-bench-sampler: " << logits.status() << "\n";
    return 1;
  }
  const int64_t n = (*model)->config.n_vocab;
  const int64_t reps = std::max<int64_t>(1, absl::GetFlag(FLAGS_reps));
  struct Setting {
    std::string name;
    SamplingParams params;
  };
  const std::vector<Setting> settings = {
      {"greedy", {}},
      {"temperature 1", {.temperature = 1.0f}},
      {"temperature 1, top-p 0.95", {.temperature = 1.0f, .top_p = 0.95f}},
      {"temperature 0.7, top-k 40", {.temperature = 0.7f, .top_k = 40}},
      {"temperature 1, min-p 0.05", {.temperature = 1.0f, .min_p = 0.05f}},
      {"temperature 1, top-p 0.95, penalties", {.temperature = 1.0f, .top_p = 0.95f, .repetition_penalty = 1.1f,
                                                .frequency_penalty = 0.5f, .presence_penalty = 0.5f}},
  };
  nlohmann::json out = {{"model", (*model)->config.name}, {"n_vocab", n}, {"rows", rows}, {"reps", reps},
                        {"settings", nlohmann::json::array()}};
  int64_t sink = 0;
  for (const Setting& s : settings) {
    dd::engine::Sampler sampler(s.params);
    sampler.SetPrompt(ids);
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r) {
      for (int64_t i = 0; i < rows; ++i) sink += sampler.Sample(logits->data() + i * n, n);
    }
    const double us = Seconds(t0) * 1e6 / static_cast<double>(reps * rows);
    out["settings"].push_back({{"setting", s.name}, {"us_per_token", us}});
    std::fprintf(stderr, "dd-bench-sampler: %-40s %9.1f us/token\n", s.name.c_str(), us);
  }
  std::mt19937_64 rng(1);
  std::vector<std::pair<float, int32_t>> scratch;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) {
    for (int64_t i = 0; i < rows; ++i) sink += FullSortSample(logits->data() + i * n, n, 1.0f, 0.95f, rng, scratch);
  }
  const double us = Seconds(t0) * 1e6 / static_cast<double>(reps * rows);
  out["full_sort_top_p_us_per_token"] = us;
  std::fprintf(stderr, "dd-bench-sampler: %-40s %9.1f us/token\n", "full sort, temperature 1, top-p 0.95", us);
  out["checksum"] = sink;  // keeps the samples from being optimized away
  std::cout << out.dump(2) << "\n";
  return 0;
}
