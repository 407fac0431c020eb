// KvCache, the engine's KV coordinator: which manager and store each mode gets, and the
// contradictory options it refuses with the reason.
#include "decode-worker/engine/kv_cache.h"

#include <string>

#include "common/thread_pool.h"
#include "dd/backend/cpu_device.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

model::ModelConfig TwoLayers() {  // one sliding layer, one global
  model::ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 32;
  c.n_ctx_train = 4096;
  c.sliding_window = 64;
  c.layer_is_swa = {true, false};
  return c;
}

KvCacheOptions Options(DecodeMode mode, int64_t prefix_block) {
  KvCacheOptions o{.mode = mode, .prefix_block_tokens = prefix_block};
  o.sparse.spec_candidates = o.sparse.SpecCandidatesFor(/*full_head=*/true);
  o.sparse.offload_sliding = prefix_block > 0;
  return o;
}

class KvCacheTest : public ::testing::Test {
 protected:
  model::ModelConfig config_ = TwoLayers();
  ThreadPool pool_{1};
  backend::CpuDevice device_{0, pool_};
};

TEST_F(KvCacheTest, EachModeGetsItsManagerAndAStoreOnlyWhereItNeedsOne) {
  auto full = KvCache::Create(config_, Options(DecodeMode::kFull, 0), device_);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ((*full)->sparse(), nullptr);
  EXPECT_FALSE((*full)->has_store());
  EXPECT_FALSE((*full)->prefix_reuse());
  auto full_reuse = KvCache::Create(config_, Options(DecodeMode::kFull, 64), device_);
  ASSERT_TRUE(full_reuse.ok()) << full_reuse.status();
  EXPECT_EQ((*full_reuse)->sparse(), nullptr);
  EXPECT_TRUE((*full_reuse)->prefix_reuse());
  for (DecodeMode mode : {DecodeMode::kSparse, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    auto sparse = KvCache::Create(config_, Options(mode, 0), device_);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    EXPECT_NE((*sparse)->sparse(), nullptr);
    EXPECT_TRUE((*sparse)->has_store());
    EXPECT_FALSE((*sparse)->prefix_reuse());
  }
}

// A slot reserved, filled and released through the coordinator: the manager's bytes come and go.
TEST_F(KvCacheTest, ReleaseFreesWhatReserveHeld) {
  for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparse}) {
    auto kv = KvCache::Create(config_, Options(mode, 64), device_);
    ASSERT_TRUE(kv.ok()) << kv.status();
    KvCache& c = **kv;
    const int64_t empty = c.device_bytes();
    ASSERT_TRUE(c.Reserve(0, 200, 300, 64).ok());
    ASSERT_TRUE(c.Open(0).ok());
    ASSERT_TRUE(c.FillRandom(0, 200, 7).ok());
    EXPECT_EQ(c.Length(0), 200);
    EXPECT_GT(c.device_bytes(), empty);
    c.Release(0);
    EXPECT_EQ(c.Length(0), 0);
    EXPECT_EQ(c.device_bytes(), empty);
  }
}

TEST_F(KvCacheTest, ContradictoryOptionsAreRefusedWithTheReason) {
  const auto refused = [&](KvCacheOptions o, const std::string& why) {
    auto kv = KvCache::Create(config_, o, device_);
    ASSERT_FALSE(kv.ok());
    EXPECT_EQ(kv.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(kv.status().message().find(why), std::string::npos) << kv.status();
  };
  refused(Options(DecodeMode::kFull, 60), "prefix_block_tokens must be a positive multiple of the chunk (8), got 60");
  refused(Options(DecodeMode::kSparse, -8), "prefix_block_tokens must be a positive multiple");
  KvCacheOptions kept_dense = Options(DecodeMode::kSparse, 64);
  kept_dense.sparse.sparse_layers.set(1);
  refused(kept_dense, "prefix reuse needs every global layer sparse");
  KvCacheOptions no_offload = Options(DecodeMode::kDualDecoder, 64);
  no_offload.sparse.offload_sliding = false;
  refused(no_offload, "needs offload_sliding");
  KvCacheOptions unresolved = Options(DecodeMode::kDualDecoder, 0);
  unresolved.sparse.spec_candidates = SparseOptions::kAutoSpecCandidates;
  refused(unresolved, "speculative candidates unresolved");
  KvCacheOptions bad_store = Options(DecodeMode::kSparse, 0);
  bad_store.kv_store = "ftp://somewhere";
  auto kv = KvCache::Create(config_, bad_store, device_);
  ASSERT_FALSE(kv.ok());
  EXPECT_NE(kv.status().message().find("ftp://somewhere"), std::string::npos) << kv.status();
}

}  // namespace
}  // namespace dd::engine
