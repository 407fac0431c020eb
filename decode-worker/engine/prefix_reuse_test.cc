// Prefix reuse on the real Gemma 3 270M, through a real dd-kv-pool process and through the
// in-process store's cache: a second request that shares a long prefix restores it instead of
// prefilling it, and its logits are bit-identical to a fresh prefill, in every mode; a full
// engine restores what a sparse one committed, and commits its own prompts.
#include "decode-worker/engine/prefix_reuse.h"

#include <cstring>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"
#include "kv-pool/server/pool_process.h"

namespace dd::engine {
namespace {

using kvpool::testing_util::kAlice;
using kvpool::testing_util::PoolProcess;
using testing_util::GemmaTest;

class PrefixReuseTest : public GemmaTest {
 protected:
  std::vector<int32_t> Text(size_t from, size_t n) {
    std::vector<int32_t> ids = Encode(testing_util::LicenseText());
    return std::vector<int32_t>(ids.begin() + from, ids.begin() + from + n);
  }
  static EngineOptions Options(DecodeMode mode, const std::string& store, int64_t block) {
    EngineOptions o;
    o.mode = mode;
    o.sparse.budget_tokens = 256;
    o.kv_store = store;
    o.kv_store_token = kAlice;
    o.prefix_block_tokens = block;
    return o;
  }
  // Prefill + `steps` greedy decode steps; returns every logits row produced.
  static std::vector<float> Run(Engine& e, const std::vector<int32_t>& prompt, int steps) {
    auto first = e.Prefill(0, prompt);
    EXPECT_TRUE(first.ok()) << first.status();
    if (!first.ok()) return {};
    std::vector<float> all = *first, out;
    const int64_t V = e.config().n_vocab;
    int32_t seq = 0, tok = Argmax(first->data(), V);
    for (int i = 0; i < steps; ++i) {
      EXPECT_TRUE(e.DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&tok, 1), &out).ok());
      all.insert(all.end(), out.begin(), out.end());
      tok = Argmax(out.data(), V);
    }
    e.Release(0);
    return all;
  }
};

TEST_F(PrefixReuseTest, SharedPrefixIsRestoredBitIdentically) {
  std::vector<int32_t> a = Text(0, 1200), b = Text(0, 1100);
  const std::vector<int32_t> tail = Text(5000, 150);  // a different continuation
  b.insert(b.end(), tail.begin(), tail.end());
  for (DecodeMode mode : {DecodeMode::kSparse, DecodeMode::kDualDecoder}) {
    SCOPED_TRACE(std::string(DecodeModeName(mode)));
    PoolProcess pool(30000, "1GiB");  // a fresh pool: KV is the same in both modes, so keys are too
    ASSERT_FALSE(pool.address().empty());
    const std::string uri = "shm://" + pool.address();
    auto first = Engine::Create(*model_, Options(mode, uri, 256));
    ASSERT_TRUE(first.ok()) << first.status();
    Run(**first, a, 0);  // commits a's blocks
    EXPECT_EQ((*first)->prefix_reused_tokens(), 0);
    auto second = Engine::Create(*model_, Options(mode, uri, 256));  // another worker
    ASSERT_TRUE(second.ok());
    const std::vector<float> reused = Run(**second, b, 6);
    // b shares 1100 tokens with a: four 256-token blocks.
    EXPECT_EQ((*second)->prefix_reused_tokens(), 1024);
    auto fresh = Engine::Create(*model_, Options(mode, "inproc://", 0));
    ASSERT_TRUE(fresh.ok());
    const std::vector<float> want = Run(**fresh, b, 6);
    ASSERT_EQ(reused.size(), want.size());
    EXPECT_EQ(std::memcmp(reused.data(), want.data(), want.size() * sizeof(float)), 0);
  }
}

// `full` restores a prefix a sparse engine committed (their prompt KV is the same bits) and
// answers as a full engine that prefilled it all; it commits its own prompts as well.
TEST_F(PrefixReuseTest, FullModeRestoresWhatASparseEngineCommitted) {
  std::vector<int32_t> a = Text(0, 1200), b = Text(0, 1100);
  const std::vector<int32_t> tail = Text(5000, 150);
  b.insert(b.end(), tail.begin(), tail.end());
  PoolProcess pool(30000, "1GiB");
  ASSERT_FALSE(pool.address().empty());
  const std::string uri = "shm://" + pool.address();
  auto sparse = Engine::Create(*model_, Options(DecodeMode::kSparse, uri, 256));
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  Run(**sparse, a, 0);  // commits a's blocks
  auto full = Engine::Create(*model_, Options(DecodeMode::kFull, uri, 256));
  ASSERT_TRUE(full.ok()) << full.status();
  const std::vector<float> reused = Run(**full, b, 6);
  EXPECT_EQ((*full)->prefix_reused_tokens(), 1024);
  auto fresh = Engine::Create(*model_, Options(DecodeMode::kFull, "inproc://", 0));
  ASSERT_TRUE(fresh.ok());
  const std::vector<float> want = Run(**fresh, b, 6);
  ASSERT_EQ(reused.size(), want.size());
  EXPECT_EQ(std::memcmp(reused.data(), want.data(), want.size() * sizeof(float)), 0);
  // A prompt only full engines have seen: the one that prefilled it committed it.
  const std::vector<int32_t> c = Text(2500, 600);
  Run(**full, c, 0);
  auto other = Engine::Create(*model_, Options(DecodeMode::kFull, uri, 256));
  ASSERT_TRUE(other.ok());
  const std::vector<float> got = Run(**other, c, 2);
  EXPECT_EQ((*other)->prefix_reused_tokens(), 512);
  const std::vector<float> want_c = Run(**fresh, c, 2);
  ASSERT_EQ(got.size(), want_c.size());
  EXPECT_EQ(std::memcmp(got.data(), want_c.data(), want_c.size() * sizeof(float)), 0);
}

// Without a pool: the in-process store keeps committed prefixes after their requests end, so
// one worker alone reuses a repeated prefix, in every mode.
TEST_F(PrefixReuseTest, TheInProcessStoreKeepsPrefixesInEveryMode) {
  std::vector<int32_t> a = Text(0, 1200), b = Text(0, 1100);
  const std::vector<int32_t> tail = Text(5000, 150);
  b.insert(b.end(), tail.begin(), tail.end());
  for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    SCOPED_TRACE(std::string(DecodeModeName(mode)));
    auto e = Engine::Create(*model_, Options(mode, "inproc://", 64));
    ASSERT_TRUE(e.ok()) << e.status();
    Run(**e, a, 0);
    const std::vector<float> reused = Run(**e, b, 4);
    // b shares its first 1100 tokens with a: 17 blocks of 64.
    EXPECT_EQ((*e)->prefix_reused_tokens(), 17 * 64);
    auto fresh = Engine::Create(*model_, Options(mode, "inproc://", 0));
    ASSERT_TRUE(fresh.ok());
    const std::vector<float> want = Run(**fresh, b, 4);
    ASSERT_EQ(reused.size(), want.size());
    EXPECT_EQ(std::memcmp(reused.data(), want.data(), want.size() * sizeof(float)), 0);
  }
  // With no cache, nothing outlives its request.
  EngineOptions o = Options(DecodeMode::kFull, "inproc://", 64);
  o.prefix_cache_bytes = 0;
  auto none = Engine::Create(*model_, o);
  ASSERT_TRUE(none.ok());
  Run(**none, a, 0);
  Run(**none, b, 0);
  EXPECT_EQ((*none)->prefix_reused_tokens(), 0);
}

// `full` mode restores without copying the prefix into the slot's own sequence until the commit
// needs it: a prompt that extends a restored prefix still commits whole (a third prompt then
// restores all of it), and a repeated prompt restores its prefix again with the same bits.
TEST_F(PrefixReuseTest, FullModeCommitsAPromptThatExtendsARestoredPrefix) {
  std::vector<int32_t> a = Text(0, 700), b = Text(0, 650), c;
  const std::vector<int32_t> tail = Text(5000, 200), tail2 = Text(7000, 100);
  b.insert(b.end(), tail.begin(), tail.end());  // 850 tokens: a's first 10 blocks, then 3 of its own
  c.assign(b.begin(), b.begin() + 840);
  c.insert(c.end(), tail2.begin(), tail2.end());
  auto e = Engine::Create(*model_, Options(DecodeMode::kFull, "inproc://", 64));
  ASSERT_TRUE(e.ok()) << e.status();
  Run(**e, a, 0);
  Run(**e, b, 0);
  EXPECT_EQ((*e)->prefix_reused_tokens(), 10 * 64);
  const std::vector<float> reused = Run(**e, c, 4);
  EXPECT_EQ((*e)->prefix_reused_tokens(), 10 * 64 + 13 * 64) << "c restores b's 13 blocks: b committed them all";
  const std::vector<float> again = Run(**e, c, 4);
  EXPECT_EQ((*e)->prefix_reused_tokens(), 10 * 64 + 13 * 64 + 14 * 64) << "c's own 14 blocks, committed by its first run";
  auto fresh = Engine::Create(*model_, Options(DecodeMode::kFull, "inproc://", 0));
  ASSERT_TRUE(fresh.ok());
  const std::vector<float> want = Run(**fresh, c, 4);
  ASSERT_EQ(reused.size(), want.size());
  EXPECT_EQ(std::memcmp(reused.data(), want.data(), want.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(again.data(), want.data(), want.size() * sizeof(float)), 0);
}

TEST_F(PrefixReuseTest, DifferentModelOrBlockSizeDoesNotMatch) {
  const uint64_t fp = ModelFingerprint(*model_);
  EXPECT_EQ(fp, ModelFingerprint(*model_));
  kvpool::PrefixNamespace ns{fp, {18, 1, 256, 8, KvDtype::kF32}, 256, 0};
  const std::vector<int32_t> t = Text(0, 600);
  const auto k1 = kvpool::PrefixKeys(ns, t);
  ASSERT_EQ(k1.size(), 2u);
  ns.block_tokens = 128;
  EXPECT_NE(kvpool::PrefixKeys(ns, t)[1], k1[0]);
  ns.block_tokens = 256;
  ns.model_fingerprint ^= 1;
  EXPECT_NE(kvpool::PrefixKeys(ns, t)[0], k1[0]);
  ns.model_fingerprint ^= 1;
  ns.layout.dtype = KvDtype::kF16;  // a prefix stored from one KV type is never restored into another
  EXPECT_NE(kvpool::PrefixKeys(ns, t)[0], k1[0]);
  EXPECT_TRUE(Engine::Create(*model_, Options(DecodeMode::kFull, "inproc://", 256)).ok());
  for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparse}) {
    EXPECT_TRUE(Engine::Create(*model_, Options(mode, "inproc://", 100)).status().message().find(
                    "multiple of the chunk") != std::string::npos);
  }
}

// Tenants' keys differ (docs/prefix-keys.md): no salt for an open API, a non-zero salt per
// tenant name, the same in every process (pinned, since workers sharing a pool must agree).
TEST(TenantSaltTest, EachTenantHasItsOwnStableSalt) {
  EXPECT_EQ(kvpool::TenantSalt(""), 0u);
  const uint64_t a = kvpool::TenantSalt("team-a"), b = kvpool::TenantSalt("team-b");
  EXPECT_NE(a, 0u);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, kvpool::TenantSalt("team-a"));
  EXPECT_EQ(a, 0xfe2456a0a55ecbe9ULL) << std::hex << a;
  kvpool::PrefixNamespace ns{1, {18, 1, 256, 8, KvDtype::kF32}, 64, 0};
  const std::vector<int32_t> t(200, 7);
  const auto open = kvpool::PrefixKeys(ns, t);
  ns.tenant_salt = a;
  EXPECT_NE(kvpool::PrefixKeys(ns, t)[0], open[0]);
}

}  // namespace
}  // namespace dd::engine
