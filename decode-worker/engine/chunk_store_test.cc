// ChunkStore, the sparse cache's host side: chunks written as blocks come back as the same
// rows, a fork's blocks are a copy, blocks
// land in device memory on a device the host cannot read (sim) as on the cpu, and a store that
// writes CUDA memory itself lands them with no copy, after the slots' readers.
#include "decode-worker/engine/chunk_store.h"

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "dd/backend/cpu_device.h"
#include "dd/backend/sim_device.h"
#include "decode-worker/engine/engine_test_util.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

constexpr int64_t kChunk = 8;

model::ModelConfig Config() { return testing_util::SmallConfig({false, false}, /*head_dim=*/16); }

std::vector<float> Rows(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

TEST(ChunkStoreTest, WrittenChunksReadBackAsTheSameRows) {
  const model::ModelConfig c = Config();
  const int64_t kv_dim = c.n_head_kv * c.head_dim, chunks = 3;
  ThreadPool pool(1);
  backend::CpuDevice device(0, pool);
  auto store = kvpool::NewInProcessKvStore();
  ChunkStore cs(c, kChunk, store.get(), device);
  auto id = cs.Open();
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<float> k = Rows(chunks * kChunk * kv_dim, 1), v = Rows(chunks * kChunk * kv_dim, 2);
  ASSERT_TRUE(cs.WriteChunks(*id, 1, 0, chunks, k.data(), v.data()).ok());
  std::vector<uint8_t> k2, v2;
  ASSERT_TRUE(cs.ReadRows(*id, 1, 1, chunks, &k2, &v2).ok());
  EXPECT_EQ(k2, testing_util::BytesOf(std::vector<float>(k.begin() + kChunk * kv_dim, k.end())));
  EXPECT_EQ(v2, testing_util::BytesOf(std::vector<float>(v.begin() + kChunk * kv_dim, v.end())));
  // A fork: layer 1's first two chunks copied, the third not.
  auto fork = cs.Open();
  ASSERT_TRUE(fork.ok());
  const std::vector<int64_t> per_layer = {0, 2};
  ASSERT_TRUE(cs.CopyBlocks(*id, *fork, per_layer).ok());
  ASSERT_TRUE(cs.ReadRows(*fork, 1, 0, 2, &k2, &v2).ok());
  EXPECT_EQ(k2, testing_util::BytesOf(std::vector<float>(k.begin(), k.begin() + 2 * kChunk * kv_dim)));
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
    ASSERT_TRUE(cs.WriteChunks(*id, 0, 0, 2, k.data(), v.data()).ok());
    auto slots = device->Allocate(backend::MemoryTag::kResidentSlots, 4 * cs.block_bytes());
    ASSERT_TRUE(slots.ok());
    // Chunk 1 head 1 into slot 0, chunk 0 head 0 into slot 3.
    const std::vector<kvpool::ChunkRef> refs = {{0, 1, 1}, {0, 0, 0}};
    std::vector<ChunkStore::BlockDst> dsts = {{*slots, 0}, {*slots, 3 * cs.block_bytes()}};
    ChunkStore::Landing landing;
    ASSERT_TRUE(cs.StartLanding(*id, refs, dsts, kvpool::Priority::kUrgent, &landing).ok());
    ASSERT_TRUE(cs.FinishLanding(landing, backend::Queue::kUrgent).ok());
    std::vector<float> got(4 * (cs.block_bytes() / 4));
    ASSERT_TRUE(device->CopyToHost(backend::Queue::kCompute, *slots, 0, got.data(), slots->bytes).ok());
    ASSERT_TRUE(device->Synchronize(device->Record(backend::Queue::kCompute)).ok());
    const int64_t hd = c.head_dim;
    for (int64_t t = 0; t < kChunk; ++t) {
      for (int64_t i = 0; i < hd; ++i) {
        ASSERT_EQ(got[t * hd + i], k[(kChunk + t) * kv_dim + hd + i]) << name;  // slot 0: K of chunk 1, head 1
        ASSERT_EQ(got[3 * (cs.block_bytes() / 4) + (kChunk + t) * hd + i], v[t * kv_dim + i]) << name;  // slot 3: V
      }
    }
    EXPECT_EQ(cs.fetched_chunks(), 2);
    device->Free(*slots);
    cs.Release(*id);
  }
}

// Two stores over one KV store on a device that gathers from the store's mapped memory: the
// one that lands blocks registers that memory, a host-I/O-only one (the dense layers' prefix
// store) never does, so it cannot take the registration from the other (CUDA refuses a second).
TEST(ChunkStoreTest, AHostOnlyStoreRegistersNothingWithTheDevice) {
  const model::ModelConfig c = Config();
  const int64_t kv_dim = c.n_head_kv * c.head_dim;
  ThreadPool pool(2);
  auto device = backend::CreateSimDevice({.pool = &pool});
  ASSERT_TRUE(device.ok()) << device.status();
  auto store = kvpool::NewInProcessKvStore();
  ChunkStore host_only(c, kChunk, store.get(), **device, /*device_gathers=*/false);
  auto id = host_only.Open();
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<float> k = Rows(2 * kChunk * kv_dim, 5), v = Rows(2 * kChunk * kv_dim, 6);
  ASSERT_TRUE(host_only.WriteChunks(*id, 0, 0, 2, k.data(), v.data()).ok());
  EXPECT_EQ(host_only.registered_regions(), 0);
  ChunkStore lands(c, kChunk, store.get(), **device);
  auto other = lands.Open();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_GT(lands.registered_regions(), 0) << "the in-process store's arena, registered at admission";
  host_only.Release(*id);
  lands.Release(*other);
}

// A device whose memory the store's transport may write itself (cuda's, with GPUDirect): the
// cpu device's memory, which the host can write, presented as memory the host does not read in
// place but a transport writes itself (MemoryCaps). It counts the
// host's synchronizations with the compute queue.
class CudaMemoryDevice final : public backend::Device {
 public:
  explicit CudaMemoryDevice(ThreadPool& pool) : cpu_(0, pool) {}
  absl::string_view name() const override { return "cuda-memory"; }
  backend::MemoryCaps caps() const override { return {.transport_writes_device_memory = true}; }
  absl::StatusOr<backend::DeviceBuffer> Allocate(backend::MemoryTag t, int64_t b) override { return cpu_.Allocate(t, b); }
  void Free(backend::DeviceBuffer& b) override { cpu_.Free(b); }
  int64_t budget() const override { return cpu_.budget(); }
  int64_t bytes_in_use(backend::MemoryTag t) const override { return cpu_.bytes_in_use(t); }
  int64_t bytes_in_use() const override { return cpu_.bytes_in_use(); }
  absl::StatusOr<backend::DeviceBuffer> Upload(backend::MemoryTag t, const void* src, int64_t b) override {
    return cpu_.Upload(t, src, b);
  }
  backend::Event Record(backend::Queue q) override { return cpu_.Record(q); }
  void Wait(backend::Queue q, const backend::Event& e) override { cpu_.Wait(q, e); }
  absl::Status Synchronize(const backend::Event& e) override {
    if (e.queue == backend::Queue::kCompute) ++compute_syncs;
    return cpu_.Synchronize(e);
  }
  absl::Status CopyToDevice(backend::Queue q, const void* src, const backend::DeviceBuffer& dst, int64_t off,
                            int64_t b) override {
    ++copies;
    return cpu_.CopyToDevice(q, src, dst, off, b);
  }
  absl::Status CopyToHost(backend::Queue q, const backend::DeviceBuffer& src, int64_t off, void* dst,
                          int64_t b) override {
    return cpu_.CopyToHost(q, src, off, dst, b);
  }
  absl::Status Copy(backend::Queue q, const backend::DeviceBuffer& src, int64_t so, const backend::DeviceBuffer& dst,
                    int64_t d, int64_t b) override {
    ++copies;
    return cpu_.Copy(q, src, so, dst, d, b);
  }
  absl::StatusOr<backend::HostRegion> RegisterHostRegion(const void* base, int64_t b) override {
    return cpu_.RegisterHostRegion(base, b);
  }
  void UnregisterHostRegion(const backend::HostRegion& r) override { cpu_.UnregisterHostRegion(r); }
  absl::Status Gather(backend::Queue q, const backend::HostRegion& r, absl::Span<const backend::GatherBlock> blocks,
                      int64_t block_bytes, const backend::DeviceBuffer& dst) override {
    ++copies;
    return cpu_.Gather(q, r, blocks, block_bytes, dst);
  }
  backend::Ops& ops() override { return cpu_.ops(); }

  int compute_syncs = 0, copies = 0;

 private:
  backend::CpuDevice cpu_;
};

// The in-process store's blocks, reached as a ucx:// pool's over one-sided gets with a UCX that
// reports CUDA memory: nothing mapped, gathers written into the destinations by the store. It
// records how many compute synchronizations the device had seen when each gather into CUDA
// memory started, and can fail the next one.
class CudaDestinationStore final : public kvpool::KvStore {
 public:
  explicit CudaDestinationStore(const CudaMemoryDevice& device) : device_(device) {}
  absl::StatusOr<kvpool::SequenceId> Open(const kvpool::KvLayout& l) override { return inner_->Open(l); }
  absl::Status Write(kvpool::SequenceId s, const kvpool::ChunkRef& r, const void* b) override {
    return inner_->Write(s, r, b);
  }
  absl::StatusOr<kvpool::TransferId> GatherTo(kvpool::SequenceId s, absl::Span<const kvpool::ChunkRef> refs,
                                              absl::Span<void* const> dsts, kvpool::Priority p,
                                              kvpool::DstMemory memory, kvpool::BlockPart part) override {
    if (memory == kvpool::DstMemory::kHost) return inner_->GatherTo(s, refs, dsts, p, memory, part);
    syncs_at_gather.push_back(device_.compute_syncs);
    if (fail_next) {
      fail_next = false;
      return absl::UnavailableError("no path writes CUDA memory");
    }
    return inner_->GatherTo(s, refs, dsts, p, kvpool::DstMemory::kHost, part);
  }
  absl::StatusOr<kvpool::KvLayout> Layout(kvpool::SequenceId s) const override { return inner_->Layout(s); }
  absl::Status Wait(kvpool::TransferId id) override { return inner_->Wait(id); }
  absl::Status Release(kvpool::SequenceId s) override { return inner_->Release(s); }
  int64_t bytes_stored() const override { return inner_->bytes_stored(); }
  int64_t wait_ns() const override { return inner_->wait_ns(); }
  void SetLink(const kvpool::LinkModel& l) override { inner_->SetLink(l); }
  bool WritesDeviceMemory() const override { return true; }

  std::vector<int> syncs_at_gather;
  bool fail_next = false;

 private:
  const CudaMemoryDevice& device_;
  std::unique_ptr<kvpool::KvStore> inner_ = kvpool::NewInProcessKvStore();
};

TEST(ChunkStoreTest, AStoreThatWritesCudaMemoryGathersStraightIntoTheSlotsAfterTheirReaders) {
  const model::ModelConfig c = Config();
  const int64_t kv_dim = c.n_head_kv * c.head_dim;
  ThreadPool pool(2);
  CudaMemoryDevice device(pool);
  CudaDestinationStore store(device);
  ChunkStore cs(c, kChunk, &store, device);
  auto id = cs.Open();
  ASSERT_TRUE(id.ok());
  const std::vector<float> k = Rows(2 * kChunk * kv_dim, 7), v = Rows(2 * kChunk * kv_dim, 8);
  ASSERT_TRUE(cs.WriteChunks(*id, 1, 0, 2, k.data(), v.data()).ok());
  auto slots = device.Allocate(backend::MemoryTag::kResidentSlots, 2 * cs.block_bytes());
  ASSERT_TRUE(slots.ok());
  const std::vector<kvpool::ChunkRef> refs = {{1, 0, 1}, {1, 1, 0}};
  const int copies_before = device.copies;
  for (kvpool::Priority p : {kvpool::Priority::kUrgent, kvpool::Priority::kBackground}) {
    ChunkStore::Landing landing;
    const int syncs = device.compute_syncs;
    ASSERT_TRUE(cs.StartLanding(*id, refs, {{*slots, 0}, {*slots, cs.block_bytes()}}, p, &landing).ok());
    ASSERT_EQ(store.syncs_at_gather.size(), p == kvpool::Priority::kUrgent ? 1u : 2u);
    EXPECT_GT(store.syncs_at_gather.back(), syncs) << "the store wrote the slots before their readers were done";
    ASSERT_TRUE(cs.FinishLanding(landing, backend::Queue::kUrgent).ok());
  }
  EXPECT_EQ(device.copies, copies_before) << "no staging copy or device gather";
  EXPECT_EQ(cs.direct_chunks(), 4);
  EXPECT_EQ(cs.fetched_chunks(), 4);
  EXPECT_EQ(cs.staged_gathered_chunks(), 0);
  std::vector<float> got(2 * (cs.block_bytes() / 4));
  ASSERT_TRUE(device.CopyToHost(backend::Queue::kCompute, *slots, 0, got.data(), slots->bytes).ok());
  const int64_t hd = c.head_dim;
  for (int64_t t = 0; t < kChunk; ++t) {
    for (int64_t i = 0; i < hd; ++i) {
      ASSERT_EQ(got[t * hd + i], k[(kChunk + t) * kv_dim + i]);  // slot 0: K of chunk 1, head 0
      ASSERT_EQ(got[(cs.block_bytes() / 4) + (kChunk + t) * hd + i], v[t * kv_dim + hd + i]);  // slot 1: V, chunk 0, head 1
    }
  }
  // A gather into CUDA memory that fails turns direct landings off: the error reaches the
  // caller, and the next landing goes through the host staging, the same bytes.
  store.fail_next = true;
  ChunkStore::Landing failed;
  EXPECT_EQ(cs.StartLanding(*id, refs, {{*slots, 0}, {*slots, cs.block_bytes()}}, kvpool::Priority::kUrgent, &failed)
                .code(),
            absl::StatusCode::kUnavailable);
  std::vector<float> zero(2 * (cs.block_bytes() / 4), 0.0f);
  ASSERT_TRUE(device.CopyToDevice(backend::Queue::kCompute, zero.data(), *slots, 0, slots->bytes).ok());
  ChunkStore::Landing staged;
  ASSERT_TRUE(cs.StartLanding(*id, refs, {{*slots, 0}, {*slots, cs.block_bytes()}}, kvpool::Priority::kUrgent, &staged)
                  .ok());
  ASSERT_TRUE(cs.FinishLanding(staged, backend::Queue::kUrgent).ok());
  EXPECT_EQ(store.syncs_at_gather.size(), 3u) << "no further gather into CUDA memory";
  EXPECT_EQ(cs.direct_chunks(), 4);
  EXPECT_GT(device.copies, copies_before + 1) << "the staging moved the blocks";
  std::vector<float> again(2 * (cs.block_bytes() / 4));
  ASSERT_TRUE(device.CopyToHost(backend::Queue::kCompute, *slots, 0, again.data(), slots->bytes).ok());
  EXPECT_EQ(again, got);
  device.Free(*slots);
  cs.Release(*id);
}

// A values-only landing (a layer whose keys are rebuilt on the device) moves each block's V half
// into the V half of its destination and leaves the K half as it was, on every landing path:
// written in place (cpu), gathered by the device from the store's mapped memory (sim), written
// by the store's transport into device memory, and through the host staging.
TEST(ChunkStoreTest, AValuesOnlyLandingWritesTheVHalfAloneOnEveryPath) {
  const model::ModelConfig c = Config();
  const int64_t kv_dim = c.n_head_kv * c.head_dim, hd = c.head_dim;
  ThreadPool pool(2);
  const auto check = [&](const char* path, backend::Device& device, kvpool::KvStore& store, int runs,
                         const std::function<void()>& before_first) {
    SCOPED_TRACE(path);
    ChunkStore cs(c, kChunk, &store, device);
    auto id = cs.Open();
    ASSERT_TRUE(id.ok());
    const std::vector<float> k = Rows(2 * kChunk * kv_dim, 9), v = Rows(2 * kChunk * kv_dim, 10);
    ASSERT_TRUE(cs.WriteChunks(*id, 0, 0, 2, k.data(), v.data()).ok());
    auto slots = device.Allocate(backend::MemoryTag::kResidentSlots, 2 * cs.block_bytes());
    ASSERT_TRUE(slots.ok());
    const int64_t floats = cs.block_bytes() / 4;
    for (int run = 0; run < runs; ++run) {
      if (run == 0 && before_first) before_first();
      const std::vector<float> marker(2 * floats, -7.0f);
      ASSERT_TRUE(device.CopyToDevice(backend::Queue::kCompute, marker.data(), *slots, 0, slots->bytes).ok());
      ChunkStore::Landing landing;
      // Chunk 1 of head 1 into slot 1.
      absl::Status st = cs.StartLanding(*id, {{{0, 1, 1}}}, {{*slots, cs.block_bytes()}}, kvpool::Priority::kUrgent,
                                        &landing, kvpool::BlockPart::kValues);
      if (!st.ok() && run < runs - 1) continue;  // a failure injected to switch paths
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(cs.FinishLanding(landing, backend::Queue::kUrgent).ok());
      std::vector<float> got(2 * floats);
      ASSERT_TRUE(device.CopyToHost(backend::Queue::kCompute, *slots, 0, got.data(), slots->bytes).ok());
      ASSERT_TRUE(device.Synchronize(device.Record(backend::Queue::kCompute)).ok());
      for (int64_t i = 0; i < floats; ++i) ASSERT_EQ(got[i], -7.0f) << "slot 0 untouched";
      for (int64_t t = 0; t < kChunk; ++t) {
        for (int64_t i = 0; i < hd; ++i) {
          ASSERT_EQ(got[floats + t * hd + i], -7.0f) << "the K half untouched";
          ASSERT_EQ(got[floats + (kChunk + t) * hd + i], v[(kChunk + t) * kv_dim + hd + i]);
        }
      }
    }
    EXPECT_GT(cs.values_only_chunks(), 0);
    EXPECT_EQ(cs.values_only_chunks(), cs.fetched_chunks());
    device.Free(*slots);
    cs.Release(*id);
  };
  {
    backend::CpuDevice cpu(0, pool);
    auto store = kvpool::NewInProcessKvStore();
    check("cpu, in place", cpu, *store, 1, nullptr);
  }
  {
    auto sim = backend::CreateSimDevice({.pool = &pool, .seed = 4, .max_jitter_us = 100});
    ASSERT_TRUE(sim.ok()) << sim.status();
    auto store = kvpool::NewInProcessKvStore();
    check("sim, device gather", **sim, *store, 1, nullptr);
  }
  {
    CudaMemoryDevice device(pool);
    CudaDestinationStore store(device);
    check("transport into device memory", device, store, 1, nullptr);
  }
  {
    CudaMemoryDevice device(pool);
    CudaDestinationStore store(device);
    // The direct landing fails once; the next goes through the host staging.
    check("host staging", device, store, 2, [&store] { store.fail_next = true; });
  }
}

}  // namespace
}  // namespace dd::engine
