// `sparse` and `dualdecoder` modes on the real models — Gemma 3 270M (3 of 18 layers global,
// one KV head) and SmolLM2-135M (all 30 layers global, three KV heads): exactness against
// `full` when the budget covers the context, dualdecoder == sparse bit for bit (instant, then
// slow background link), on-demand fetch accounting, device-memory savings, bad configurations.
#include "decode-worker/engine/sparse_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/engine_test_util.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"
#include "kv-pool/server/pool_process.h"

namespace dd::engine {
namespace {

template <typename ModelFixture>
class SparseModeTest : public ModelFixture {
 protected:
  using ModelFixture::model_;
  // A prompt of at least `min_tokens` tokens (counted, not estimated: the two variants have
  // different tokens per sentence).
  std::vector<int32_t> LongPrompt(int variant, size_t min_tokens) {
    std::string text;
    std::vector<int32_t> ids;
    for (int i = 0; ids.size() < min_tokens;) {
      for (const int end = i + 64; i < end; ++i) {
        text += (variant == 0 ? "The river flows past mill number " : "Entry ") + std::to_string(i * (variant + 3)) + ". ";
      }
      ids = this->Encode(text);
    }
    return ids;
  }
  int64_t SparseLayers() const {
    int64_t n = 0;
    for (int64_t l = 0; l < this->model_->config.n_layer; ++l) n += this->model_->config.layer_is_swa[l] ? 0 : 1;
    return n;
  }
  int64_t KvHeads() const { return this->model_->config.n_head_kv; }
  // Greedy-decodes `steps` tokens for two prompts in one batch; returns all step logits.
  std::vector<float> Run(Engine& e, int steps, size_t tokens0 = 1200, size_t tokens1 = 900) {
    const std::vector<int32_t> seqs = {0, 1};
    auto first = e.PrefillBatch(seqs, {LongPrompt(0, tokens0), LongPrompt(1, tokens1)});
    EXPECT_TRUE(first.ok()) << first.status();
    const int64_t V = this->model_->config.n_vocab;
    std::vector<int32_t> tokens = {Argmax((*first)[0].data(), V), Argmax((*first)[1].data(), V)};
    std::vector<float> logits, all;
    for (int i = 0; i < steps; ++i) {
      EXPECT_TRUE(e.DecodeStep(seqs, tokens, &logits).ok());
      all.insert(all.end(), logits.begin(), logits.end());
      for (int s = 0; s < 2; ++s) tokens[s] = Argmax(&logits[s * V], V);
    }
    return all;
  }
  // Run on the sim device with a 32-token budget: the device gathers every block itself from
  // the in-process store's arena (registered with it), as from a shm:// pool.
  std::vector<float> RunOnSim(DecodeMode mode) {
    EngineOptions o{.mode = mode, .device = "sim"};
    o.sparse.budget_tokens = 32;
    auto e = testing_util::NewEngine(*this->model_, o);
    std::vector<float> logits = Run(*e, 2, 200, 150);
    EXPECT_GT(e->kv().fetched_chunks(), 0);
    EXPECT_EQ(e->kv().device_gathered_chunks(), e->kv().fetched_chunks());
    return logits;
  }
  // Greedy-decodes `steps` tokens for two sequences that share a prompt of > 4K tokens (one
  // prefill, then a fork: an all-global model prefills ~100 tokens/s on 2 cores) and diverge
  // from the first generated token (the top token for one, the runner-up for the other).
  // `before_step(i)` runs before step i. Returns all step logits.
  std::vector<float> RunForked(Engine& e, int steps, const std::function<void(int)>& before_step) {
    const std::vector<int32_t> seqs = {0, 1};
    auto first = e.Prefill(0, LongPrompt(0, 4200));
    EXPECT_TRUE(first.ok()) << first.status();
    EXPECT_TRUE(e.Fork(0, 1).ok());
    const int64_t V = model_->config.n_vocab;
    std::vector<float> rest = *first;
    const int32_t top = Argmax(rest.data(), V);
    rest[top] = -INFINITY;
    std::vector<int32_t> tokens = {top, Argmax(rest.data(), V)};
    std::vector<float> logits, all;
    for (int i = 0; i < steps; ++i) {
      before_step(i);
      EXPECT_TRUE(e.DecodeStep(seqs, tokens, &logits).ok());
      all.insert(all.end(), logits.begin(), logits.end());
      for (int s = 0; s < 2; ++s) tokens[s] = Argmax(&logits[s * V], V);
    }
    return all;
  }
};

// A RunForked hook that slows the engine's link from step `from` on.
std::function<void(int)> SlowLinkFrom(Engine& e, int from) {
  return [&e, from](int i) {
    if (i == from) e.SetLink(kvpool::LinkModel{.bandwidth_gbps = 0.1, .latency_us = 50});
  };
}

TYPED_TEST_SUITE(SparseModeTest, testing_util::RealModels, testing_util::RealModelNames);

TYPED_TEST(SparseModeTest, BudgetCoveringContextIsBitIdenticalToFull) {
  auto full_owner = testing_util::NewEngine(*this->model_, {});
  Engine& full = *full_owner;
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 4096;  // > every selectable chunk
  auto sparse = Engine::Create(*this->model_, o);
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  const auto a = this->Run(full, 6);
  const auto b = this->Run(**sparse, 6);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_GT((*sparse)->kv().fetched_chunks(), 0);  // chunks really came from the store
}

// Prompt pieces of one token (the scheduler cuts them where its step budget runs out; a
// restored prefix can leave one) are prompt rows: a prompt prefilled as [0, 300) [300, 301)
// [301, n - 1) [n - 1, n) gives the logits of one whole prefill bit for bit, and decodes the
// same. A lone row used to count as a decode row: the piece after it failed ("prefill rows
// after decode rows") and a one-token last piece attended sparsely.
TYPED_TEST(SparseModeTest, OneTokenPromptPiecesAttendDensely) {
  const std::vector<int32_t> ids = this->LongPrompt(0, 600);
  const int64_t n = static_cast<int64_t>(ids.size()), V = this->model_->config.n_vocab;
  for (DecodeMode mode : {DecodeMode::kSparse, DecodeMode::kDualDecoder}) {
    EngineOptions o;
    o.mode = mode;
    o.sparse.budget_tokens = 128;  // well below the prompt: sparse and dense rows differ
    auto whole = Engine::Create(*this->model_, o);
    auto cut = Engine::Create(*this->model_, o);
    ASSERT_TRUE(whole.ok() && cut.ok());
    auto want = (*whole)->Prefill(0, ids);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE((*cut)->Admit(0, n, n + 4).ok());
    ASSERT_TRUE((*cut)->StartPrefill(0, ids).ok());
    std::vector<float> got;
    for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 300}, {300, 301}, {301, n - 1}, {n - 1, n}}) {
      const Engine::PrefillPiece piece{.seq = 0, .prompt = ids, .begin = b, .end = e};
      std::vector<std::vector<float>> last;
      absl::Status st = (*cut)->PrefillParts({&piece, 1}, &last);
      ASSERT_TRUE(st.ok()) << "piece [" << b << ", " << e << "): " << st;
      if (e == n) got = last[0];
    }
    ASSERT_EQ(got.size(), want->size());
    EXPECT_EQ(0, std::memcmp(got.data(), want->data(), got.size() * sizeof(float))) << DecodeModeName(mode);
    const int32_t seq = 0;
    int32_t t = Argmax(got.data(), V);
    std::vector<float> a, b;
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE((*whole)->DecodeStep({&seq, 1}, {&t, 1}, &a).ok());
      ASSERT_TRUE((*cut)->DecodeStep({&seq, 1}, {&t, 1}, &b).ok());
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << DecodeModeName(mode) << " step " << i;
      t = Argmax(a.data(), V);
    }
  }
}

TYPED_TEST(SparseModeTest, SmallBudgetFetchesExactlyTheBudgetAndSavesDeviceMemory) {
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 128;  // 16 chunks per step per KV head per sparse layer
  auto sparse = Engine::Create(*this->model_, o);
  ASSERT_TRUE(sparse.ok());
  auto full_owner = testing_util::NewEngine(*this->model_, {});
  Engine& full = *full_owner;
  const auto a = this->Run(full, 4);
  const auto b = this->Run(**sparse, 4);
  // 4 steps × 2 sequences × sparse layers × KV heads × 16 chunks.
  EXPECT_EQ((*sparse)->kv().fetched_chunks(), 4 * 2 * this->SparseLayers() * this->KvHeads() * 16);
  EXPECT_NE(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));  // it is sparse
  EXPECT_LT((*sparse)->kv_bytes(), full.kv_bytes());
}

// Exactness (docs/decisions/0008-dual-token-step.md): the dual-token step's real rows are
// bit-identical to `sparse` over 48 steps, batch 2, both sequences > 4K tokens; the first 24 steps
// on an instant link, the rest on a slow background link (one KV head's 64-chunk gather takes 3 ms
// on SmolLM2, 10 ms on Gemma) so that prefetches are still in flight when their layer is read and
// the urgent path races them. Prediction only changes what is fetched when. Also checks the fetch
// accounting (every selected chunk was resident, prefetched or fetched urgently) and
// `sparse-cached` (the resident set without predictions, docs/decisions/0012-resident-set.md):
// bit-identical too, fewer chunks moved than `sparse`, more of them urgent than dualdecoder's.
TYPED_TEST(SparseModeTest, DualDecoderRealRowsAreBitIdenticalToSparse) {
  constexpr int kSteps = 48, kSlowFrom = 24;
  constexpr int64_t kChunks = 512 / 8;
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = kChunks * 8;
  auto sparse = Engine::Create(*this->model_, o);
  o.mode = DecodeMode::kDualDecoder;
  // Either speculative head predicts; results must not depend on it. Gemma runs the default
  // (full) head, SmolLM2 the context head.
  o.spec_head = std::is_same_v<TypeParam, testing_util::SmolLM2Test> ? SpecHead::kContext : SpecHead::kFull;
  auto dual = Engine::Create(*this->model_, o);
  ASSERT_TRUE(sparse.ok() && dual.ok());
  const auto a = this->RunForked(**sparse, kSteps, [](int) {});
  const auto b = this->RunForked(**dual, kSteps, SlowLinkFrom(**dual, kSlowFrom));
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  const auto t = (*dual)->kv().total_stats();
  const int64_t layers = this->SparseLayers(), heads = this->KvHeads();
  EXPECT_EQ(t.selected, kSteps * 2 * layers * heads * kChunks);
  EXPECT_EQ(t.predicted_for, t.selected);  // every step had a prediction (pre-decoding seeds it)
  // Every chunk of S was resident already, prefetched for this step, or fetched urgently.
  EXPECT_LE(t.urgent + t.reused, t.selected);
  EXPECT_GE(t.prefetched - t.wasted, t.selected - t.urgent - t.reused);
  EXPECT_GT(t.hits, t.selected / 2) << "hit rate " << t.hit_rate();
  // The carry (EngineOptions::spec_carry) ran where the model has exact layers before its
  // first sparse one (Gemma 3: 5 sliding layers; SmolLM2's first layer is sparse).
  if ((*dual)->kv().carry_layers() > 0) {
    EXPECT_GT((*dual)->carried_rows(), 0);
  } else {
    EXPECT_EQ((*dual)->carried_rows(), 0);
  }
  // (The first step of each sequence follows pre-decoding, which has nothing to carry.)
  std::printf("carried rows: %lld of %d\n", static_cast<long long>((*dual)->carried_rows()), (kSteps - 1) * 2);

  // sparse-cached: the resident set without predictions.
  const int64_t sparse_chunks = (*sparse)->kv().fetched_chunks();
  const int64_t dual_chunks = (*dual)->kv().fetched_chunks();
  sparse->reset();
  o.mode = DecodeMode::kSparseCached;
  auto cached = Engine::Create(*this->model_, o);
  ASSERT_TRUE(cached.ok()) << cached.status();
  const auto c = this->RunForked(**cached, kSteps, SlowLinkFrom(**cached, kSlowFrom));
  EXPECT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * sizeof(float)));
  const auto tc = (*cached)->kv().total_stats();
  EXPECT_EQ(tc.urgent + tc.reused, tc.selected);
  EXPECT_EQ(tc.selected, t.selected);
  const int64_t cached_chunks = (*cached)->kv().fetched_chunks();
  // Chunks moved (prefill restore excluded: none here), and what the prediction takes off the
  // critical path. Figures in docs/decisions/0012-resident-set.md.
  EXPECT_LT(cached_chunks, sparse_chunks * 3 / 4) << cached_chunks << " vs " << sparse_chunks;
  EXPECT_LT(t.urgent, tc.urgent) << "dualdecoder's urgent chunks " << t.urgent << " vs sparse-cached " << tc.urgent;
  std::printf("chunks moved: sparse %lld, sparse-cached %lld (urgent %lld), dualdecoder %lld (urgent %lld)\n",
              static_cast<long long>(sparse_chunks), static_cast<long long>(cached_chunks),
              static_cast<long long>(tc.urgent), static_cast<long long>(dual_chunks), static_cast<long long>(t.urgent));
}

// The sparse modes on the simulated device (the hash test compares every mode's logits with
// the cpu device's): attention waits for the blocks copied to the device, and leaving that
// wait out aborts, naming the hazard, on every run (the checker follows the program order).
// Each death test is a test of its own: its child process runs the test's body again up to it.
TYPED_TEST(SparseModeTest, OnTheSimulatedDeviceAttentionWaitsForItsBlocks) {
  EXPECT_FALSE(this->RunOnSim(DecodeMode::kSparseCached).empty());
  EXPECT_FALSE(this->RunOnSim(DecodeMode::kSparse).empty());
}

TYPED_TEST(SparseModeTest, OnTheSimulatedDeviceAMissingWaitForBlocksAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        SparseKvCache::SkipWaitForTesting(SparseKvCache::SkipWait::kComputeWaitsForLanding);
        this->RunOnSim(DecodeMode::kSparse);
      },
      "hazard: compute #[0-9]+ \\(AttendGroups\\) reads workspace bytes .* which urgent #[0-9]+ \\(gather into "
      "workspace\\) writes, without waiting for it");
}

// A sparse engine's options with a 64-token budget: on the cpu with the in-process store, or on
// the sim device with its KV in the pool at `address` (shm://).
EngineOptions PoolOptions(DecodeMode mode, bool on_sim, const std::string& address) {
  EngineOptions o{.mode = mode};
  o.sparse.budget_tokens = 64;
  if (on_sim) {
    o.device = "sim";
    o.kv_store = "shm://" + address;
    o.kv_store_token = kvpool::testing_util::kAlice;
  }
  return o;
}

// KV in a shm:// pool, on the simulated device (which the host cannot write): the device
// gathers every block itself from the pool's region, mapped here and registered with it (no
// host copy); over ucx:// through registered staging; the logits are the cpu's with the
// in-process store, bit for bit.
TYPED_TEST(SparseModeTest, FromAShmPoolTheDeviceGathersTheBlocksItself) {
  kvpool::testing_util::PoolProcess pool(30000, "1GiB");
  ASSERT_FALSE(pool.address().empty());
  const auto options = [&](DecodeMode mode, bool on_sim) { return PoolOptions(mode, on_sim, pool.address()); };
  // sparse-cached gathers urgent misses into resident slots, dualdecoder also prefetches on the
  // prefetch queue; sparse (urgent gathers into the workspace) runs in the death tests below.
  for (DecodeMode mode : {DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    SCOPED_TRACE(std::string(DecodeModeName(mode)));
    auto cpu_or = Engine::Create(*this->model_, options(mode, false));
    auto sim_or = Engine::Create(*this->model_, options(mode, true));
    ASSERT_TRUE(cpu_or.ok()) << cpu_or.status();
    ASSERT_TRUE(sim_or.ok()) << sim_or.status();
    Engine &cpu = **cpu_or, &sim = **sim_or;
    const std::vector<float> want = this->Run(cpu, 4, 200, 150), got = this->Run(sim, 4, 200, 150);
    ASSERT_EQ(want.size(), got.size());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)));
    const KvCache* c = &sim.kv();
    EXPECT_GT(c->fetched_chunks(), 0);
    EXPECT_EQ(c->device_gathered_chunks(), c->fetched_chunks());
    EXPECT_EQ(cpu.kv().device_gathered_chunks(), 0);
    // ucx://, which maps nothing: each landing goes through its own registered host staging,
    // moved by one device gather per buffer; the same bits.
    EngineOptions u = options(mode, true);
    u.kv_store = "ucx://" + pool.address();
    auto over_ucx_or = Engine::Create(*this->model_, u);
    ASSERT_TRUE(over_ucx_or.ok()) << over_ucx_or.status();
    Engine& over_ucx = **over_ucx_or;
    const std::vector<float> via_staging = this->Run(over_ucx, 4, 200, 150);
    EXPECT_EQ(0, std::memcmp(want.data(), via_staging.data(), want.size() * sizeof(float)));
    const KvCache* uc = &over_ucx.kv();
    EXPECT_GT(uc->fetched_chunks(), 0);
    EXPECT_EQ(uc->staged_gathered_chunks(), uc->fetched_chunks());
    EXPECT_EQ(uc->device_gathered_chunks(), 0);
  }
}

// Leaving out the compute queue's wait for a gather aborts, naming the hazard, from a shm://
// pool and through ucx://'s registered staging (a test of its own: see above).
TYPED_TEST(SparseModeTest, FromAPoolAMissingWaitForAGatherAborts) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  kvpool::testing_util::PoolProcess pool(30000, "1GiB");
  ASSERT_FALSE(pool.address().empty());
  const auto options = [&](DecodeMode mode, bool on_sim) { return PoolOptions(mode, on_sim, pool.address()); };
  EXPECT_DEATH(
      {
        ChunkStore::SkipComputeWaitForTesting(true);
        this->Run(*testing_util::NewEngine(*this->model_, options(DecodeMode::kSparse, true)), 4, 200, 150);
      },
      "hazard: compute #[0-9]+ \\(AttendGroups\\) reads workspace bytes .* which urgent #[0-9]+ \\(gather into "
      "workspace\\) writes, without waiting for it");
  // The same through ucx://'s registered staging.
  EXPECT_DEATH(
      {
        ChunkStore::SkipComputeWaitForTesting(true);
        EngineOptions u = options(DecodeMode::kSparse, true);
        u.kv_store = "ucx://" + pool.address();
        this->Run(*testing_util::NewEngine(*this->model_, u), 4, 200, 150);
      },
      "hazard: compute #[0-9]+ \\(AttendGroups\\) reads workspace bytes .* which urgent #[0-9]+ \\(gather into "
      "workspace\\) writes, without waiting for it");
}

TYPED_TEST(SparseModeTest, InvalidConfigurationsAreClearErrors) {
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 4;
  auto small = Engine::Create(*this->model_, o);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(std::string(small.status().message()).find("smaller than one chunk"), std::string::npos);
  o.sparse.budget_tokens = this->model_->config.n_ctx_train + 8;
  auto large = Engine::Create(*this->model_, o);
  ASSERT_FALSE(large.ok());
  EXPECT_NE(std::string(large.status().message()).find("larger than the model context"), std::string::npos);
  EXPECT_EQ(ParseDecodeMode("bogus").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseDecodeMode("dualdecoder"), DecodeMode::kDualDecoder);
  EXPECT_TRUE(ParseDecodeMode("sparse").ok());
  EXPECT_EQ(*ParseDecodeMode("sparse-cached"), DecodeMode::kSparseCached);
  o.mode = DecodeMode::kSparseCached;
  o.sparse.budget_tokens = 512;
  o.sparse.resident_margin_tokens = 12;
  auto margin = Engine::Create(*this->model_, o);
  ASSERT_FALSE(margin.ok());
  EXPECT_NE(std::string(margin.status().message()).find("resident margin"), std::string::npos);
  o.sparse.resident_margin_tokens = int64_t{1} << 40;  // refused before any slot is allocated
  auto huge = Engine::Create(*this->model_, o);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(std::string(huge.status().message()).find("larger than the model context"), std::string::npos);
}

}  // namespace
}  // namespace dd::engine
