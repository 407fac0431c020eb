// The cpu device behind the compute-backend seam: budgeted allocation by tag, range-checked
// copies and gathers, the registry's answers for each device name, and ops that give the bits
// of the reference kernels they wrap, a row's bits independent of its batch.
#include "dd/backend/cpu_device.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "dd/backend/registry.h"
#include "dd/kernels/cpu_ops.h"
#include "gtest/gtest.h"

namespace dd::backend {
namespace {

TEST(CpuDeviceTest, AllocationsAreCountedByTagAndBoundedByTheBudget) {
  ThreadPool pool(1);
  CpuDevice dev(1000, pool);
  auto a = dev.Allocate(MemoryTag::kWeights, 600);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = dev.Allocate(MemoryTag::kKv, 300);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(dev.bytes_in_use(MemoryTag::kWeights), 600);
  EXPECT_EQ(dev.bytes_in_use(MemoryTag::kKv), 300);
  EXPECT_EQ(dev.bytes_in_use(), 900);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data) % 64, 0u);
  auto c = dev.Allocate(MemoryTag::kLandmarks, 101);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("landmarks"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("900 of 1000"), std::string::npos) << c.status();
  auto d = dev.Allocate(MemoryTag::kLandmarks, 100);  // exactly the rest fits
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(dev.Allocate(MemoryTag::kKv, -1).status().code(), absl::StatusCode::kInvalidArgument);
  dev.Free(*a);
  EXPECT_FALSE(*a);
  EXPECT_EQ(dev.bytes_in_use(MemoryTag::kWeights), 0);
  EXPECT_EQ(dev.bytes_in_use(), 400);
  dev.Free(*b);
  dev.Free(*d);
  EXPECT_EQ(dev.bytes_in_use(), 0);
}

TEST(CpuDeviceTest, UploadsUseTheHostMemoryInPlaceAndCountAgainstTheBudget) {
  ThreadPool pool(1);
  CpuDevice dev(1000, pool);
  std::vector<float> weights(200, 0.5f);
  auto w = dev.Upload(MemoryTag::kWeights, weights.data(), 800);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->data, weights.data());
  EXPECT_EQ(dev.bytes_in_use(MemoryTag::kWeights), 800);
  EXPECT_EQ(dev.Upload(MemoryTag::kWeights, weights.data(), 201).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(dev.Upload(MemoryTag::kWeights, nullptr, 0).status().code(), absl::StatusCode::kInvalidArgument);
  dev.Free(*w);  // must not free the caller's memory (ASan would say so)
  EXPECT_EQ(dev.bytes_in_use(), 0);
  EXPECT_EQ(weights[199], 0.5f);
}

TEST(CpuDeviceTest, DeviceToDeviceCopiesAreCheckedAndRefuseOverlap) {
  ThreadPool pool(1);
  CpuDevice dev(0, pool);
  auto a = dev.Allocate(MemoryTag::kWorkspace, 16);
  auto b = dev.Allocate(MemoryTag::kKv, 16);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(dev.CopyToDevice(Queue::kCompute, "abcdefghijklmnop", *a, 0, 16).ok());
  ASSERT_TRUE(dev.Copy(Queue::kCompute, *a, 2, *b, 8, 8).ok());
  char out[8] = {};
  ASSERT_TRUE(dev.CopyToHost(Queue::kCompute, *b, 8, out, 8).ok());
  EXPECT_EQ(std::string(out, 8), "cdefghij");
  EXPECT_EQ(dev.Copy(Queue::kCompute, *a, 9, *b, 0, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.Copy(Queue::kCompute, *a, 0, *b, 9, 8).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status overlap = dev.Copy(Queue::kCompute, *a, 0, *a, 4, 8);
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.message().find("overlapping"), std::string::npos) << overlap;
  EXPECT_TRUE(dev.Copy(Queue::kCompute, *a, 0, *a, 8, 8).ok());  // adjacent, not overlapping
  dev.Free(*a);
  dev.Free(*b);
}

TEST(CpuDeviceTest, CopiesAreCheckedAgainstTheBuffer) {
  ThreadPool pool(1);
  CpuDevice dev(0, pool);
  auto buf = dev.Allocate(MemoryTag::kWorkspace, 16);
  ASSERT_TRUE(buf.ok());
  const char in[16] = "abcdefghijklmno";
  ASSERT_TRUE(dev.CopyToDevice(Queue::kCompute, in, *buf, 0, 16).ok());
  char out[8] = {};
  ASSERT_TRUE(dev.CopyToHost(Queue::kCompute, *buf, 4, out, 8).ok());
  EXPECT_EQ(std::string(out, 8), "efghijkl");
  EXPECT_EQ(dev.CopyToDevice(Queue::kCompute, in, *buf, 9, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.CopyToHost(Queue::kCompute, *buf, -1, out, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.CopyToHost(Queue::kCompute, *buf, 8, out, INT64_MAX).code(), absl::StatusCode::kInvalidArgument);
  dev.Free(*buf);
}

// A device result read on the host: in place on the cpu (no copy), copied into the caller's
// staging on the simulated device; ranges checked either way.
TEST(CpuDeviceTest, ReadOnHostReadsInPlaceOrCopiesIntoTheStaging) {
  ThreadPool pool(1);
  const char in[16] = "abcdefghijklmno";
  for (const char* name : {"cpu", "sim"}) {
    SCOPED_TRACE(name);
    auto dev = CreateDevice(name, {.budget_bytes = 1 << 16, .pool = &pool});
    ASSERT_TRUE(dev.ok()) << dev.status();
    Device& d = **dev;
    auto buf = d.Allocate(MemoryTag::kWorkspace, 16);
    ASSERT_TRUE(buf.ok());
    ASSERT_TRUE(d.CopyToDevice(Queue::kCompute, in, *buf, 0, 16).ok());
    char staging[8] = {};
    auto read = d.ReadOnHost(Queue::kCompute, *buf, 4, 8, staging);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_TRUE(d.Synchronize(d.Record(Queue::kCompute)).ok());
    const bool in_place = d.caps().host_reads_device_memory;
    EXPECT_EQ(*read, in_place ? static_cast<const void*>(static_cast<const char*>(buf->data) + 4)
                              : static_cast<const void*>(staging));
    EXPECT_EQ(std::string(static_cast<const char*>(*read), 8), "efghijkl");
    EXPECT_EQ(d.ReadOnHost(Queue::kCompute, *buf, 9, 8, staging).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(d.ReadOnHost(Queue::kCompute, *buf, 8, INT64_MAX, staging).status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(d.Synchronize(d.Record(Queue::kCompute)).ok());
    d.Free(*buf);
  }
}

TEST(CpuDeviceTest, GathersCopyBlocksFromARegisteredRegionOrNothing) {
  ThreadPool pool(1);
  CpuDevice dev(0, pool);
  std::vector<uint8_t> host(64);
  std::iota(host.begin(), host.end(), 0);
  auto region = dev.RegisterHostRegion(host.data(), 64);
  ASSERT_TRUE(region.ok()) << region.status();
  auto slots = dev.Allocate(MemoryTag::kResidentSlots, 24);
  ASSERT_TRUE(slots.ok());
  std::memset(slots->data, 0xff, 24);
  const GatherBlock blocks[] = {{48, 0}, {8, 16}};
  ASSERT_TRUE(dev.Gather(Queue::kUrgent, *region, blocks, 8, *slots).ok());
  const auto* s = static_cast<const uint8_t*>(slots->data);
  EXPECT_EQ(s[0], 48);
  EXPECT_EQ(s[7], 55);
  EXPECT_EQ(s[8], 0xff);  // untouched
  EXPECT_EQ(s[16], 8);
  // A block past the region's end: refused, naming the block, and nothing copied.
  std::memset(slots->data, 0xff, 24);
  const GatherBlock bad[] = {{0, 0}, {60, 8}};
  const absl::Status st = dev.Gather(Queue::kPrefetch, *region, bad, 8, *slots);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("block 1"), std::string::npos) << st;
  EXPECT_EQ(s[0], 0xff);
  const GatherBlock past_slots[] = {{0, 20}};
  EXPECT_EQ(dev.Gather(Queue::kPrefetch, *region, past_slots, 8, *slots).code(), absl::StatusCode::kInvalidArgument);
  dev.UnregisterHostRegion(*region);
  EXPECT_EQ(dev.Gather(Queue::kPrefetch, *region, blocks, 8, *slots).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dev.RegisterHostRegion(nullptr, 8).status().code(), absl::StatusCode::kInvalidArgument);
  dev.Free(*slots);
}

TEST(CpuDeviceTest, EventsAreOrderedPerQueue) {
  ThreadPool pool(1);
  CpuDevice dev(0, pool);
  const Event a = dev.Record(Queue::kPrefetch);
  const Event b = dev.Record(Queue::kPrefetch);
  EXPECT_EQ(a.queue, Queue::kPrefetch);
  EXPECT_LT(a.seq, b.seq);
  dev.Wait(Queue::kCompute, b);
  EXPECT_TRUE(dev.Synchronize(b).ok());
}

TEST(DeviceRegistryTest, TheCpuBackendIsAlwaysThereAndCudaSaysWhatItIs) {
  const std::vector<BackendInfo> backends = ListBackends();
  ASSERT_EQ(backends.size(), 2u);
  EXPECT_EQ(backends[0].name, "cpu");
  EXPECT_TRUE(backends[0].compiled && backends[0].usable);
  EXPECT_EQ(backends[1].name, "cuda");
  EXPECT_EQ(backends[1].usable, CudaUsable());
  EXPECT_FALSE(backends[1].detail.empty());  // the device's name, or why not
}

TEST(DeviceRegistryTest, EachNameGetsADeviceOrSaysWhyNot) {
  ThreadPool pool(1);
  auto cpu = CreateDevice("cpu", {.budget_bytes = 4096, .pool = &pool});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->name(), "cpu");
  EXPECT_EQ((*cpu)->budget(), 4096);
  EXPECT_EQ(CreateDevice("cpu", {}).status().code(), absl::StatusCode::kInvalidArgument);  // no pool
  const auto unknown = CreateDevice("tpu", {.pool = &pool});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("cpu, sim, cuda"), std::string::npos) << unknown.status();
  const auto cuda = CreateDevice("cuda", {.budget_bytes = 1 << 20, .pool = &pool});
  if (CudaUsable()) {
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    EXPECT_EQ((*cuda)->name(), "cuda");
  } else {  // not compiled, no device or no driver: the reason, not a crash
    ASSERT_FALSE(cuda.ok());
    EXPECT_NE(cuda.status().message().find("--device cuda"), std::string::npos) << cuda.status();
  }
  const auto sim = CreateDevice("sim", {.budget_bytes = 8192, .pool = &pool});
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_EQ((*sim)->name(), "sim");
  EXPECT_FALSE((*sim)->caps().host_reads_device_memory);
  EXPECT_EQ((*sim)->budget(), 8192);
}

// The ops give the bits of the kernels they wrap, and a row's bits do not depend on the rows
// beside it or the thread count.
TEST(CpuOpsTest, RowsGiveTheReferenceKernelsBitsWhateverTheBatch) {
  constexpr int64_t kRows = 5, kCols = 64, kOut = 48, kHeads = 2, kHd = 32, kHalf = 16;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<float> x(kRows * kCols), w(kOut * kCols), norm(kCols), inv_freq(kHalf);
  for (float& v : x) v = nd(rng);
  for (float& v : w) v = nd(rng);
  for (float& v : norm) v = 1.0f + 0.1f * nd(rng);
  for (int64_t i = 0; i < kHalf; ++i) inv_freq[i] = std::pow(10000.0f, -static_cast<float>(i) / kHalf);
  const kernels::WeightView wv{kernels::DType::kF32, reinterpret_cast<const uint8_t*>(w.data()), kOut, kCols,
                               kCols * 4};
  ThreadPool one(1), two(2);
  CpuOps ops1(one), ops2(two);

  // Linear, both kinds: the batch of 5 on two threads vs each row alone on one.
  for (LinearKind kind : {LinearKind::kF32, LinearKind::kInt8}) {
    std::vector<float> batch(kRows * kOut), alone(kOut), ref(kOut);
    ops2.Linear(wv, kind, x.data(), kRows, kCols, nullptr, batch.data(), kOut);
    for (int64_t r = 0; r < kRows; ++r) {
      ops1.Linear(wv, kind, x.data() + r * kCols, 1, kCols, nullptr, alone.data(), kOut);
      if (kind == LinearKind::kF32) {
        kernels::MatMul(wv, x.data() + r * kCols, 1, kCols, nullptr, ref.data(), kOut, one);
      } else {
        kernels::MatMulInt8(wv, x.data() + r * kCols, 1, kCols, nullptr, ref.data(), kOut, one);
      }
      EXPECT_EQ(0, std::memcmp(alone.data(), &batch[r * kOut], kOut * 4)) << "row " << r;
      EXPECT_EQ(0, std::memcmp(alone.data(), ref.data(), kOut * 4)) << "row " << r;
    }
  }
  // RMSNorm rows, and the selected-rows form on rows 3 and 1.
  std::vector<float> y(kRows * kCols), sel(2 * kCols), ref(kCols);
  ops2.RmsNormRows(x.data(), norm.data(), 1e-6f, kRows, kCols, y.data());
  const int64_t picked[] = {3, 1};
  ops1.RmsNormSelected(x.data(), picked, norm.data(), 1e-6f, kCols, sel.data());
  for (int64_t j = 0; j < 2; ++j) {
    kernels::RmsNorm(x.data() + picked[j] * kCols, norm.data(), 1e-6f, kCols, ref.data());
    EXPECT_EQ(0, std::memcmp(ref.data(), &y[picked[j] * kCols], kCols * 4));
    EXPECT_EQ(0, std::memcmp(ref.data(), &sel[j * kCols], kCols * 4));
  }
  // Angles and per-head norm + rotation, both pairings, against the kernels by hand.
  const int64_t positions[] = {0, 7, 300, 4095, 12};
  std::vector<float> cs(kRows * kHalf), sn(kRows * kHalf);
  ops2.RopeAngles(inv_freq.data(), kHalf, positions, cs.data(), sn.data());
  for (bool neox : {false, true}) {
    std::vector<float> heads = x, want = x;  // kRows rows of kHeads heads of kHd
    ops2.HeadNormRope(heads.data(), kRows, kCols, kHeads, kHd, norm.data(), 1e-6f, cs.data(), sn.data(), kHalf, neox);
    for (int64_t r = 0; r < kRows; ++r) {
      float c[kHalf], s[kHalf];
      kernels::RopeAngles(inv_freq.data(), kHalf, positions[r], c, s);
      for (int64_t h = 0; h < kHeads; ++h) {
        float* p = &want[r * kCols + h * kHd];
        kernels::RmsNorm(p, norm.data(), 1e-6f, kHd, p);
        kernels::ApplyRope(p, kHalf, c, s, neox);
      }
    }
    EXPECT_EQ(0, std::memcmp(heads.data(), want.data(), heads.size() * 4)) << "neox " << neox;
  }
  // Gated activations over rows, the residual add, softcap.
  for (GatedActivation act : {GatedActivation::kGeluTanh, GatedActivation::kSilu}) {
    std::vector<float> out(kRows * kCols), want(kRows * kCols);
    ops2.GatedMul(act, x.data(), y.data(), out.data(), kRows, kCols);
    if (act == GatedActivation::kGeluTanh) {
      kernels::GeluTanhMul(x.data(), y.data(), want.data(), kRows * kCols);
    } else {
      kernels::SiluMul(x.data(), y.data(), want.data(), kRows * kCols);
    }
    EXPECT_EQ(0, std::memcmp(out.data(), want.data(), out.size() * 4));
  }
  std::vector<float> sum = x;
  ops1.Add(sum.data(), y.data(), kRows * kCols);
  EXPECT_EQ(sum[17], x[17] + y[17]);
  // The context head: scoring rows of a weight matrix equals dequantizing then dotting them.
  const int32_t ids[] = {5, 0, 47};
  std::vector<float> scores(3), deq(3 * kCols), dots(3);
  ops2.ScoreRows(wv, ids, x.data(), scores.data());
  ops1.DequantizeRows(wv, ids, deq.data());
  const float* rows[] = {&deq[0], &deq[kCols], &deq[2 * kCols]};
  ops1.DotRows(rows, x.data(), kCols, dots.data());
  EXPECT_EQ(scores, dots);
  EXPECT_EQ(scores[2], kernels::Dot(&w[47 * kCols], x.data(), kCols));
  std::vector<float> capped = {-100.0f, 0.0f, 3.0f};
  ops1.Softcap(capped.data(), 3, 30.0f);
  EXPECT_FLOAT_EQ(capped[0], 30.0f * std::tanh(-100.0f / 30.0f));
  EXPECT_EQ(capped[1], 0.0f);
  // Each row's first largest, as greedy sampling picks it.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> logits = {1, 3, 3, 2, /**/ nan, 5, 1, 0, /**/ 0, -0.0f, 0, 0};
  int32_t best[3] = {-1, -1, -1};
  ops1.ArgmaxRows(logits.data(), 3, 4, best);
  EXPECT_EQ(std::vector<int32_t>(best, best + 3), (std::vector<int32_t>{1, 0, 0}));
}

// Rows attending in one pass (the dual-token step's real and speculative rows over the same
// blocks, the speculative row seeing one more key) get the bits of one row at a time over
// its visible keys, for 3 and 4 query heads per KV head (SmolLM2, Gemma), head dims with and
// without a vector tail, lists of different lengths per KV head, and 1 or 2 threads.
TEST(CpuOpsTest, RowsToListsInOnePassEqualOneRowAtATime) {
  for (auto [n_head, n_kv, hd] : {std::tuple<int64_t, int64_t, int64_t>{9, 3, 64}, {4, 1, 256}, {4, 2, 40}}) {
    for (int threads : {1, 2}) {
      const AttentionShape c{.n_head = n_head, .n_head_kv = n_kv, .head_dim = hd};
      ThreadPool pool(threads);
      CpuOps ops(pool);
      std::mt19937 rng(static_cast<uint32_t>(n_head * 100 + hd + threads));
      std::normal_distribution<float> nd;
      // KV head g holds 300 + 97 g keys (beyond one key tile), the last one the second row's own.
      std::vector<std::vector<float>> kv(n_kv);
      std::vector<std::vector<const void*>> keys(n_kv), values(n_kv);
      std::vector<KeyValueList> all(n_kv), first_row(n_kv);
      for (int64_t g = 0; g < n_kv; ++g) {
        const int64_t n = 300 + 97 * g;
        kv[g].resize(2 * n * hd);
        for (float& x : kv[g]) x = nd(rng);
        for (int64_t j = 0; j < n; ++j) {
          keys[g].push_back(&kv[g][j * hd]);
          values[g].push_back(&kv[g][(n + j) * hd]);
        }
        all[g] = {keys[g].data(), values[g].data(), n};
        first_row[g] = {keys[g].data(), values[g].data(), n - 1};
      }
      const int64_t q_dim = n_head * hd;
      std::vector<float> q(2 * q_dim);
      for (float& x : q) x = nd(rng);
      std::vector<float> one(2 * q_dim, -1.0f), both(2 * q_dim, -2.0f);
      auto attend = [&](absl::Span<const ListQuery> rows, absl::Span<const KeyValueList> lists) {
        const AttentionGroup group{rows, lists};
        ops.AttendGroups({&group, 1}, c, 0.125f);
      };
      const ListQuery first_alone[1] = {{&q[0], &one[0], 0}}, second_alone[1] = {{&q[q_dim], &one[q_dim], 0}};
      attend(first_alone, first_row);
      attend(second_alone, all);
      const ListQuery rows[2] = {{&q[0], &both[0], 1}, {&q[q_dim], &both[q_dim], 0}};
      attend(rows, all);
      ASSERT_EQ(0, std::memcmp(one.data(), both.data(), one.size() * sizeof(float)))
          << "heads " << n_head << "/" << n_kv << " hd " << hd << " threads " << threads;
      // The hidden key matters to the second row only: dropping hidden_tail changes the first.
      const ListQuery sees_all[1] = {{&q[0], &both[0], 0}};
      attend(sees_all, all);
      EXPECT_NE(0, std::memcmp(one.data(), both.data(), q_dim * sizeof(float)));
    }
  }
}

// The batch's groups in one call give each group's bits alone: groups of one and two rows,
// lists of different lengths per group and KV head, 1 and 2 threads.
TEST(CpuOpsTest, GroupsInOneCallEqualEachGroupAlone) {
  const AttentionShape c{.n_head = 9, .n_head_kv = 3, .head_dim = 64};
  const int64_t hd = c.head_dim, n_kv = c.n_head_kv, q_dim = c.n_head * hd;
  constexpr int kGroups = 5;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> kv(kGroups * n_kv);
  std::vector<std::vector<const void*>> keys(kGroups * n_kv), values(kGroups * n_kv);
  std::vector<KeyValueList> lists(kGroups * n_kv);
  for (int64_t p = 0; p < kGroups * n_kv; ++p) {
    const int64_t n = 40 + 61 * p;  // some beyond one key tile
    kv[p].resize(2 * n * hd);
    for (float& x : kv[p]) x = nd(rng);
    for (int64_t j = 0; j < n; ++j) {
      keys[p].push_back(&kv[p][j * hd]);
      values[p].push_back(&kv[p][(n + j) * hd]);
    }
    lists[p] = {keys[p].data(), values[p].data(), n};
  }
  // Group i has 1 + i % 2 rows; the first of two rows hides the last key (a real row beside
  // its speculative row).
  std::vector<float> q(2 * kGroups * q_dim);
  for (float& x : q) x = nd(rng);
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    CpuOps ops(pool);
    std::vector<float> alone(2 * kGroups * q_dim, 7.0f), together(2 * kGroups * q_dim, 7.0f);
    std::vector<std::vector<ListQuery>> rows_alone(kGroups), rows_together(kGroups);
    std::vector<AttentionGroup> groups;
    for (int i = 0; i < kGroups; ++i) {
      const int nr = 1 + i % 2;
      for (int r = 0; r < nr; ++r) {
        const int64_t at = (2 * i + r) * q_dim;
        const int64_t hidden = nr == 2 && r == 0 ? 1 : 0;
        rows_alone[i].push_back({&q[at], &alone[at], hidden});
        rows_together[i].push_back({&q[at], &together[at], hidden});
      }
      const AttentionGroup one{rows_alone[i], absl::MakeConstSpan(lists).subspan(i * n_kv, n_kv)};
      ops.AttendGroups({&one, 1}, c, 0.125f);
      groups.push_back({rows_together[i], absl::MakeConstSpan(lists).subspan(i * n_kv, n_kv)});
    }
    ops.AttendGroups(groups, c, 0.125f);
    EXPECT_EQ(0, std::memcmp(alone.data(), together.data(), alone.size() * sizeof(float))) << threads << " threads";
    EXPECT_NE(together[0], 7.0f);  // written
  }
}

// Top chunks: the best by the max over the rows, ties to the lower chunk id, −0 tying +0;
// the best k first (in order when sorted), then the rest of `take`; checked against a full sort
// on lists with many ties, in several lists per call.
TEST(CpuOpsTest, TopChunksPicksTheBestByMaxScoreWithTiesToTheLowerChunk) {
  ThreadPool pool(1);
  CpuOps ops(pool);
  std::mt19937 rng(7);
  constexpr int64_t kRows = 3;
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{40}, int64_t{300}}) {
    for (auto [k, take, sorted] : {std::tuple{4, 4, true}, std::tuple{4, 16, false}, std::tuple{8, 8, false}}) {
      std::vector<std::vector<float>> scores(2);
      std::vector<std::vector<int64_t>> chunks(2), ids(2, std::vector<int64_t>(take, -1));
      std::vector<ChunkScores> lists;
      for (int l = 0; l < 2; ++l) {
        for (int64_t i = 0; i < n; ++i) chunks[l].push_back(1000 - 3 * i + l);  // not in order
        for (int64_t i = 0; i < kRows * n; ++i) {
          // Few distinct values (many ties), and both zeros.
          const int v = static_cast<int>(rng() % 7) - 3;
          scores[l].push_back(v == 0 ? ((rng() & 1) ? -0.0f : 0.0f) : static_cast<float>(v));
        }
        lists.push_back({scores[l].data(), chunks[l], ids[l].data(), take, sorted});
      }
      ops.TopChunks(lists, kRows, k);
      for (int l = 0; l < 2; ++l) {
        // The reference: (score, chunk) pairs sorted, higher score then lower chunk first.
        std::vector<std::pair<float, int64_t>> ref;
        for (int64_t i = 0; i < n; ++i) {
          float best = -INFINITY;
          for (int64_t h = 0; h < kRows; ++h) best = std::max(best, scores[l][h * n + i]);
          ref.push_back({best + 0.0f, chunks[l][i]});
        }
        std::sort(ref.begin(), ref.end(), [](const auto& a, const auto& b) {
          return a.first != b.first ? a.first > b.first : a.second < b.second;
        });
        const int64_t t = std::min<int64_t>(n, take), kk = std::min<int64_t>(t, k);
        std::vector<int64_t> want_k, got_k, want_rest, got_rest;
        for (int64_t i = 0; i < kk; ++i) want_k.push_back(ref[i].second), got_k.push_back(ids[l][i]);
        for (int64_t i = kk; i < t; ++i) want_rest.push_back(ref[i].second), got_rest.push_back(ids[l][i]);
        if (!sorted) std::sort(got_k.begin(), got_k.end()), std::sort(want_k.begin(), want_k.end());
        std::sort(got_rest.begin(), got_rest.end());
        std::sort(want_rest.begin(), want_rest.end());
        EXPECT_EQ(got_k, want_k) << "n " << n << " k " << k << " list " << l;
        EXPECT_EQ(got_rest, want_rest) << "n " << n << " take " << take << " list " << l;
        for (int64_t i = t; i < take; ++i) EXPECT_EQ(ids[l][i], -1) << "written past min(n, take)";
      }
    }
  }
}

// A chunk's rows may lie anywhere (sinks apart, a ring's wrap): each landmark element is the
// mean of its rows' elements, summed in double in row order and rounded once.
TEST(CpuOpsTest, ChunkMeansAreTheRowsMeanSummedInDouble) {
  ThreadPool pool(1);
  CpuOps ops(pool);
  constexpr int64_t kChunk = 8, kDim = 48, kChunks = 5;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> keys(kChunks * kChunk * kDim);
  for (float& x : keys) x = nd(rng);
  // Rows in scattered places: row i of the list is row (i × 7) mod n of `keys`.
  const int64_t n = kChunks * kChunk;
  std::vector<const float*> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = &keys[(i * 7 % n) * kDim];
  const std::vector<const void*> untyped(rows.begin(), rows.end());
  std::vector<float> out(kChunks * kDim, -1.0f);
  ops.ChunkMeans(untyped.data(), KvDtype::kF32, kChunks, kChunk, kDim, out.data());
  for (int64_t c = 0; c < kChunks; ++c) {
    for (int64_t j = 0; j < kDim; ++j) {
      double sum = 0;
      for (int64_t t = 0; t < kChunk; ++t) sum += rows[c * kChunk + t][j];
      ASSERT_EQ(out[c * kDim + j], static_cast<float>(sum / kChunk)) << "chunk " << c << " element " << j;
    }
  }
}

// Landmarks of an f16 cache: the means of the widened rows, the f32 path's bits on them; and how
// rows enter such a cache (StoreKv): rounded, saturated and counted.
TEST(CpuOpsTest, F16RowsLandmarksAndStoresKeepTheF32PathsBits) {
  constexpr int64_t kChunk = 8, kDim = 40, kChunks = 3, n = kChunk * kChunks;
  ThreadPool pool(1);
  CpuOps ops(pool);
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 50.0f);
  std::vector<float> x(n * kDim);
  for (float& v : x) v = nd(rng);
  x[3] = 1e6f;    // saturates
  x[5] = -7e4f;   // saturates
  x[9] = INFINITY;  // passes through, uncounted
  std::vector<uint16_t> half(x.size());
  ops.StoreKv(x.data(), n * kDim, KvDtype::kF16, half.data());
  EXPECT_EQ(ops.KvOverflows(), 2);
  std::vector<float> wide(x.size());
  for (size_t i = 0; i < x.size(); ++i) wide[i] = kernels::F16ToF32(half[i]);
  EXPECT_EQ(wide[3], 65504.0f);
  EXPECT_EQ(wide[5], -65504.0f);
  EXPECT_TRUE(std::isinf(wide[9]));
  std::vector<float> copy(x.size());
  ops.StoreKv(x.data(), n * kDim, KvDtype::kF32, copy.data());
  EXPECT_EQ(0, std::memcmp(copy.data(), x.data(), x.size() * sizeof(float)));
  EXPECT_EQ(ops.KvOverflows(), 2) << "f32 stores count nothing";
  x[9] = 1.0f;  // finite landmarks below
  half[9] = kernels::F32ToF16(1.0f);
  wide[9] = 1.0f;
  std::vector<const void*> rows16(n), rows32(n);
  for (int64_t i = 0; i < n; ++i) {
    rows16[i] = &half[i * kDim];
    rows32[i] = &wide[i * kDim];
  }
  std::vector<float> got(kChunks * kDim), want(kChunks * kDim);
  ops.ChunkMeans(rows16.data(), KvDtype::kF16, kChunks, kChunk, kDim, got.data());
  ops.ChunkMeans(rows32.data(), KvDtype::kF32, kChunks, kChunk, kDim, want.data());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
}

// The low-rank key ops (LowRankKeys): keys rotated to their positions, projected onto a basis,
// then rebuilt. Keys lying in the basis's span (before rotation) come back up to f32
// rounding, every KV head at its place; keys outside it lose exactly their component off the
// span; f16 output is the f32 output narrowed; a row's bits do not depend on the batch.
class LowRankKeysTest : public ::testing::Test {
 protected:
  static constexpr int64_t kHeads = 2, kDim = 8, kHalf = 3, kChunk = 4, kChunks = 5;
  static constexpr int64_t kD = kHeads * kDim;
  LowRankKeysTest() : dev_(0, pool_) {
    for (int64_t i = 0; i < kHalf; ++i) freq_.push_back(std::pow(100.0f, -static_cast<float>(i) / kHalf));
  }
  // An orthonormal basis of `rank` rows: the first `rank` rows of a rotation (Gram-Schmidt of
  // random rows).
  std::vector<float> Basis(int64_t rank, std::mt19937& rng) {
    std::normal_distribution<double> nd;
    std::vector<double> b(rank * kD);
    for (double& x : b) x = nd(rng);
    for (int64_t j = 0; j < rank; ++j) {
      for (int64_t k = 0; k < j; ++k) {
        double dot = 0;
        for (int64_t e = 0; e < kD; ++e) dot += b[j * kD + e] * b[k * kD + e];
        for (int64_t e = 0; e < kD; ++e) b[j * kD + e] -= dot * b[k * kD + e];
      }
      double n = 0;
      for (int64_t e = 0; e < kD; ++e) n += b[j * kD + e] * b[j * kD + e];
      for (int64_t e = 0; e < kD; ++e) b[j * kD + e] /= std::sqrt(n);
    }
    return std::vector<float>(b.begin(), b.end());
  }
  LowRankKeys Shape(const std::vector<float>& basis, int64_t rank, bool neox) const {
    LowRankKeys f;
    f.basis = basis.data();
    f.rank = rank;
    f.n_head_kv = kHeads;
    f.head_dim = kDim;
    f.inv_freq = freq_.data();
    f.half = kHalf;
    f.neox = neox;
    return f;
  }
  // Key rows (kD floats) at positions 0.. from unrotated keys: each head rotated as the model does.
  std::vector<float> Rotated(const std::vector<float>& plain, bool neox) const {
    std::vector<float> k = plain, cos(kHalf), sin(kHalf);
    for (int64_t p = 0; p < static_cast<int64_t>(plain.size()) / kD; ++p) {
      kernels::RopeAngles(freq_.data(), kHalf, p, cos.data(), sin.data());
      for (int64_t g = 0; g < kHeads; ++g) kernels::ApplyRope(&k[p * kD + g * kDim], kHalf, cos.data(), sin.data(), neox);
    }
    return k;
  }
  ThreadPool pool_{2};
  CpuDevice dev_;
  std::vector<float> freq_;
};

TEST_F(LowRankKeysTest, KeysInTheSpanComeBackAtTheirPlaces) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (bool neox : {false, true}) {
    for (int64_t rank : {kD, int64_t{5}}) {
      SCOPED_TRACE(::testing::Message() << "neox " << neox << ", rank " << rank);
      const std::vector<float> basis = Basis(rank, rng);
      // Unrotated keys in the span: random coefficients over the basis.
      const int64_t n = kChunks * kChunk;
      std::vector<float> plain(n * kD, 0.0f);
      for (int64_t p = 0; p < n; ++p) {
        for (int64_t j = 0; j < rank; ++j) {
          const float a = nd(rng);
          for (int64_t e = 0; e < kD; ++e) plain[p * kD + e] += a * basis[j * kD + e];
        }
      }
      const std::vector<float> keys = Rotated(plain, neox);
      std::vector<const void*> rows(n);
      std::vector<int64_t> pos(n);
      for (int64_t p = 0; p < n; ++p) rows[p] = &keys[p * kD], pos[p] = p;
      std::vector<float> coeffs(n * rank);
      const LowRankKeys f = Shape(basis, rank, neox);
      dev_.ops().ProjectKeys(f, rows.data(), pos, coeffs.data());
      // Rebuild chunks 4, 1 and 3 for heads 1, 0, 1 into blocks' K halves.
      const std::vector<int64_t> chunks = {4, 1, 3};
      const std::vector<int32_t> heads = {1, 0, 1};
      std::vector<float> out(chunks.size() * kChunk * kDim, -1.0f);
      std::vector<const float*> co;
      std::vector<int64_t> first;
      std::vector<void*> dst;
      for (size_t i = 0; i < chunks.size(); ++i) {
        co.push_back(&coeffs[chunks[i] * kChunk * rank]);
        first.push_back(chunks[i] * kChunk);
        dst.push_back(&out[i * kChunk * kDim]);
      }
      dev_.ops().ReconstructKeys(f, co.data(), first, heads, kChunk, dst.data());
      for (size_t i = 0; i < chunks.size(); ++i) {
        for (int64_t t = 0; t < kChunk; ++t) {
          for (int64_t e = 0; e < kDim; ++e) {
            const float want = keys[(chunks[i] * kChunk + t) * kD + heads[i] * kDim + e];
            EXPECT_NEAR(out[(i * kChunk + t) * kDim + e], want, 1e-4f) << "item " << i << " t " << t << " e " << e;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace dd::backend
