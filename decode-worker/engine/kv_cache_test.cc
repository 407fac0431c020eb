// KvCache, the engine's KV coordinator: which managers and store each mode gets, a prefix
// committed by one slot and restored into another through both managers, and the contradictory
// options it refuses with the reason.
#include "decode-worker/engine/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "common/thread_pool.h"
#include "dd/backend/cpu_device.h"
#include "decode-worker/engine/engine_test_util.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

KvCacheOptions Options(DecodeMode mode, int64_t prefix_block) {
  KvCacheOptions o{.mode = mode, .prefix_block_tokens = prefix_block};
  o.sparse.spec_candidates = o.sparse.SpecCandidatesFor(/*full_head=*/true);
  return o;
}

class KvCacheTest : public ::testing::Test {
 protected:
  // Rows [p0, p1) of slot `seq` through every layer, each position's q, k and v the same in
  // every slot (drawn from its layer and position); returns the rows' outputs, layer by layer.
  std::vector<float> Forward(KvCache& kv, int32_t seq, int64_t p0, int64_t p1) {
    const int64_t q_dim = config_.n_head * config_.head_dim, kv_dim = config_.n_head_kv * config_.head_dim;
    const int64_t n = p1 - p0;
    std::vector<model::BatchRow> rows;
    for (int64_t p = p0; p < p1; ++p) {
      model::BatchRow r;
      r.seq = seq;
      r.pos = p;
      r.prefill = n > 1;
      rows.push_back(r);
    }
    std::vector<float> q(n * q_dim), k(n * kv_dim), v(n * kv_dim), out(n * q_dim), all;
    std::normal_distribution<float> nd;
    for (int64_t l = 0; l < config_.n_layer; ++l) {
      for (int64_t i = 0; i < n; ++i) {
        std::mt19937 g(static_cast<uint32_t>(l * 100003 + p0 + i));
        for (int64_t j = 0; j < q_dim; ++j) q[i * q_dim + j] = nd(g);
        for (int64_t j = 0; j < kv_dim; ++j) k[i * kv_dim + j] = nd(g);
        for (int64_t j = 0; j < kv_dim; ++j) v[i * kv_dim + j] = nd(g);
      }
      model::AttentionCall call = testing_util::AttentionCallOf(l, rows, q, k, v, out);
      call.sliding = config_.layer_is_swa[l];
      call.window = config_.sliding_window;
      EXPECT_TRUE(kv.Attend(call).ok()) << "layer " << l;
      all.insert(all.end(), out.begin(), out.end());
    }
    return all;
  }

  model::ModelConfig config_ = testing_util::SmallConfig({true, false, false});  // sliding, global, global
  ThreadPool pool_{1};
  backend::CpuDevice device_{0, pool_};
};

TEST_F(KvCacheTest, EachModeGetsItsManagersAndAStoreOnlyWhereItNeedsOne) {
  auto full = KvCache::Create(config_, Options(DecodeMode::kFull, 0), device_);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_FALSE((*full)->selects_chunks());
  EXPECT_EQ((*full)->carry_layers(), 0);
  EXPECT_FALSE((*full)->has_store());
  EXPECT_FALSE((*full)->prefix_reuse());
  auto full_reuse = KvCache::Create(config_, Options(DecodeMode::kFull, 64), device_);
  ASSERT_TRUE(full_reuse.ok()) << full_reuse.status();
  EXPECT_FALSE((*full_reuse)->selects_chunks());
  EXPECT_TRUE((*full_reuse)->prefix_reuse());
  for (DecodeMode mode : {DecodeMode::kSparse, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    auto sparse = KvCache::Create(config_, Options(mode, 0), device_);
    ASSERT_TRUE(sparse.ok()) << sparse.status();
    EXPECT_TRUE((*sparse)->selects_chunks());
    EXPECT_EQ((*sparse)->carry_layers(), 1);  // the sliding layer before the first sparse one
    EXPECT_EQ((*sparse)->layer_stats().size(), 3u);
    EXPECT_TRUE((*sparse)->has_store());
    EXPECT_FALSE((*sparse)->prefix_reuse());
  }
}

// A prompt committed by slot 0 and restored into slot 1: every manager's layers come back
// (the sliding ring, global layers kept dense, sparse layers' rows and landmarks), so the rest
// of the prompt and a decode row give slot 0's outputs bit for bit.
TEST_F(KvCacheTest, ARestoredPrefixContinuesAsTheWholePromptDid) {
  KvCacheOptions kept_dense = Options(DecodeMode::kSparse, 64);
  kept_dense.sparse.sparse_layers.set(2);  // layer 1 stays dense, layer 2 is sparse
  const auto f16 = [](KvCacheOptions o) {
    o.kv_dtype = KvDtype::kF16;
    return o;
  };
  const std::pair<const char*, KvCacheOptions> cases[] = {{"full", Options(DecodeMode::kFull, 64)},
                                                          {"full, f16 KV", f16(Options(DecodeMode::kFull, 64))},
                                                          {"sparse, f16 KV", f16(Options(DecodeMode::kSparse, 64))},
                                                          {"dualdecoder, f16 KV", f16(Options(DecodeMode::kDualDecoder, 64))},
                                                          {"sparse", Options(DecodeMode::kSparse, 64)},
                                                          {"dualdecoder", Options(DecodeMode::kDualDecoder, 64)},
                                                          {"sparse, layer 1 kept dense", kept_dense}};
  constexpr int64_t kPrompt = 200, kRestored = 192;  // three 64-token blocks
  std::vector<int32_t> tokens(kPrompt);
  for (int64_t i = 0; i < kPrompt; ++i) tokens[i] = static_cast<int32_t>(i * 7 % 1000);
  for (const auto& [name, options] : cases) {
    SCOPED_TRACE(name);
    auto made = KvCache::Create(config_, options, device_);
    ASSERT_TRUE(made.ok()) << made.status();
    KvCache& kv = **made;
    for (int32_t seq : {0, 1}) {
      ASSERT_TRUE(kv.Reserve(seq, kPrompt, kPrompt + 8, 256).ok());
      ASSERT_TRUE(kv.Open(seq).ok());
    }
    const std::vector<float> whole = Forward(kv, 0, 0, kPrompt);
    ASSERT_TRUE(kv.AfterPrefill(0, 0, kPrompt).ok());
    kv.CommitPrefix(0, absl::MakeConstSpan(tokens).first(kPrompt - 1));
    ASSERT_TRUE(kv.FinishPrefill(0).ok());
    const std::vector<float> decoded = Forward(kv, 0, kPrompt, kPrompt + 1);

    ASSERT_EQ(kv.RestorePrefix(1, tokens, kPrompt - 1), kRestored);
    EXPECT_EQ(kv.Length(1), kRestored);
    const std::vector<float> rest = Forward(kv, 1, kRestored, kPrompt);
    ASSERT_TRUE(kv.AfterPrefill(1, kRestored, kPrompt).ok());
    ASSERT_TRUE(kv.FinishPrefill(1).ok());
    // The rest's rows of every layer against the same rows of the whole prompt.
    const int64_t q_dim = config_.n_head * config_.head_dim, n = kPrompt - kRestored;
    for (int64_t l = 0; l < config_.n_layer; ++l) {
      const float* a = whole.data() + (l * kPrompt + kRestored) * q_dim;
      EXPECT_EQ(0, std::memcmp(a, rest.data() + l * n * q_dim, n * q_dim * sizeof(float))) << "layer " << l;
    }
    const std::vector<float> again = Forward(kv, 1, kPrompt, kPrompt + 1);
    ASSERT_EQ(decoded.size(), again.size());
    EXPECT_EQ(0, std::memcmp(decoded.data(), again.data(), decoded.size() * sizeof(float)));
    EXPECT_EQ(kv.prefix_reused_tokens(), kRestored);
  }
}

// KV in f16: half the bytes of f32 for the same positions (the dense manager's rows; the
// sparse manager's store blocks), outputs within f16's rounding of the f32 cache's (the same q,
// k, v), prompt rows and a decode row.
TEST_F(KvCacheTest, F16KvHalvesTheBytesWithinF16sRounding) {
  for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparse}) {
    SCOPED_TRACE(mode == DecodeMode::kFull ? "full" : "sparse");
    KvCacheOptions o16 = Options(mode, 0);
    o16.kv_dtype = KvDtype::kF16;
    auto kv32 = KvCache::Create(config_, Options(mode, 0), device_);
    auto kv16 = KvCache::Create(config_, o16, device_);
    ASSERT_TRUE(kv32.ok() && kv16.ok());
    for (KvCache* kv : {kv32->get(), kv16->get()}) {
      ASSERT_TRUE(kv->Reserve(0, 100, 101, 128).ok());
      ASSERT_TRUE(kv->Open(0).ok());
    }
    std::vector<float> out32 = Forward(**kv32, 0, 0, 100), out16 = Forward(**kv16, 0, 0, 100);
    for (KvCache* kv : {kv32->get(), kv16->get()}) ASSERT_TRUE(kv->FinishPrefill(0).ok());
    const std::vector<float> step32 = Forward(**kv32, 0, 100, 101), step16 = Forward(**kv16, 0, 100, 101);
    out32.insert(out32.end(), step32.begin(), step32.end());
    out16.insert(out16.end(), step16.begin(), step16.end());
    if (mode == DecodeMode::kFull) {
      EXPECT_EQ((*kv16)->device_bytes() * 2, (*kv32)->device_bytes());
    } else {
      EXPECT_EQ((*kv16)->block_bytes() * 2, (*kv32)->block_bytes());
    }
    ASSERT_EQ(out32.size(), out16.size());
    double worst = 0;
    for (size_t i = 0; i < out32.size(); ++i) worst = std::max(worst, std::fabs(double{out32[i]} - out16[i]));
    EXPECT_GT(worst, 0.0) << "f16 rounding changes nothing: the cache is not narrowing";
    EXPECT_LT(worst, 1e-2);
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
