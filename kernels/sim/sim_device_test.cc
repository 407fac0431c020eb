// The sim device: work on several queues ordered by events gives the right bits however the
// jitter falls; a missing wait (read after write, write after read), a free before the host
// synchronized, a host touch of device memory and an op given host memory each abort on every
// run, naming what did it.
#include "dd/backend/sim_device.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "dd/backend/cpu_device.h"
#include "dd/backend/ops.h"
#include "gtest/gtest.h"

namespace dd::backend {
namespace {

constexpr int64_t kN = 1024;  // floats

class SimDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
  std::unique_ptr<Device> Make(uint64_t seed = 1, int64_t budget = 0) {
    auto d = CreateSimDevice({.budget_bytes = budget, .pool = &pool_, .seed = seed, .max_jitter_us = 200});
    EXPECT_TRUE(d.ok()) << d.status();
    return std::move(*d);
  }
  ThreadPool pool_{2};
};

// Prefetch copies data in, compute adds it to zeros once it has waited, the result comes back.
void AddAcrossQueues(Device& dev, bool wait_for_prefetch) {
  std::vector<float> data(kN), zeros(kN, 0.0f), out(kN, -1.0f);
  std::iota(data.begin(), data.end(), 1.0f);
  auto kv = dev.Allocate(MemoryTag::kKv, kN * 4);
  auto work = dev.Allocate(MemoryTag::kWorkspace, kN * 4);
  ASSERT_TRUE(kv.ok() && work.ok());
  ASSERT_TRUE(dev.CopyToDevice(Queue::kCompute, zeros.data(), *work, 0, kN * 4).ok());
  ASSERT_TRUE(dev.CopyToDevice(Queue::kPrefetch, data.data(), *kv, 0, kN * 4).ok());
  const Event landed = dev.Record(Queue::kPrefetch);
  if (wait_for_prefetch) dev.Wait(Queue::kCompute, landed);
  dev.ops().Add(static_cast<float*>(work->data), static_cast<const float*>(kv->data), kN);
  ASSERT_TRUE(dev.CopyToHost(Queue::kCompute, *work, 0, out.data(), kN * 4).ok());
  ASSERT_TRUE(dev.Synchronize(dev.Record(Queue::kCompute)).ok());
  EXPECT_EQ(out, data);
  dev.Free(*kv);
  dev.Free(*work);
}

TEST_F(SimDeviceTest, WorkOrderedByEventsGivesTheRightResultWhateverTheJitter) {
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    auto dev = Make(seed);
    AddAcrossQueues(*dev, /*wait_for_prefetch=*/true);
    EXPECT_EQ(dev->bytes_in_use(), 0);
  }
}

TEST_F(SimDeviceTest, AReadWithoutWaitingForItsWriterAbortsOnEveryRun) {
  for (uint64_t seed : {1, 2, 3}) {
    EXPECT_DEATH(
        {
          auto dev = Make(seed);
          AddAcrossQueues(*dev, /*wait_for_prefetch=*/false);
        },
        "hazard: compute #2 \\(Add\\) reads kv bytes \\[0, 4096\\), which prefetch #1 \\(copy to kv\\) writes, "
        "without waiting for it");
  }
}

TEST_F(SimDeviceTest, AGatherOverSlotsStillBeingReadAbortsUnlessItWaits) {
  std::vector<float> host(kN, 2.0f);
  for (bool wait : {true, false}) {
    auto body = [&] {
      auto dev = Make();
      auto region = dev->RegisterHostRegion(host.data(), kN * 4);
      auto slots = dev->Allocate(MemoryTag::kResidentSlots, kN * 4);
      auto work = dev->Allocate(MemoryTag::kWorkspace, kN * 4);
      ASSERT_TRUE(region.ok() && slots.ok() && work.ok());
      ASSERT_TRUE(dev->CopyToDevice(Queue::kCompute, host.data(), *slots, 0, kN * 4).ok());
      ASSERT_TRUE(dev->CopyToDevice(Queue::kCompute, host.data(), *work, 0, kN * 4).ok());
      dev->ops().Add(static_cast<float*>(work->data), static_cast<const float*>(slots->data), kN);  // reads slots
      const Event read = dev->Record(Queue::kCompute);
      if (wait) dev->Wait(Queue::kPrefetch, read);
      const GatherBlock blocks[] = {{0, 0}};
      ASSERT_TRUE(dev->Gather(Queue::kPrefetch, *region, blocks, 256, *slots).ok());  // refills a slot
      ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kPrefetch)).ok());
      ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kCompute)).ok());
      dev->Free(*slots);
      dev->Free(*work);
    };
    if (wait) {
      body();
    } else {
      EXPECT_DEATH(body(), "hazard: prefetch #1 \\(gather into resident_slots\\) writes resident_slots bytes "
                           "\\[0, 256\\), which compute #3 \\(Add\\) reads");
    }
  }
}

TEST_F(SimDeviceTest, UploadsCopyAndDeviceCopiesAreOrderedLikeOtherWork) {
  std::vector<float> weights(kN, 4.0f), out(kN);
  for (bool wait : {true, false}) {
    auto body = [&] {
      auto dev = Make();
      auto w = dev->Upload(MemoryTag::kWeights, weights.data(), kN * 4);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_NE(w->data, weights.data());  // a copy in the device arena
      auto slots = dev->Allocate(MemoryTag::kResidentSlots, kN * 4);
      ASSERT_TRUE(slots.ok());
      ASSERT_TRUE(dev->Copy(Queue::kPrefetch, *w, 0, *slots, 0, kN * 4).ok());
      if (wait) dev->Wait(Queue::kCompute, dev->Record(Queue::kPrefetch));
      ASSERT_TRUE(dev->CopyToHost(Queue::kCompute, *slots, 0, out.data(), kN * 4).ok());
      ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kCompute)).ok());
      ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kPrefetch)).ok());
      EXPECT_EQ(out[kN - 1], 4.0f);
      dev->Free(*w);
      dev->Free(*slots);
    };
    if (wait) {
      body();
    } else {
      EXPECT_DEATH(body(), "hazard: compute #2 \\(copy from resident_slots\\) reads resident_slots bytes "
                           "\\[0, 4096\\), which prefetch #1 \\(copy weights to resident_slots\\) writes");
    }
  }
}

TEST_F(SimDeviceTest, OrderingIsTransitiveThroughEvents) {
  // prefetch writes; compute waits for it and records; write-back waits for compute and reads.
  auto dev = Make();
  std::vector<float> data(kN, 3.0f), out(kN);
  auto kv = dev->Allocate(MemoryTag::kKv, kN * 4);
  ASSERT_TRUE(kv.ok());
  ASSERT_TRUE(dev->CopyToDevice(Queue::kPrefetch, data.data(), *kv, 0, kN * 4).ok());
  dev->Wait(Queue::kCompute, dev->Record(Queue::kPrefetch));
  dev->ops().Softcap(static_cast<float*>(kv->data), kN, 30.0f);
  dev->Wait(Queue::kWriteBack, dev->Record(Queue::kCompute));
  ASSERT_TRUE(dev->CopyToHost(Queue::kWriteBack, *kv, 0, out.data(), kN * 4).ok());
  ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kWriteBack)).ok());
  EXPECT_FLOAT_EQ(out[5], 30.0f * std::tanh(3.0f / 30.0f));
  dev->Free(*kv);
}

TEST_F(SimDeviceTest, AnEventRecordedRightAfterAWaitCoversTheWaitedWork) {
  // compute waits for prefetch and records at once, with no work between: synchronizing with
  // that event must mean the prefetch copy is done (the host may read its source and free its
  // buffer), on every run of the jitter.
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    auto dev = Make(seed);
    std::vector<float> data(kN, 2.0f), out(kN, 0.0f);
    auto kv = dev->Allocate(MemoryTag::kKv, kN * 4);
    ASSERT_TRUE(kv.ok());
    ASSERT_TRUE(dev->CopyToDevice(Queue::kPrefetch, data.data(), *kv, 0, kN * 4).ok());
    dev->Wait(Queue::kCompute, dev->Record(Queue::kPrefetch));
    ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kCompute)).ok());
    ASSERT_TRUE(dev->CopyToHost(Queue::kWriteBack, *kv, 0, out.data(), kN * 4).ok());
    ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kWriteBack)).ok());
    EXPECT_EQ(out, data) << "seed " << seed;
    dev->Free(*kv);
  }
}

TEST_F(SimDeviceTest, FreeingBeforeTheHostSynchronizedAborts) {
  EXPECT_DEATH(
      {
        auto dev = Make();
        std::vector<float> data(kN, 1.0f);
        auto kv = dev->Allocate(MemoryTag::kKv, kN * 4);
        (void)dev->CopyToDevice(Queue::kPrefetch, data.data(), *kv, 0, kN * 4);
        dev->Free(*kv);
      },
      "hazard: the host frees kv while prefetch #1 \\(copy to kv\\) may still write it");
}

TEST_F(SimDeviceTest, TheHostCannotTouchDeviceMemory) {
  EXPECT_DEATH(
      {
        auto dev = Make();
        auto kv = dev->Allocate(MemoryTag::kKv, kN * 4);
        static_cast<volatile float*>(kv->data)[3] = 1.0f;
      },
      "");
}

// The converse, which a GPU faults on: an op handed host memory as a device pointer.
TEST_F(SimDeviceTest, AnOpGivenHostMemoryAbortsNamingIt) {
  EXPECT_DEATH(
      {
        auto dev = Make();
        auto work = dev->Allocate(MemoryTag::kWorkspace, kN * 4);
        std::vector<float> host(kN, 1.0f);
        dev->ops().Add(static_cast<float*>(work->data), host.data(), kN);
      },
      "compute #1 \\(Add\\) reads 4096 bytes of host memory: ops take device memory only");
}

TEST_F(SimDeviceTest, BudgetAndRangesAreCheckedLikeTheCpuDevice) {
  auto dev = Make(1, /*budget=*/8192);
  auto a = dev->Allocate(MemoryTag::kWeights, 6000);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(dev->Allocate(MemoryTag::kKv, 3000).status().code(), absl::StatusCode::kResourceExhausted);
  float x = 0;
  EXPECT_EQ(dev->CopyToDevice(Queue::kCompute, &x, *a, 5999, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev->bytes_in_use(MemoryTag::kWeights), 6000);
  dev->Free(*a);
  EXPECT_EQ(CreateSimDevice({}).status().code(), absl::StatusCode::kInvalidArgument);  // no pool
}

// Landmarks computed where the keys are: the cpu's bits, from rows in device memory.
TEST_F(SimDeviceTest, ChunkMeansGiveTheCpusBits) {
  auto dev = Make();
  constexpr int64_t kChunk = 8, kDim = 32, kChunks = 3, kRows = kChunk * kChunks;
  std::vector<float> keys(kRows * kDim);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = std::sin(static_cast<float>(i)) * 3.0f;
  auto rows = dev->Allocate(MemoryTag::kKv, kRows * kDim * 4);
  auto marks = dev->Allocate(MemoryTag::kLandmarks, kChunks * kDim * 4);
  ASSERT_TRUE(rows.ok() && marks.ok());
  ASSERT_TRUE(dev->CopyToDevice(Queue::kCompute, keys.data(), *rows, 0, kRows * kDim * 4).ok());
  std::vector<const void*> on_device(kRows), on_host(kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    const int64_t at = kRows - 1 - i;  // in reverse: any place will do
    on_device[i] = static_cast<const float*>(rows->data) + at * kDim;
    on_host[i] = keys.data() + at * kDim;
  }
  dev->ops().ChunkMeans(on_device.data(), KvDtype::kF32, kChunks, kChunk, kDim, static_cast<float*>(marks->data));
  std::vector<float> got(kChunks * kDim), want(kChunks * kDim);
  ASSERT_TRUE(dev->CopyToHost(Queue::kCompute, *marks, 0, got.data(), kChunks * kDim * 4).ok());
  ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kCompute)).ok());
  ThreadPool pool(1);
  CpuOps(pool).ChunkMeans(on_host.data(), KvDtype::kF32, kChunks, kChunk, kDim, want.data());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));
  dev->Free(*rows);
  dev->Free(*marks);
}

// The low-rank key ops where the keys are: the cpu's bits (f16 keys in, f16 keys out).
TEST_F(SimDeviceTest, LowRankKeyOpsGiveTheCpusBits) {
  auto dev = Make();
  constexpr int64_t kHeads = 2, kDim = 16, kD = kHeads * kDim, kRank = 6, kChunk = 4, kRows = 12;
  std::vector<float> basis(kRank * kD), freq = {1.0f, 0.3f, 0.1f, 0.03f};
  for (size_t i = 0; i < basis.size(); ++i) basis[i] = std::cos(static_cast<float>(i) * 0.7f) * 0.25f;
  std::vector<uint16_t> keys(kRows * kD);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = kernels::F32ToF16(std::sin(static_cast<float>(i)) * 5.0f);
  auto b = dev->Allocate(MemoryTag::kLowRankKeys, kRank * kD * 4);
  auto rows = dev->Allocate(MemoryTag::kKv, kRows * kD * 2);
  auto coeffs = dev->Allocate(MemoryTag::kLowRankKeys, kRows * kRank * 4);
  auto out = dev->Allocate(MemoryTag::kResidentSlots, 2 * kChunk * kDim * 2);
  ASSERT_TRUE(b.ok() && rows.ok() && coeffs.ok() && out.ok());
  ASSERT_TRUE(dev->CopyToDevice(Queue::kCompute, basis.data(), *b, 0, b->bytes).ok());
  ASSERT_TRUE(dev->CopyToDevice(Queue::kCompute, keys.data(), *rows, 0, rows->bytes).ok());
  LowRankKeys f{.basis = static_cast<const float*>(b->data), .rank = kRank, .n_head_kv = kHeads, .head_dim = kDim,
                .inv_freq = freq.data(), .half = 4, .neox = true, .kv = KvDtype::kF16};
  std::vector<const void*> on_device(kRows), on_host(kRows);
  std::vector<int64_t> pos(kRows);
  for (int64_t i = 0; i < kRows; ++i) {
    on_device[i] = static_cast<const uint16_t*>(rows->data) + i * kD;
    on_host[i] = keys.data() + i * kD;
    pos[i] = 100 + i;
  }
  dev->ops().ProjectKeys(f, on_device.data(), pos, static_cast<float*>(coeffs->data));
  const float* dc = static_cast<const float*>(coeffs->data);
  const std::vector<const float*> items = {dc + 2 * kChunk * kRank, dc};
  const std::vector<int64_t> first = {108, 100};
  const std::vector<int32_t> heads = {1, 0};
  std::vector<void*> dst = {out->data, static_cast<uint16_t*>(out->data) + kChunk * kDim};
  dev->ops().ReconstructKeys(f, items.data(), first, heads, kChunk, dst.data());
  std::vector<float> got_coeffs(kRows * kRank);
  std::vector<uint16_t> got(2 * kChunk * kDim);
  ASSERT_TRUE(dev->CopyToHost(Queue::kCompute, *coeffs, 0, got_coeffs.data(), coeffs->bytes).ok());
  ASSERT_TRUE(dev->CopyToHost(Queue::kCompute, *out, 0, got.data(), out->bytes).ok());
  ASSERT_TRUE(dev->Synchronize(dev->Record(Queue::kCompute)).ok());
  ThreadPool pool(1);
  CpuOps cpu(pool);
  LowRankKeys h = f;
  h.basis = basis.data();
  std::vector<float> want_coeffs(kRows * kRank);
  cpu.ProjectKeys(h, on_host.data(), pos, want_coeffs.data());
  EXPECT_EQ(got_coeffs, want_coeffs);
  std::vector<uint16_t> want(2 * kChunk * kDim);
  const std::vector<const float*> host_items = {want_coeffs.data() + 2 * kChunk * kRank, want_coeffs.data()};
  std::vector<void*> host_dst = {want.data(), want.data() + kChunk * kDim};
  cpu.ReconstructKeys(h, host_items.data(), first, heads, kChunk, host_dst.data());
  EXPECT_EQ(got, want);
  for (DeviceBuffer* x : {&*b, &*rows, &*coeffs, &*out}) dev->Free(*x);
}

}  // namespace
}  // namespace dd::backend
