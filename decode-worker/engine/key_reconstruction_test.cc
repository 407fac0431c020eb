// Keys rebuilt from the low-rank key cache (docs/decisions/0052-low-rank-key-reconstruction.md)
// on the real models — Gemma 3 270M (one KV head of 256) and SmolLM2-135M (three of 64): with
// the same layers rebuilt at the same steps, dualdecoder == sparse == sparse-cached bit for bit
// (also when the choice switches back and forth, so resident slots change between stored and
// rebuilt keys); only V halves move for a rebuilding layer; at full rank the rebuilt keys are
// the stored ones up to rounding; the online policy's hysteresis; bad options refused.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/engine_test_util.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "decode-worker/engine/key_reconstruction.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

template <typename ModelFixture>
class KeyReconstructionTest : public ModelFixture {
 protected:
  using ModelFixture::model_;
  // Two prompts of natural text (the license's start, and a later part of it).
  std::vector<int32_t> Prompt(int which, size_t tokens) {
    const std::string text = testing_util::LicenseText();
    std::vector<int32_t> ids = this->Encode(text.substr(which == 0 ? 0 : 12000, 12000));
    EXPECT_GE(ids.size(), tokens);
    ids.resize(std::min(ids.size(), tokens));
    return ids;
  }
  // Greedy-decodes `steps` tokens for two sequences in one batch; returns every step's logits.
  // From step `slow_from` on the link is slow (prefetches still in flight when read).
  std::vector<float> Run(Engine& e, int steps, int slow_from = -1, size_t tokens0 = 360, size_t tokens1 = 240) {
    const std::vector<int32_t> seqs = {0, 1};
    auto first = e.PrefillBatch(seqs, {Prompt(0, tokens0), Prompt(1, tokens1)});
    EXPECT_TRUE(first.ok()) << first.status();
    const int64_t V = model_->config.n_vocab;
    std::vector<int32_t> tokens = {Argmax((*first)[0].data(), V), Argmax((*first)[1].data(), V)};
    std::vector<float> logits, all;
    for (int i = 0; i < steps; ++i) {
      if (i == slow_from) e.SetLink(kvpool::LinkModel{.bandwidth_gbps = 0.2, .latency_us = 50});
      EXPECT_TRUE(e.DecodeStep(seqs, tokens, &logits).ok()) << "step " << i;
      all.insert(all.end(), logits.begin(), logits.end());
      for (int s = 0; s < 2; ++s) tokens[s] = Argmax(&logits[s * V], V);
    }
    return all;
  }
  std::unique_ptr<Engine> Make(DecodeMode mode, KeyReconstructionOptions kr, KvDtype kv = KvDtype::kF32,
                               model::Transformer::MatMulKind matmul = model::Transformer::MatMulKind::kInt8,
                               const char* device = "cpu") {
    EngineOptions o;
    o.mode = mode;
    o.device = device;
    o.kv_dtype = kv;
    o.matmul = matmul;
    o.sparse.budget_tokens = 64;  // 8 of ~20-35 selectable chunks
    o.sparse.key_reconstruction = std::move(kr);
    auto e = Engine::Create(*model_, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }
};

TYPED_TEST_SUITE(KeyReconstructionTest, testing_util::RealModels, testing_util::RealModelNames);

TYPED_TEST(KeyReconstructionTest, RebuiltKeysGiveTheSameBitsInEveryModeAndMoveOnlyValues) {
  constexpr int kSteps = 10;
  KeyReconstructionOptions all{.mode = KeyReconstructionMode::kAll};
  auto sparse = this->Make(DecodeMode::kSparse, all);
  auto dual = this->Make(DecodeMode::kDualDecoder, all);
  auto cached = this->Make(DecodeMode::kSparseCached, all);
  auto exact = this->Make(DecodeMode::kSparse, {});
  ASSERT_TRUE(sparse && dual && cached && exact);
  const auto a = this->Run(*sparse, kSteps);
  const auto b = this->Run(*dual, kSteps, kSteps / 2);
  const auto c = this->Run(*cached, kSteps);
  const auto x = this->Run(*exact, kSteps);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
  EXPECT_NE(0, std::memcmp(a.data(), x.data(), a.size() * sizeof(float)));  // rebuilt keys are not the stored ones
  for (Engine* e : {sparse.get(), dual.get(), cached.get()}) {
    const KvLayerStats t = e->kv().total_stats();
    EXPECT_GT(t.urgent, 0);
    EXPECT_EQ(t.urgent_values, t.urgent);  // every block moved its V half alone
    EXPECT_EQ(t.prefetched_values, t.prefetched);
    EXPECT_EQ(t.reconstructed, t.selected);  // every selected chunk was read with rebuilt keys
    EXPECT_EQ(e->kv().values_only_chunks(), e->kv().fetched_chunks());
  }
  // Rebuilt once per landing: on demand every read's chunks; a resident slot keeps its rebuilt
  // keys across steps, so only what landed since is rebuilt (the same bits as rebuilding all).
  const KvLayerStats ts0 = sparse->kv().total_stats(), tc0 = cached->kv().total_stats();
  EXPECT_EQ(ts0.rebuilt, ts0.selected);
  EXPECT_LT(tc0.rebuilt, tc0.selected / 2);
  EXPECT_GE(tc0.rebuilt, tc0.urgent);
  // Half the bytes of the same blocks: the exact run moved whole blocks.
  const KvLayerStats te = exact->kv().total_stats(), ts = sparse->kv().total_stats();
  EXPECT_EQ(te.urgent_values, 0);
  EXPECT_EQ(ts.urgent, te.urgent);
  EXPECT_GT(dual->kv().total_stats().prefetched, 0);
}

// The choice switching every two steps: resident slots go from stored to rebuilt keys and
// back (a step that reads stored keys fetches again the chunks whose keys were rebuilt).
TYPED_TEST(KeyReconstructionTest, SwitchingBackAndForthKeepsEveryModeBitIdentical) {
  constexpr int kSteps = 12;
  KeyReconstructionOptions alternate{.mode = KeyReconstructionMode::kAuto};
  alternate.schedule_for_testing = [](int64_t layer, int64_t step) { return (step / 2 + layer) % 2 == 0; };
  auto sparse = this->Make(DecodeMode::kSparse, alternate);
  auto dual = this->Make(DecodeMode::kDualDecoder, alternate);
  auto cached = this->Make(DecodeMode::kSparseCached, alternate);
  ASSERT_TRUE(sparse && dual && cached);
  const auto a = this->Run(*sparse, kSteps);
  const auto b = this->Run(*dual, kSteps, kSteps / 2);
  const auto c = this->Run(*cached, kSteps);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
  const KvLayerStats t = dual->kv().total_stats();
  EXPECT_GT(t.reconstructed, 0);
  EXPECT_LT(t.reconstructed, t.selected);
  EXPECT_GT(t.urgent_values, 0);
  EXPECT_LT(t.urgent_values, t.urgent);
}

// At full rank the basis spans every key: rebuilt keys are the stored ones up to f32 rounding
// (unrotate, project, rebuild, rotate: about 1e-6 of the keys' size). With f32 linear layers
// (the int8 path's activation rounding turns any change into steps of its own) the first
// step's logits move far less than storing KV in f16 (rounding of 2^-11) moves them.
TYPED_TEST(KeyReconstructionTest, AtFullRankRebuiltKeysAreTheStoredOnes) {
  constexpr int kSteps = 1;
  const int64_t kv_dim = this->model_->config.n_head_kv * this->model_->config.head_dim;
  constexpr auto kF32 = model::Transformer::MatMulKind::kF32;
  auto full_rank =
      this->Make(DecodeMode::kSparse, {.mode = KeyReconstructionMode::kAll, .rank = kv_dim}, KvDtype::kF32, kF32);
  auto exact = this->Make(DecodeMode::kSparse, {}, KvDtype::kF32, kF32);
  auto f16 = this->Make(DecodeMode::kSparse, {}, KvDtype::kF16, kF32);
  ASSERT_TRUE(full_rank && exact && f16);
  // Short prompts: f32 linear layers are slow (a few chunks beyond the sinks and the window).
  const auto a = this->Run(*full_rank, kSteps, -1, 128, 112);
  const auto x = this->Run(*exact, kSteps, -1, 128, 112);
  const auto h = this->Run(*f16, kSteps, -1, 128, 112);
  ASSERT_EQ(a.size(), x.size());
  const auto largest_difference = [](const std::vector<float>& p, const std::vector<float>& q) {
    double worst = 0;
    for (size_t i = 0; i < p.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(p[i]) - q[i]));
    return worst;
  };
  const double rebuilt = largest_difference(a, x), narrowed = largest_difference(h, x);
  std::printf("largest logit difference from exact: full-rank rebuilt keys %.3g, f16 KV %.3g\n", rebuilt, narrowed);
  EXPECT_GT(rebuilt, 0);  // rebuilt, not copied
  EXPECT_LT(rebuilt, narrowed / 10);
  EXPECT_GT(full_rank->kv().total_stats().reconstructed, 0);
}

// On the simulated device (every access declared, a missing wait aborts): the rebuilt keys,
// the values-only landings and the prefetches into slots whose keys were rebuilt give the
// cpu's bits, in f16. Gemma only (the simulated device is slow).
TYPED_TEST(KeyReconstructionTest, OnTheSimulatedDeviceTheRebuiltKeysGiveTheCpusBits) {
  if (this->model_->config.n_layer != 18) GTEST_SKIP() << "Gemma only";
  constexpr int kSteps = 3;
  KeyReconstructionOptions alternate{.mode = KeyReconstructionMode::kAuto};
  alternate.schedule_for_testing = [](int64_t, int64_t step) { return step != 1; };
  auto cpu = this->Make(DecodeMode::kDualDecoder, alternate, KvDtype::kF16);
  auto sim = this->Make(DecodeMode::kDualDecoder, alternate, KvDtype::kF16, model::Transformer::MatMulKind::kInt8, "sim");
  ASSERT_TRUE(cpu && sim);
  const auto a = this->Run(*cpu, kSteps, -1, 200, 150);
  const auto b = this->Run(*sim, kSteps, -1, 200, 150);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_GT(sim->kv().total_stats().reconstructed, 0);
  EXPECT_GT(sim->kv().device_gathered_chunks(), 0);
}

TYPED_TEST(KeyReconstructionTest, BadOptionsAreRefusedByName) {
  const auto error = [&](EngineOptions o) {
    auto e = Engine::Create(*this->model_, o);
    return e.ok() ? std::string() : std::string(e.status().message());
  };
  EngineOptions o;
  o.sparse.key_reconstruction.mode = KeyReconstructionMode::kAll;
  EXPECT_NE(error(o).find("needs a sparse mode"), std::string::npos) << error(o);
  o.mode = DecodeMode::kSparse;
  o.sparse.key_reconstruction.rank = 100000;
  EXPECT_NE(error(o).find("key rank 100000"), std::string::npos) << error(o);
  o.sparse.key_reconstruction = {.mode = KeyReconstructionMode::kLayers};
  EXPECT_NE(error(o).find("names no layer"), std::string::npos) << error(o);
  int64_t sliding = -1;
  for (int64_t l = 0; l < this->model_->config.n_layer && sliding < 0; ++l) {
    if (this->model_->config.layer_is_swa[l]) sliding = l;
  }
  if (sliding >= 0) {  // Gemma: a sliding layer is not sparse
    o.sparse.key_reconstruction.layers.set(sliding);
    EXPECT_NE(error(o).find("is not a sparse layer"), std::string::npos) << error(o);
  }
}

// The online policy alone, on counted statistics.
TEST(KeyReconstructionPolicyTest, AutoFollowsTheHitRateWithHysteresis) {
  KeyReconstructionOptions o{.mode = KeyReconstructionMode::kAuto, .on_below = 0.8, .off_at = 0.9, .min_steps = 3};
  KeyReconstructionPolicy p(o, 2);
  KvLayerStats s;
  const auto step = [&](int64_t hits, int64_t of) {
    s.hits += hits;
    s.predicted_for += of;
    return p.Step(1, s);
  };
  EXPECT_FALSE(step(0, 0));    // nothing measured yet
  EXPECT_FALSE(step(95, 100)); // good prediction
  EXPECT_FALSE(step(95, 100));
  for (int i = 0; i < 3; ++i) step(10, 100);  // poor: the smoothed rate falls below 0.8
  EXPECT_TRUE(p.on(1));
  EXPECT_EQ(p.switches(1), 1);
  // Between the thresholds it stays on; at or above 0.9 (after min_steps) it turns off.
  for (int i = 0; i < 40 && p.on(1); ++i) step(85, 100);
  EXPECT_TRUE(p.on(1));
  for (int i = 0; i < 40 && p.on(1); ++i) step(100, 100);
  EXPECT_FALSE(p.on(1));
  EXPECT_EQ(p.switches(1), 2);
  EXPECT_FALSE(p.on(0));  // the other layer untouched
  // One poor step right after a switch does not switch back (min_steps).
  EXPECT_FALSE(step(0, 100));
}

TEST(KeyReconstructionPolicyTest, FixedModesIgnoreTheStatistics) {
  KvLayerStats poor;
  poor.predicted_for = 100;
  KeyReconstructionPolicy off({}, 4), all({.mode = KeyReconstructionMode::kAll}, 4);
  KeyReconstructionOptions listed{.mode = KeyReconstructionMode::kLayers};
  listed.layers.set(2);
  KeyReconstructionPolicy layers(listed, 4);
  for (int64_t l = 0; l < 4; ++l) {
    EXPECT_FALSE(off.Step(l, poor));
    EXPECT_TRUE(all.Step(l, {}));
    EXPECT_EQ(layers.Step(l, poor), l == 2);
  }
}

}  // namespace
}  // namespace dd::engine
