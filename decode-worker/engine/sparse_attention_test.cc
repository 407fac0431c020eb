// The sparse caches driven directly with random q/k/v (no model), so it runs fast and under
// ThreadSanitizer: `full`/`sparse`/`sparse-cached`/`dualdecoder` exactness and the prefetch concurrency
// rules with a slow, injected link.
#include <cstring>
#include <random>
#include <tuple>

#include "dd/backend/cpu_device.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/engine/engine_test_util.h"
#include "decode-worker/engine/kv_cache.h"
#include "decode-worker/engine/sparse_kv_cache.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

model::ModelConfig TinyConfig() { return testing_util::SmallConfig({false, false}); }

using testing_util::AttentionCallOf;

// Options as Engine::Normalized leaves them (the speculative shortlist resolved for a full head).
SparseOptions Resolved(SparseOptions o = {}) {
  o.spec_candidates = o.SpecCandidatesFor(/*full_head=*/true);
  return o;
}

// Feeds identical real rows to each cache; returns the real rows' attention outputs.
class Driver {
 public:
  Driver(const model::ModelConfig& c, model::AttentionBackend* cache, bool dual) : c_(c), cache_(cache), dual_(dual) {}

  // One forward: `rows` real rows for `seq` (from rng_real), plus a speculative row in dual mode.
  std::vector<float> Step(int32_t seq, int64_t pos, int64_t n_rows, std::mt19937& rng_real, std::mt19937& rng_spec,
                          bool with_spec) {
    const int64_t q_dim = c_.n_head * c_.head_dim, kv_dim = c_.n_head_kv * c_.head_dim;
    std::vector<model::BatchRow> rows;
    for (int64_t i = 0; i < n_rows; ++i) rows.push_back({seq, pos + i, 0, false});
    const int64_t total = n_rows + (with_spec ? 1 : 0);
    if (with_spec) rows.push_back({seq, pos + n_rows, 0, false, true});
    std::vector<float> q(total * q_dim), k(total * kv_dim), v(total * kv_dim), out(total * q_dim);
    std::normal_distribution<float> nd;
    auto fill = [&](int64_t r, std::mt19937& g) {
      for (int64_t i = 0; i < q_dim; ++i) q[r * q_dim + i] = nd(g);
      for (int64_t i = 0; i < kv_dim; ++i) k[r * kv_dim + i] = nd(g);
      for (int64_t i = 0; i < kv_dim; ++i) v[r * kv_dim + i] = nd(g);
    };
    for (int64_t r = 0; r < n_rows; ++r) fill(r, rng_real);
    if (with_spec) fill(n_rows, rng_spec);
    for (int64_t layer = 0; layer < c_.n_layer; ++layer) {
      EXPECT_TRUE(cache_->Attend(AttentionCallOf(layer, rows, q, k, v, out)).ok());
    }
    out.resize(n_rows * q_dim);  // the real rows only
    return out;
  }

  std::vector<float> Run(int steps) {
    std::mt19937 real(42), spec(7);
    std::vector<float> all;
    for (int32_t seq : {0, 1}) Step(seq, 0, 300 + 40 * seq, real, spec, false);  // prefill
    for (int t = 0; t < steps; ++t) {
      for (int32_t seq : {0, 1}) {
        auto o = Step(seq, 300 + 40 * seq + t, 1, real, spec, dual_);
        all.insert(all.end(), o.begin(), o.end());
      }
    }
    return all;
  }

 private:
  const model::ModelConfig& c_;
  model::AttentionBackend* cache_;
  bool dual_;
};

TEST(SparseAttentionTest, FullBudgetSparseEqualsDense) {
  const auto c = TinyConfig();
  ThreadPool pool(2);
  backend::CpuDevice device(0, pool);
  DenseKvCache dense(c, device);
  auto store = kvpool::NewInProcessKvStore();
  SparseOptions o = Resolved();
  o.budget_tokens = 2048;
  auto sparse = SparseKvCache::Create(c, o, KvDtype::kF32, store.get(), device);
  ASSERT_TRUE(sparse.ok());
  const auto a = Driver(c, &dense, false).Run(30);
  const auto b = Driver(c, sparse->get(), false).Run(30);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
}

// Three sparse layers, resident fetch, dualdecoder on a slow link: every read after the first
// step finds a prediction (none is dropped), and the real rows equal `sparse` bit for bit.
TEST(SparseAttentionTest, EveryReadAfterTheFirstStepHasAPrediction) {
  auto c = TinyConfig();
  c.n_layer = 3;
  c.layer_is_swa.assign(3, false);
  ThreadPool pool(2);
  backend::CpuDevice device(0, pool);
  SparseOptions o = Resolved();
  o.budget_tokens = 64;
  auto store_a = kvpool::NewInProcessKvStore();
  auto store_b = kvpool::NewInProcessKvStore({.bandwidth_gbps = 0.05, .latency_us = 100});
  auto sparse = SparseKvCache::Create(c, o, KvDtype::kF32, store_a.get(), device);
  o.fetch = KvFetch::kResident;
  auto dual = SparseKvCache::Create(c, o, KvDtype::kF32, store_b.get(), device);
  ASSERT_TRUE(sparse.ok() && dual.ok());
  const int steps = 12;
  const auto a = Driver(c, sparse->get(), false).Run(steps);
  const auto b = Driver(c, dual->get(), true).Run(steps);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  const auto t = (*dual)->total_stats();
  const int64_t per_read = 2 * 8;  // kv heads × chunks
  EXPECT_EQ(t.selected, steps * 2 * 3 * per_read);
  EXPECT_EQ(t.predicted_for, (steps - 1) * 2 * 3 * per_read);  // all but the first step's reads
  EXPECT_GT(t.urgent, 0);  // random speculative queries miss: the urgent path was exercised
  EXPECT_GT(store_b->wait_ns(), 0);
}

// The on-demand fetch (`sparse`) predicts nothing: a speculative row is refused with an error
// that names the fetch it needs.
TEST(SparseAttentionTest, OnDemandFetchRefusesSpeculativeRows) {
  const auto c = TinyConfig();
  ThreadPool pool(1);
  backend::CpuDevice device(0, pool);
  auto store = kvpool::NewInProcessKvStore();
  auto cache = SparseKvCache::Create(c, Resolved({.budget_tokens = 64}), KvDtype::kF32, store.get(), device);
  ASSERT_TRUE(cache.ok());
  Driver d(c, cache->get(), false);
  std::mt19937 real(1), spec(2);
  d.Step(0, 0, 200, real, spec, false);
  const int64_t q_dim = c.n_head * c.head_dim, kv_dim = c.n_head_kv * c.head_dim;
  std::vector<float> q(2 * q_dim, 0.5f), k(2 * kv_dim, 0.5f), v(2 * kv_dim, 0.5f), out(2 * q_dim);
  const std::vector<model::BatchRow> rows = {{0, 200, 0, false}, {0, 201, 0, false, true}};
  const absl::Status st = (*cache)->Attend(AttentionCallOf(0, rows, q, k, v, out));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("resident"), std::string::npos) << st;
}

// The step cache (resident chunk set, docs/decisions/0012-resident-set.md): sparse-cached and
// dualdecoder on it, with and without an LRU margin, on a slow link (prefetches in flight while the
// urgent path races them): bit-identical to `sparse`; every selected chunk was reused, fetched on
// the urgent path or prefetched; fewer chunks move urgently than `sparse` moves. Run under TSan in CI.
struct StepCacheCase {
  bool dual;
  int64_t margin_tokens;
};
class StepCacheTest : public ::testing::TestWithParam<StepCacheCase> {};

TEST_P(StepCacheTest, ResultsEqualSparseAndOnlyMissesMove) {
  const auto c = TinyConfig();
  const StepCacheCase p = GetParam();
  ThreadPool pool(2);
  backend::CpuDevice device(0, pool);
  SparseOptions o = Resolved();
  o.budget_tokens = 64;  // 8 of ~40 selectable chunks
  auto store_a = kvpool::NewInProcessKvStore();
  auto store_b = kvpool::NewInProcessKvStore({.bandwidth_gbps = 0.05, .latency_us = 200});
  auto store_c = kvpool::NewInProcessKvStore({.bandwidth_gbps = 0.05, .latency_us = 200});
  auto plain = SparseKvCache::Create(c, o, KvDtype::kF32, store_a.get(), device);  // no resident set: sparse
  o.fetch = KvFetch::kResident;
  o.resident_margin_tokens = p.margin_tokens;
  auto cached = SparseKvCache::Create(c, o, KvDtype::kF32, store_b.get(), device);
  auto sparse = SparseKvCache::Create(c, Resolved({.budget_tokens = 64}), KvDtype::kF32, store_c.get(), device);
  ASSERT_TRUE(plain.ok() && cached.ok() && sparse.ok());
  constexpr int kSteps = 25;
  const auto want = Driver(c, sparse->get(), false).Run(kSteps);
  const auto a = Driver(c, plain->get(), false).Run(kSteps);
  const auto b = Driver(c, cached->get(), p.dual).Run(kSteps);
  ASSERT_EQ(want.size(), b.size());
  EXPECT_EQ(0, std::memcmp(want.data(), a.data(), a.size() * 4));
  EXPECT_EQ(0, std::memcmp(want.data(), b.data(), b.size() * 4));
  const auto t = (*cached)->total_stats();
  EXPECT_EQ(t.selected, kSteps * 2 * 2 * 2 * 8);  // steps × seqs × layers × kv heads × chunks
  EXPECT_GT(t.reused, 0);
  if (p.dual) {
    EXPECT_EQ(t.predicted_for, (kSteps - 1) * 2 * 2 * 2 * 8);  // all but the first step's reads
    EXPECT_GT(t.urgent, 0);                  // random speculative queries miss
    // What was neither reused nor urgent came from this step's prefetch.
    EXPECT_LE(t.urgent + t.reused, t.selected);
    EXPECT_GE(t.prefetched - t.wasted, t.selected - t.urgent - t.reused);
    EXPECT_GT(store_b->wait_ns(), 0);
  } else {
    EXPECT_EQ(t.urgent + t.reused, t.selected);
    EXPECT_EQ((*cached)->fetched_chunks(), t.urgent);
    EXPECT_EQ(t.prefetched, 0);
  }
  // Fewer chunks on the critical path than `sparse` moves (with random speculative queries the
  // dualdecoder's wasted prefetches may move more in all).
  EXPECT_LT(p.dual ? t.urgent : (*cached)->fetched_chunks(), (*plain)->fetched_chunks());
  EXPECT_GT(t.evictions, 0);
  // The resident sets are device memory: a layer's slots per sequence (and kv head), where
  // `sparse` holds one budget of urgent blocks per sequence instead.
  EXPECT_EQ((*cached)->device_bytes() - (*sparse)->device_bytes(),
            (2 * 2 * (64 + p.margin_tokens) / 8 * 2 - 2 * 64 / 8 * 2) * (*cached)->block_bytes());
}

INSTANTIATE_TEST_SUITE_P(Cases, StepCacheTest,
                         ::testing::Values(StepCacheCase{false, 0}, StepCacheCase{false, 32}, StepCacheCase{true, 0},
                                           StepCacheCase{true, 32}),
                         [](const auto& info) {
                           return std::string(info.param.dual ? "Dual" : "SparseCached") + "Margin" +
                                  std::to_string(info.param.margin_tokens);
                         });

// spec_candidates = 1: the speculative row chooses only among the real row's 8 best chunks
// and the chunks that became selectable since, so with the step cache (where the real row's S
// is resident) its prefetch moves at most the new chunks, while every chunk's prediction
// (random speculative queries) moves many; results still equal `sparse` bit for bit.
TEST(SparseAttentionTest, SpecCandidatesNarrowThePredictionOnly) {
  const auto c = TinyConfig();
  ThreadPool pool(2);
  backend::CpuDevice device(0, pool);
  SparseOptions o = Resolved();
  o.budget_tokens = 64;  // 8 of ~40 selectable chunks
  auto store_a = kvpool::NewInProcessKvStore();
  auto store_b = kvpool::NewInProcessKvStore({.bandwidth_gbps = 0.05, .latency_us = 200});
  auto store_c = kvpool::NewInProcessKvStore();
  auto sparse = SparseKvCache::Create(c, o, KvDtype::kF32, store_a.get(), device);
  o.fetch = KvFetch::kResident;
  o.spec_candidates = 0;
  auto every = SparseKvCache::Create(c, o, KvDtype::kF32, store_c.get(), device);
  o.spec_candidates = 1;
  auto narrow = SparseKvCache::Create(c, o, KvDtype::kF32, store_b.get(), device);
  ASSERT_TRUE(sparse.ok() && every.ok() && narrow.ok());
  constexpr int kSteps = 25;
  const auto want = Driver(c, sparse->get(), false).Run(kSteps);
  const auto a = Driver(c, every->get(), true).Run(kSteps);
  const auto b = Driver(c, narrow->get(), true).Run(kSteps);
  ASSERT_EQ(want.size(), b.size());
  EXPECT_EQ(0, std::memcmp(want.data(), a.data(), a.size() * 4));
  EXPECT_EQ(0, std::memcmp(want.data(), b.data(), b.size() * 4));
  // At most one chunk per step, sequence, layer and KV head becomes selectable.
  const int64_t new_chunks_bound = kSteps * 2 * 2 * 2;
  EXPECT_LE((*narrow)->total_stats().prefetched, new_chunks_bound);
  EXPECT_GT((*every)->total_stats().prefetched, new_chunks_bound);
  o.spec_candidates = SparseOptions::kMaxSpecCandidates + 1;
  auto bad = SparseKvCache::Create(c, o, KvDtype::kF32, store_c.get(), device);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("speculative candidates"), std::string::npos) << bad.status();
}

// A forked sequence continues exactly like the original (sparse state, store blocks, dense
// layers all copied).
TEST(SparseAttentionTest, CopyContinuesLikeTheOriginal) {
  auto c = TinyConfig();
  c.layer_is_swa = {true, false};  // one dense (windowed) layer, one sparse layer
  c.sliding_window = 64;
  ThreadPool pool(1);
  backend::CpuDevice device(0, pool);
  KvCacheOptions o{.mode = DecodeMode::kSparse, .sparse = Resolved()};  // the sliding layer beside the sparse one
  o.sparse.budget_tokens = 64;
  auto cache = KvCache::Create(c, o, device);
  ASSERT_TRUE(cache.ok()) << cache.status();
  Driver d(c, cache->get(), false);
  std::mt19937 real(1), spec(2);
  d.Step(0, 0, 200, real, spec, false);
  ASSERT_TRUE((*cache)->Copy(0, 3).ok());
  EXPECT_EQ((*cache)->Length(3), 200);
  std::mt19937 r1(9), r2(9), s1(5), s2(5);
  for (int t = 0; t < 5; ++t) {
    const auto a = d.Step(0, 200 + t, 1, r1, s1, false);
    const auto b = d.Step(3, 200 + t, 1, r2, s2, false);
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "step " << t;
  }
}

// KeepSpeculative (the dual step's carry) keeps the last speculative row's KV as if a real
// row had written it, and refuses when the last write had no speculative row at the end.
TEST(SparseAttentionTest, KeepSpeculativeKeepsOnlyTheLastSpeculativeRow) {
  const auto c = TinyConfig();
  ThreadPool pool(1);
  backend::CpuDevice device(0, pool);
  DenseKvCache cache(c, device);
  Driver d(c, &cache, true);
  std::mt19937 real(3), spec(4);
  d.Step(0, 0, 20, real, spec, /*with_spec=*/true);  // positions 0-19, speculative row at 20
  EXPECT_EQ(cache.Length(0), 20);
  ASSERT_TRUE(cache.KeepSpeculative(0, c.n_layer).ok());
  EXPECT_EQ(cache.Length(0), 21);
  const absl::Status twice = cache.KeepSpeculative(0, c.n_layer);
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition) << twice;
  d.Step(0, 21, 1, real, spec, /*with_spec=*/false);  // continues after the kept row
  EXPECT_EQ(cache.Length(0), 22);
  EXPECT_EQ(cache.KeepSpeculative(0, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.KeepSpeculative(0, c.n_layer + 1).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dd::engine
