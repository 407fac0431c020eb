// WriteBack on the sim device (which the host cannot read and which aborts on a missing wait):
// chunks started on their way reach the store at Flush and not before, as the rows they were
// copied from; staging that fills up grows without losing what is on its way; Discard drops it.
#include "decode-worker/engine/write_back.h"

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "dd/backend/sim_device.h"
#include "decode-worker/engine/engine_test_util.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

constexpr int64_t kChunk = 8;

class WriteBackTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = backend::CreateSimDevice({.pool = &pool_, .seed = 3, .max_jitter_us = 50});
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(*d);
    chunks_ = std::make_unique<ChunkStore>(config_, kChunk, store_.get(), *device_);
    rows_ = std::make_unique<SparseRows>(config_, options_, *device_, KvDtype::kF32);
    auto id = chunks_->Open();
    ASSERT_TRUE(id.ok()) << id.status();
    id_ = *id;
  }
  void TearDown() override {
    ASSERT_TRUE(device_->Synchronize(device_->Record(backend::Queue::kCompute)).ok());
    rows_->Free(st_);
  }
  // Positions [0, n) of layer 0 on the device, from host rows drawn with `seed`; returns them.
  std::pair<std::vector<float>, std::vector<float>> Fill(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<float> k(n * kv_dim_), v(n * kv_dim_);
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    EXPECT_TRUE(rows_->Reserve(st_, n, n).ok());
    EXPECT_TRUE(rows_->Store(st_, 0, n, backend::DeviceBuffer{}, k.data(), v.data()).ok());
    EXPECT_TRUE(device_->Synchronize(device_->Record(backend::Queue::kCompute)).ok());
    st_.length = n;
    return {k, v};
  }
  // Chunks [c0, c1) of `rows` (n_head_kv × head_dim floats per position).
  std::vector<float> Slice(const std::vector<float>& rows, int64_t c0, int64_t c1) const {
    return std::vector<float>(rows.begin() + c0 * kChunk * kv_dim_, rows.begin() + c1 * kChunk * kv_dim_);
  }

  model::ModelConfig config_ = testing_util::SmallConfig({false}, /*head_dim=*/16);
  const int64_t kv_dim_ = config_.n_head_kv * config_.head_dim;
  SparseOptions options_;  // 16 sink tokens: the first two chunks lie in the sink rows
  ThreadPool pool_{2};
  std::unique_ptr<backend::Device> device_;
  std::unique_ptr<kvpool::KvStore> store_ = kvpool::NewInProcessKvStore();
  std::unique_ptr<ChunkStore> chunks_;
  std::unique_ptr<SparseRows> rows_;
  kvpool::SequenceId id_ = 0;
  LayerRows st_;
};

TEST_F(WriteBackTest, ChunksReachTheStoreAtFlushAndNotBefore) {
  const auto [k, v] = Fill(64, 1);
  WriteBack wb(config_, kChunk, *device_, *rows_, *chunks_);
  ASSERT_TRUE(wb.Start(st_, id_, 0, 1, 6).ok());  // across the sinks' end
  EXPECT_TRUE(wb.pending());
  std::vector<uint8_t> k2, v2;
  EXPECT_FALSE(chunks_->ReadRows(id_, 0, 1, 6, &k2, &v2).ok()) << "a block in the store before its flush";
  ASSERT_TRUE(wb.Flush().ok());
  EXPECT_FALSE(wb.pending());
  ASSERT_TRUE(chunks_->ReadRows(id_, 0, 1, 6, &k2, &v2).ok());
  EXPECT_EQ(k2, testing_util::BytesOf(Slice(k, 1, 6)));
  EXPECT_EQ(v2, testing_util::BytesOf(Slice(v, 1, 6)));
  // Dropped (a lost store): never written.
  ASSERT_TRUE(wb.Start(st_, id_, 0, 6, 8).ok());
  wb.Discard();
  EXPECT_FALSE(wb.pending());
  EXPECT_FALSE(chunks_->ReadRows(id_, 0, 6, 8, &k2, &v2).ok());
  EXPECT_TRUE(wb.Flush().ok());  // nothing left
}

// Staging starts at 64 KiB (32 of these chunks); many chunks on their way make it grow, which
// writes what is on its way first: every chunk still arrives.
TEST_F(WriteBackTest, StagingThatFillsUpGrowsAndLosesNothing) {
  const int64_t chunks = 96;
  const auto [k, v] = Fill(chunks * kChunk, 2);
  WriteBack wb(config_, kChunk, *device_, *rows_, *chunks_);
  for (int64_t c = 0; c < chunks; c += 12) ASSERT_TRUE(wb.Start(st_, id_, 0, c, c + 12).ok());
  ASSERT_TRUE(wb.Flush().ok());
  std::vector<uint8_t> k2, v2;
  ASSERT_TRUE(chunks_->ReadRows(id_, 0, 0, chunks, &k2, &v2).ok());
  EXPECT_EQ(k2, testing_util::BytesOf(k));
  EXPECT_EQ(v2, testing_util::BytesOf(v));
}

}  // namespace
}  // namespace dd::engine
