// The sampler against a plain reference (the whole vocabulary sorted, then top-k, top-p and
// min-p applied in order), on random rows as large as Gemma's vocabulary; its draws against
// the kept probabilities; seeds; penalties.
#include "decode-worker/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "dd/kernels/cpu_ops.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

// Most likely first (ties: lower id), with probabilities renormalized over what is kept.
std::vector<std::pair<int32_t, float>> ReferenceKept(const std::vector<float>& logits, const SamplingParams& p) {
  const int64_t n = static_cast<int64_t>(logits.size());
  std::vector<float> probs = logits;
  kernels::ScaledSoftmax(probs.data(), n, 1.0f / p.temperature);
  std::vector<std::pair<int32_t, float>> all;
  for (int64_t i = 0; i < n; ++i) all.emplace_back(static_cast<int32_t>(i), probs[i]);
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.second > b.second || (a.second == b.second && a.first < b.first); });
  size_t keep = all.size();
  if (p.top_k > 0 && p.top_k < n) keep = p.top_k;
  if (p.top_p < 1.0f) {
    double total = 0;
    for (size_t i = 0; i < keep; ++i) total += all[i].second;
    double acc = 0;
    for (size_t i = 0; i < keep; ++i) {
      acc += all[i].second / total;
      if (acc >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  all.resize(keep);
  const float floor = p.min_p * all[0].second;
  while (all.size() > 1 && all.back().second < floor) all.pop_back();
  double total = 0;
  for (const auto& [t, q] : all) total += q;
  for (auto& [t, q] : all) q = static_cast<float>(q / total);
  return all;
}

std::vector<float> RandomLogits(int64_t n, float spread, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, spread);
  std::vector<float> l(n);
  for (float& x : l) x = nd(rng);
  return l;
}

TEST(SamplerTest, KeepsExactlyWhatTheFullSortKeeps) {
  const std::vector<SamplingParams> params = {
      {.temperature = 1.0f},
      {.temperature = 1.0f, .top_p = 0.95f},
      {.temperature = 0.7f, .top_k = 40},
      {.temperature = 1.0f, .top_k = 50, .top_p = 0.9f},
      {.temperature = 1.0f, .min_p = 0.05f},
      {.temperature = 1.3f, .top_k = 100, .top_p = 0.8f, .min_p = 0.1f},
      {.temperature = 1.0f, .top_p = 0.999f},  // reaches far below the first threshold
      {.temperature = 2.0f, .top_k = 5000},
  };
  int case_id = 0;
  for (int64_t n : {64, 5000, 262144}) {
    for (float spread : {0.5f, 3.0f, 8.0f}) {  // flat to peaked
      const std::vector<float> logits = RandomLogits(n, spread, 1000 + case_id);
      for (const SamplingParams& p : params) {
        SCOPED_TRACE(testing::Message() << "n " << n << " spread " << spread << " T " << p.temperature << " top_k "
                                        << p.top_k << " top_p " << p.top_p << " min_p " << p.min_p);
        Sampler s(p);
        const auto kept = s.Kept(logits.data(), n);
        const auto ref = ReferenceKept(logits, p);
        ASSERT_EQ(kept.size(), ref.size());
        for (size_t i = 0; i < kept.size(); ++i) {
          ASSERT_EQ(kept[i].first, ref[i].first) << "rank " << i;
          ASSERT_NEAR(kept[i].second, ref[i].second, 1e-6 + 1e-5 * ref[i].second) << "rank " << i;
        }
      }
      ++case_id;
    }
  }
}

TEST(SamplerTest, DrawsFollowTheKeptProbabilities) {
  const std::vector<float> logits = {2.0f, 1.5f, 1.0f, 0.2f, -1.0f, 0.9f, 1.9f, -3.0f};
  for (const SamplingParams& p : {SamplingParams{.temperature = 1.0f, .seed = 11},
                                  SamplingParams{.temperature = 0.8f, .top_k = 4, .seed = 12},
                                  SamplingParams{.temperature = 1.0f, .top_p = 0.7f, .seed = 13}}) {
    Sampler s(p);
    const auto kept = s.Kept(logits.data(), 8);
    std::vector<int> counts(8, 0);
    constexpr int kDraws = 40000;
    for (int i = 0; i < kDraws; ++i) ++counts[s.Sample(logits.data(), 8)];
    std::vector<double> expected(8, 0.0);
    for (const auto& [t, q] : kept) expected[t] = q;
    for (int t = 0; t < 8; ++t) {
      EXPECT_NEAR(counts[t] / double{kDraws}, expected[t], 0.01) << "token " << t << " T " << p.temperature;
    }
  }
}

TEST(SamplerTest, ASeedGivesOneSequenceAndAnotherSeedAnother) {
  const std::vector<float> logits = RandomLogits(262144, 2.0f, 7);
  auto draw = [&](uint64_t seed) {
    Sampler s({.temperature = 1.0f, .top_p = 0.95f, .seed = seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 32; ++i) out.push_back(s.Sample(logits.data(), 262144));
    return out;
  };
  EXPECT_EQ(draw(5), draw(5));
  EXPECT_NE(draw(5), draw(6));
}

TEST(SamplerTest, PenaltiesMoveSeenTokensEvenWhenGreedy) {
  std::vector<float> logits = {0.0f, 1.0f, 3.0f, 2.5f, -1.0f};
  {
    Sampler s({.temperature = 0.0f, .repetition_penalty = 2.0f});
    s.SetPrompt(std::vector<int32_t>{2});  // 3.0 / 2 = 1.5 < 2.5
    EXPECT_EQ(s.Sample(logits.data(), 5), 3);
  }
  {
    Sampler s({.temperature = 0.0f, .frequency_penalty = 0.4f});
    EXPECT_EQ(s.Sample(logits.data(), 5), 2);  // counted: 3.0 - 0.4 = 2.6 > 2.5
    EXPECT_EQ(s.Sample(logits.data(), 5), 2);  // counted twice now: 3.0 - 0.8 = 2.2 < 2.5
    EXPECT_EQ(s.Sample(logits.data(), 5), 3);
  }
  {
    Sampler s({.temperature = 0.0f, .presence_penalty = 0.6f});
    s.Accept(2);  // a resumed request's earlier token: 3.0 - 0.6 = 2.4 < 2.5
    EXPECT_EQ(s.Sample(logits.data(), 5), 3);
  }
  {
    Sampler s({.temperature = 0.0f});  // no penalty: the prompt is not counted
    s.SetPrompt(std::vector<int32_t>{2});
    EXPECT_EQ(s.Sample(logits.data(), 5), 2);
  }
  // A negative logit is multiplied: the penalty still makes the token less likely.
  std::vector<float> negative = {-1.0f, -1.5f};
  Sampler s({.temperature = 0.0f, .repetition_penalty = 2.0f});
  s.SetPrompt(std::vector<int32_t>{0});  // -1 * 2 = -2 < -1.5
  EXPECT_EQ(s.Sample(negative.data(), 2), 1);
}

TEST(SamplerTest, ValidateNamesTheField) {
  EXPECT_TRUE(SamplingParams{}.Validate().ok());
  for (const auto& [p, field] : std::vector<std::pair<SamplingParams, std::string>>{
           {{.min_p = 1.5f}, "min_p"},
           {{.repetition_penalty = 0.0f}, "repetition_penalty"},
           {{.frequency_penalty = 2.5f}, "frequency_penalty"},
           {{.presence_penalty = -3.0f}, "presence_penalty"},
           {{.top_p = 0.0f}, "top_p"}}) {
    const absl::Status st = p.Validate();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(field), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace dd::engine
