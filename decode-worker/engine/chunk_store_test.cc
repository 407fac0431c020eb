// ChunkStore, the sparse cache's host side: chunks written as blocks come back as the same
// rows, each landmark is its chunk's mean key per KV head, a fork's blocks are a copy, and
// blocks land in device memory on a device the host cannot read (sim) as on the cpu.
#include "decode-worker/engine/chunk_store.h"

#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "dd/backend/cpu_device.h"
#include "dd/backend/sim_device.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

constexpr int64_t kChunk = 8;

model::ModelConfig Config() {
  model::ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = 16;
  c.n_ctx_train = 4096;
  c.layer_is_swa.assign(c.n_layer, false);
  return c;
}

std::vector<float> Rows(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

TEST(ChunkStoreTest, WrittenChunksReadBackWithTheirMeanKeysAsLandmarks) {
  const model::ModelConfig c = Config();
  const int64_t kv_dim = c.n_head_kv * c.head_dim, chunks = 3;
  ThreadPool pool(1);
  backend::CpuDevice device(0, pool);
  auto store = kvpool::NewInProcessKvStore();
  ChunkStore cs(c, kChunk, store.get(), device);
  auto id = cs.Open();
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<float> k = Rows(chunks * kChunk * kv_dim, 1), v = Rows(chunks * kChunk * kv_dim, 2);
  std::vector<float> marks(chunks * kv_dim);
  ASSERT_TRUE(cs.WriteChunks(*id, 1, 0, chunks, k.data(), v.data(), marks.data()).ok());
  for (int64_t ch = 0; ch < chunks; ++ch) {
    for (int64_t g = 0; g < c.n_head_kv; ++g) {
      for (int64_t i = 0; i < c.head_dim; ++i) {
        double sum = 0;
        for (int64_t t = 0; t < kChunk; ++t) sum += k[(ch * kChunk + t) * kv_dim + g * c.head_dim + i];
        ASSERT_EQ(marks[(ch * c.n_head_kv + g) * c.head_dim + i], static_cast<float>(sum / kChunk));
      }
    }
  }
  std::vector<float> k2, v2;
  ASSERT_TRUE(cs.ReadRows(*id, 1, 1, chunks, &k2, &v2).ok());
  EXPECT_EQ(k2, std::vector<float>(k.begin() + kChunk * kv_dim, k.end()));
  EXPECT_EQ(v2, std::vector<float>(v.begin() + kChunk * kv_dim, v.end()));
  // A fork: layer 1's first two chunks copied, the third not.
  auto fork = cs.Open();
  ASSERT_TRUE(fork.ok());
  const std::vector<int64_t> per_layer = {0, 2};
  ASSERT_TRUE(cs.CopyBlocks(*id, *fork, per_layer).ok());
  ASSERT_TRUE(cs.ReadRows(*fork, 1, 0, 2, &k2, &v2).ok());
  EXPECT_EQ(k2, std::vector<float>(k.begin(), k.begin() + 2 * kChunk * kv_dim));
  EXPECT_FALSE(cs.ReadRows(*fork, 1, 2, 3, &k2, &v2).ok()) << "a chunk the fork did not copy";
  cs.Release(*id);
  cs.Release(*fork);
}

TEST(ChunkStoreTest, BlocksLandInDeviceMemoryOnEveryDevice) {
  const model::ModelConfig c = Config();
  const int64_t kv_dim = c.n_head_kv * c.head_dim;
  ThreadPool pool(2);
  for (const char* name : {"cpu", "sim"}) {
    std::unique_ptr<backend::Device> device;
    if (std::string(name) == "cpu") {
      device = std::make_unique<backend::CpuDevice>(0, pool);
    } else {
      auto d = backend::CreateSimDevice({.pool = &pool, .seed = 3, .max_jitter_us = 100});
      ASSERT_TRUE(d.ok()) << d.status();
      device = std::move(*d);
    }
    auto store = kvpool::NewInProcessKvStore();
    ChunkStore cs(c, kChunk, store.get(), *device);
    auto id = cs.Open();
    ASSERT_TRUE(id.ok());
    const std::vector<float> k = Rows(2 * kChunk * kv_dim, 5), v = Rows(2 * kChunk * kv_dim, 6);
    ASSERT_TRUE(cs.WriteChunks(*id, 0, 0, 2, k.data(), v.data(), nullptr).ok());
    auto slots = device->Allocate(backend::MemoryTag::kResidentSlots, 4 * cs.block_bytes());
    ASSERT_TRUE(slots.ok());
    // Chunk 1 head 1 into slot 0, chunk 0 head 0 into slot 3.
    const std::vector<kvpool::ChunkRef> refs = {{0, 1, 1}, {0, 0, 0}};
    std::vector<ChunkStore::BlockDst> dsts = {{*slots, 0}, {*slots, 3 * cs.block_bytes()}};
    ChunkStore::Landing landing;
    ASSERT_TRUE(cs.StartLanding(*id, refs, dsts, kvpool::Priority::kUrgent, &landing).ok());
    ASSERT_TRUE(cs.FinishLanding(landing, backend::Queue::kUrgent).ok());
    std::vector<float> got(4 * cs.block_floats());
    ASSERT_TRUE(device->CopyToHost(backend::Queue::kCompute, *slots, 0, got.data(), slots->bytes).ok());
    ASSERT_TRUE(device->Synchronize(device->Record(backend::Queue::kCompute)).ok());
    const int64_t hd = c.head_dim;
    for (int64_t t = 0; t < kChunk; ++t) {
      for (int64_t i = 0; i < hd; ++i) {
        ASSERT_EQ(got[t * hd + i], k[(kChunk + t) * kv_dim + hd + i]) << name;  // slot 0: K of chunk 1, head 1
        ASSERT_EQ(got[3 * cs.block_floats() + (kChunk + t) * hd + i], v[t * kv_dim + i]) << name;  // slot 3: V
      }
    }
    EXPECT_EQ(cs.fetched_chunks(), 2);
    device->Free(*slots);
    cs.Release(*id);
  }
}

}  // namespace
}  // namespace dd::engine
