// dd-bench-serve: an open-loop load generator for the public Generate API. For each arrival
// rate, requests arrive as a Poisson process (seeded exponential gaps) regardless of how fast
// earlier ones finish; each streams its tokens and records time to first token, time per
// output token after the first, and its status. Writes one JSON object per rate to --out.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "proto/generate.grpc.pb.h"

ABSL_FLAG(std::string, server, "", "Router or `ddctl serve` address HOST:PORT");
ABSL_FLAG(std::string, prompt_file, "", "Prompt text; request i gets 'Request i.' in front of it");
ABSL_FLAG(std::vector<std::string>, rates, {"0.2"}, "Arrival rates to run, requests per second");
ABSL_FLAG(int32_t, requests, 8, "Requests per rate");
ABSL_FLAG(int64_t, max_new_tokens, 32, "Tokens generated per request (EOS ignored)");
ABSL_FLAG(uint64_t, seed, 1, "Arrival-time seed");
ABSL_FLAG(std::string, label, "", "Recorded with the results (e.g. the server's mode)");
ABSL_FLAG(std::string, out, "", "Output JSON path");

namespace {

using Clock = std::chrono::steady_clock;

struct Sample {
  bool ok = false;
  std::string error{};
  double ttft = 0, tpot = 0, latency = 0;
  int64_t tokens = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(idx);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}

Sample RunOne(dd::v1::DualDecoder::Stub& stub, const std::string& text, int64_t max_new) {
  dd::v1::GenerateRequest req;
  req.set_text(text);
  req.set_max_new_tokens(max_new);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  const Clock::time_point t0 = Clock::now();
  auto reader = stub.Generate(&ctx, req);
  dd::v1::GenerateResponse resp;
  Sample s;
  Clock::time_point first{}, last{};
  while (reader->Read(&resp)) {
    if (resp.token_ids_size() == 0) continue;
    const Clock::time_point now = Clock::now();
    if (s.tokens == 0) first = now;
    last = now;
    s.tokens += resp.token_ids_size();
  }
  grpc::Status st = reader->Finish();
  s.ok = st.ok();
  if (!st.ok()) s.error = absl::StrCat(static_cast<int>(st.error_code()), ": ", st.error_message());
  s.latency = std::chrono::duration<double>(Clock::now() - t0).count();
  if (s.tokens > 0) s.ttft = std::chrono::duration<double>(first - t0).count();
  if (s.tokens > 1) s.tpot = std::chrono::duration<double>(last - first).count() / static_cast<double>(s.tokens - 1);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string server = absl::GetFlag(FLAGS_server);
  std::ifstream in(absl::GetFlag(FLAGS_prompt_file));
  if (server.empty() || !in) {
    std::cerr << "dd-bench-serve: need --server HOST:PORT and a readable --prompt_file\n";
    return 2;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string prompt = ss.str();
  auto stub = dd::v1::DualDecoder::NewStub(grpc::CreateChannel(server, grpc::InsecureChannelCredentials()));
  const int32_t n = absl::GetFlag(FLAGS_requests);
  const int64_t max_new = absl::GetFlag(FLAGS_max_new_tokens);
  nlohmann::json out = nlohmann::json::array();
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  int request_no = 0;
  for (const std::string& rate_text : absl::GetFlag(FLAGS_rates)) {
    const double rate = std::stod(rate_text);
    if (!(rate > 0)) {
      std::cerr << "dd-bench-serve: --rates must be > 0, got " << rate_text << "\n";
      return 2;
    }
    // Exponential gaps, scaled so that their mean is exactly 1/rate: with a handful of
    // requests an unscaled draw can miss the nominal rate by 2x or more.
    std::exponential_distribution<double> gap(rate);
    std::vector<double> gaps(std::max(0, n - 1));
    double sum = 0;
    for (double& g : gaps) sum += (g = gap(rng));
    for (double& g : gaps) g *= sum > 0 ? static_cast<double>(gaps.size()) / (rate * sum) : 0;
    std::vector<Sample> samples(n);
    std::vector<std::thread> threads;
    const Clock::time_point start = Clock::now();
    double at = 0;
    for (int i = 0; i < n; ++i) {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at)));
      const std::string text = absl::StrCat("Request ", request_no++, ".\n", prompt);
      threads.emplace_back([&, i, text] { samples[i] = RunOne(*stub, text, max_new); });
      if (i + 1 < n) at += gaps[i];
    }
    for (auto& t : threads) t.join();
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    std::vector<double> ttft, tpot;
    int64_t tokens = 0, errors = 0;
    nlohmann::json errs = nlohmann::json::array();
    for (const Sample& s : samples) {
      tokens += s.tokens;
      if (!s.ok) {
        ++errors;
        errs.push_back(s.error);
        continue;
      }
      ttft.push_back(s.ttft);
      if (s.tpot > 0) tpot.push_back(s.tpot);
    }
    nlohmann::json r = {{"label", absl::GetFlag(FLAGS_label)},
                        {"rate_rps", rate},
                        {"requests", n},
                        {"errors", errors},
                        {"error_messages", errs},
                        {"wall_s", wall},
                        {"output_tokens", tokens},
                        {"throughput_tok_s", tokens / wall},
                        {"ttft_p50_s", Percentile(ttft, 0.5)},
                        {"ttft_p99_s", Percentile(ttft, 0.99)},
                        {"tpot_p50_s", Percentile(tpot, 0.5)},
                        {"tpot_p99_s", Percentile(tpot, 0.99)}};
    std::fprintf(stderr, "bench-serve %s rate %.3g/s: %lld tokens in %.1f s (%.2f tok/s), TTFT p50 %.2f s p99 %.2f s, "
                 "TPOT p50 %.0f ms p99 %.0f ms, %lld errors\n", absl::GetFlag(FLAGS_label).c_str(), rate,
                 static_cast<long long>(tokens), wall, tokens / wall, Percentile(ttft, 0.5), Percentile(ttft, 0.99),
                 Percentile(tpot, 0.5) * 1e3, Percentile(tpot, 0.99) * 1e3, static_cast<long long>(errors));
    out.push_back(r);
    if (errors == n) {
      std::cerr << "dd-bench-serve: every request failed, e.g. " << samples[0].error << "\n";
      return 1;
    }
  }
  std::ofstream f(absl::GetFlag(FLAGS_out));
  f << out.dump(2) << "\n";
  return f ? 0 : 1;
}
