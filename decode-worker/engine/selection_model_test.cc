// The selection model (selection_model.h): its draws keep exactly the stated overlap and hit
// rate, stay in range and repeat for the same key; in the engine, every sparse mode attends
// the model's chunks (bit-identical logits) and the engine's own counters read back the
// model's figures.
#include "decode-worker/engine/selection_model.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>
#include <tuple>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "decode-worker/engine/sampler.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

int64_t Common(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::vector<int64_t> both;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(both));
  return static_cast<int64_t>(both.size());
}

// Distinct, ascending, within [begin, end).
void ExpectChunks(const std::vector<int64_t>& v, int64_t begin, int64_t end) {
  EXPECT_TRUE(std::is_sorted(v.begin(), v.end()));
  EXPECT_EQ(std::set<int64_t>(v.begin(), v.end()).size(), v.size());
  for (int64_t c : v) {
    EXPECT_GE(c, begin);
    EXPECT_LT(c, end);
  }
}

TEST(SelectionModelTest, ParsesFractionsAndRefusesWhatIsNotOne) {
  auto m = SelectionModel::Parse("0.9:0.95");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->enabled);
  EXPECT_DOUBLE_EQ(m->overlap, 0.9);
  EXPECT_DOUBLE_EQ(m->hit_rate, 0.95);
  EXPECT_EQ(m->seed, 0u);
  m = SelectionModel::Parse("0.5:1:0.25:7");
  ASSERT_TRUE(m.ok());
  EXPECT_DOUBLE_EQ(m->resident_waste, 0.25);
  EXPECT_EQ(m->seed, 7u);
  EXPECT_EQ(m->ToString(), "0.5:1:0.25:7");
  EXPECT_FALSE(SelectionModel::Parse("off")->enabled);
  EXPECT_FALSE(SelectionModel::Parse("")->enabled);
  for (const char* bad : {"0.9", "1.5:0.9", "0.9:-0.1", "x:0.9", "0.9:0.9:1.5", "0.9:0.9:0:-3", "0.9:0.9:0:1:2", "nan:0.5"}) {
    auto r = SelectionModel::Parse(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find(bad), absl::string_view::npos) << r.status();
  }
}

TEST(SelectionModelTest, EachStepKeepsTheOverlapAndThePredictionHitsTheRate) {
  constexpr int64_t k = 256, begin = 2;
  for (const auto& [overlap, hit, waste] : {std::tuple{0.9, 0.95, 0.0}, {0.7, 0.7, 0.4}, {0.99, 0.85, 1.0},
                                            {0.0, 1.0, 0.5}, {1.0, 0.0, 0.0}, {0.5, 0.6, 1.0}}) {
    SelectionModel m{.enabled = true, .overlap = overlap, .hit_rate = hit, .resident_waste = waste, .seed = 3};
    int64_t end = 16000;  // a 128K context in 8-token chunks
    std::vector<int64_t> now = m.First({0, 1, 2, 100}, begin, end, k);
    ASSERT_EQ(static_cast<int64_t>(now.size()), k);
    ExpectChunks(now, begin, end);
    for (int64_t pos = 101; pos < 140; ++pos) {
      if (pos % 8 == 0) ++end;  // the range grows by a chunk every 8 steps
      const SelectionModel::Key key{0, 1, 2, pos};
      const std::vector<int64_t> next = m.Next(key, now, begin, end, k);
      ASSERT_EQ(static_cast<int64_t>(next.size()), k);
      ExpectChunks(next, begin, end);
      EXPECT_EQ(Common(now, next), std::llround(overlap * k)) << overlap << " at " << pos;
      const std::vector<int64_t> p = m.Predict(key, now, next, begin, end);
      ASSERT_EQ(p.size(), next.size());
      ExpectChunks(p, begin, end);
      const int64_t hits = Common(p, next);
      EXPECT_EQ(hits, std::llround(hit * k)) << hit << " at " << pos;
      // Misses fall on the chunks the step added: every kept chunk is predicted while the
      // hits reach that far.
      std::vector<int64_t> kept;
      std::set_intersection(now.begin(), now.end(), next.begin(), next.end(), std::back_inserter(kept));
      EXPECT_EQ(Common(p, kept), std::min<int64_t>(hits, static_cast<int64_t>(kept.size())));
      // Of the k - hits mispredictions, the stated part lies in what the step dropped (while
      // there are that many), the rest outside both steps.
      std::vector<int64_t> dropped;
      std::set_difference(now.begin(), now.end(), next.begin(), next.end(), std::back_inserter(dropped));
      const int64_t wrong = k - hits;
      const int64_t resident = std::min<int64_t>(std::llround(waste * wrong), static_cast<int64_t>(dropped.size()));
      EXPECT_EQ(Common(p, dropped), resident) << waste << " at " << pos;
      // The same key draws the same chunks; another head draws others.
      EXPECT_EQ(m.Next(key, now, begin, end, k), next);
      EXPECT_EQ(m.Predict(key, now, next, begin, end), p);
      if (overlap < 1.0) {
        EXPECT_NE(m.Next({0, 1, 3, pos}, now, begin, end, k), next);
      }
      now = next;
    }
  }
}

TEST(SelectionModelTest, CrowdedAndSmallRangesStayExact) {
  SelectionModel m{.enabled = true, .overlap = 0.5, .hit_rate = 0.75, .seed = 1};
  constexpr int64_t k = 16;
  // Fewer chunks than the budget: all of them, as the real selection takes.
  std::vector<int64_t> all = m.First({0, 0, 0, 5}, 2, 12, k);
  EXPECT_EQ(all, (std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(m.Next({0, 0, 0, 6}, all, 2, 13, k).size(), 11u);
  // A few chunks more than the budget: too few new ones for half of k, so the rest come back
  // from the dropped ones; still k distinct chunks.
  const std::vector<int64_t> now = m.First({0, 0, 0, 7}, 2, 22, k);
  const std::vector<int64_t> next = m.Next({0, 0, 0, 8}, now, 2, 22, k);
  ASSERT_EQ(next.size(), static_cast<size_t>(k));
  ExpectChunks(next, 2, 22);
  EXPECT_GE(Common(now, next), k / 2);
  const std::vector<int64_t> p = m.Predict({0, 0, 0, 8}, now, next, 2, 22);
  ExpectChunks(p, 2, 22);
  EXPECT_EQ(Common(p, next), 12);
}

// The engine attends what the model draws, in every sparse mode alike: the same logits bit for
// bit, the step cache reuses exactly the overlap and dualdecoder's counters read exactly the hit
// rate (k = 16 chunks per head: overlap 0.5 keeps 8, hit rate 0.75 predicts 12), and the
// mispredictions the step cache holds anyway are not fetched.
class SelectionModelEngineTest : public testing_util::SmolLM2Test {};

TEST_F(SelectionModelEngineTest, EverySparseModeAttendsTheModelsChunks) {
  constexpr int kSteps = 10;
  constexpr int64_t kChunks = 16;
  auto model = SelectionModel::Parse("0.5:0.75:0:11");
  ASSERT_TRUE(model.ok());
  std::string text;
  for (int i = 0; i < 60; ++i) text += "Line " + std::to_string(i * 7) + " of the ledger balances. ";
  const std::vector<int32_t> prompt = Encode(text);
  ASSERT_GT(prompt.size(), 500u);
  const int64_t V = model_->config.n_vocab;
  const int64_t cells = kSteps * 2 * model_->config.n_layer * model_->config.n_head_kv;  // all layers global
  auto run = [&](DecodeMode mode, bool with_model, SparseKvCache::LayerStats* stats, double resident_waste = 0) {
    EngineOptions o;
    o.mode = mode;
    o.sparse.budget_tokens = kChunks * 8;
    if (with_model) o.sparse.selection_model = *model;
    o.sparse.selection_model.resident_waste = resident_waste;
    auto e = Engine::Create(*model_, o);
    EXPECT_TRUE(e.ok()) << e.status();
    auto first = (*e)->Prefill(0, prompt);
    EXPECT_TRUE(first.ok()) << first.status();
    EXPECT_TRUE((*e)->Fork(0, 1).ok());
    const std::vector<int32_t> seqs = {0, 1};
    std::vector<int32_t> tokens = {Argmax(first->data(), V), 17};
    std::vector<float> logits, all;
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_TRUE((*e)->DecodeStep(seqs, tokens, &logits).ok());
      all.insert(all.end(), logits.begin(), logits.end());
      for (int s = 0; s < 2; ++s) tokens[s] = Argmax(&logits[s * V], V);
    }
    *stats = (*e)->kv().total_stats();
    return all;
  };
  SparseKvCache::LayerStats plain, sparse, cached, dual;
  const auto a = run(DecodeMode::kSparse, /*with_model=*/false, &plain);
  const auto b = run(DecodeMode::kSparse, true, &sparse);
  const auto c = run(DecodeMode::kSparseCached, true, &cached);
  const auto d = run(DecodeMode::kDualDecoder, true, &dual);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_NE(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "the model changed nothing";
  EXPECT_EQ(0, std::memcmp(b.data(), c.data(), b.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(b.data(), d.data(), b.size() * sizeof(float)));
  EXPECT_EQ(sparse.selected, cells * kChunks);
  EXPECT_EQ(cached.selected, cells * kChunks);
  // Every step after each request's first keeps 8 of the 16 resident.
  EXPECT_EQ(cached.reused, (kSteps - 1) * cells / kSteps * 8);
  // Predictions after the first step (pre-decoding seeds that one: P' = S).
  EXPECT_EQ(dual.predicted_for - dual.seeded_for, (kSteps - 1) * cells / kSteps * kChunks);
  EXPECT_DOUBLE_EQ(dual.hit_rate_after_first(), 0.75);
  // Mispredictions the step cache holds anyway cost no transfer: fewer chunks prefetched.
  SparseKvCache::LayerStats held;
  EXPECT_EQ(d, run(DecodeMode::kDualDecoder, true, &held, /*resident_waste=*/1.0));
  EXPECT_DOUBLE_EQ(held.hit_rate_after_first(), 0.75);
  EXPECT_LT(held.prefetched, dual.prefetched);
  EXPECT_LT(held.wasted, dual.wasted);
}

}  // namespace
}  // namespace dd::engine
