// The CUDA device and ops (cuda_device.h) against the CPU backend: every op over both real
// models' shapes and the Llama-3.1-8B shape, within a stated tolerance (the int8 linear layer
// bit for bit: it runs the CPU's RowDot order), batch invariance bitwise, and the device's
// memory, queues and gathers. Without a CUDA device only the refusal test runs; the rest skips,
// saying so.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/cpu/test_weights.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_device.h"
#include "cuda/cuda_entry.h"
#include "dd/backend/cpu_device.h"
#include "dd/kernels/cpu_ops.h"
#include "gtest/gtest.h"

namespace dd::kernels::cuda {
namespace {

using backend::DeviceBuffer;
using backend::MemoryTag;
using backend::Queue;

TEST(CudaDeviceRefusalTest, WithoutADeviceCudaIsRefusedWithTheReason) {
  if (HaveCudaDevice()) GTEST_SKIP() << "a CUDA device answers: the refusal is not exercised here";
  const auto d = CreateCudaDevice(0, false, false);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(d.status().message().find("no usable CUDA device"), std::string::npos) << d.status();
}

// Largest |a - b| / max(1, |b|).
double MaxRelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    e = std::max(e, std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(1.0, std::fabs(static_cast<double>(b[i]))));
  }
  return a.size() == b.size() ? e : INFINITY;
}

// KV values in type t, as bytes (f16: each float rounded, the bits a cache would hold).
std::vector<uint8_t> AsKv(const std::vector<float>& x, KvDtype t) {
  std::vector<uint8_t> out(x.size() * KvDtypeBytes(t));
  if (t == KvDtype::kF32) {
    std::memcpy(out.data(), x.data(), out.size());
  } else {
    F32ToF16Saturating(x.data(), static_cast<int64_t>(x.size()), reinterpret_cast<uint16_t*>(out.data()));
  }
  return out;
}

// The inverse: elements of type t, as floats.
std::vector<float> Widen(const std::vector<uint8_t>& x, KvDtype t) {
  std::vector<float> out(x.size() / KvDtypeBytes(t));
  for (size_t i = 0; i < out.size(); ++i) {
    if (t == KvDtype::kF32) {
      std::memcpy(&out[i], &x[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &x[i * 2], 2);
      out[i] = F16ToF32(h);
    }
  }
  return out;
}

std::vector<float> Normal(int64_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

class GpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: the CUDA backend is not run here";
    auto d = CudaDevice::Create(int64_t{1} << 30, false);
    ASSERT_TRUE(d.ok()) << d.status();
    dev_ = std::move(*d);
  }
  void TearDown() override {
    if (dev_ == nullptr) return;
    EXPECT_TRUE(dev_->Synchronize(dev_->Record(Queue::kCompute)).ok());
    for (DeviceBuffer& b : bufs_) dev_->Free(b);
  }
  template <typename T>
  T* In(const std::vector<T>& v) {
    T* p = Out<T>(static_cast<int64_t>(v.size()));
    EXPECT_TRUE(dev_->CopyToDevice(Queue::kCompute, v.data(), bufs_.back(), 0, bufs_.back().bytes).ok());
    return p;
  }
  template <typename T>
  T* Out(int64_t n) {
    auto b = dev_->Allocate(MemoryTag::kWorkspace, std::max<int64_t>(1, n) * static_cast<int64_t>(sizeof(T)));
    EXPECT_TRUE(b.ok()) << b.status();
    bufs_.push_back(*b);
    return static_cast<T*>(b->data);
  }
  template <typename T>
  std::vector<T> Get(const T* p, int64_t n) {
    EXPECT_TRUE(dev_->Synchronize(dev_->Record(Queue::kCompute)).ok());
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  WeightView Weights(DType t, int64_t rows, int64_t cols, const std::vector<uint8_t>& host) {
    auto b = dev_->Upload(MemoryTag::kWeights, host.data(), static_cast<int64_t>(host.size()));
    EXPECT_TRUE(b.ok()) << b.status();
    bufs_.push_back(*b);
    return {t, static_cast<const uint8_t*>(b->data), rows, cols, *RowBytes(t, cols)};
  }
  static WeightView HostWeights(DType t, int64_t rows, int64_t cols, const std::vector<uint8_t>& host) {
    return {t, host.data(), rows, cols, *RowBytes(t, cols)};
  }

  ThreadPool pool_{2};
  backend::CpuOps cpu_{pool_};
  std::unique_ptr<CudaDevice> dev_;
  std::vector<DeviceBuffer> bufs_;
};

TEST_F(GpuBackendTest, MemoryFollowsTheBudgetByTagAndMergesFreedRanges) {
  auto d = CudaDevice::Create(64 << 20, false);
  ASSERT_TRUE(d.ok()) << d.status();
  auto a = (*d)->Allocate(MemoryTag::kKv, 24 << 20);
  auto b = (*d)->Allocate(MemoryTag::kLandmarks, 24 << 20);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*d)->bytes_in_use(MemoryTag::kKv), 24 << 20);
  EXPECT_EQ((*d)->bytes_in_use(), 48 << 20);
  const auto over = (*d)->Allocate(MemoryTag::kResidentSlots, 24 << 20);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("resident_slots"), std::string::npos) << over.status();
  (*d)->Free(*a);
  (*d)->Free(*b);
  auto all = (*d)->Allocate(MemoryTag::kWeights, 64 << 20);  // only if the two ranges merged back
  ASSERT_TRUE(all.ok()) << all.status();
  (*d)->Free(*all);
  EXPECT_EQ((*d)->bytes_in_use(), 0);
}

TEST_F(GpuBackendTest, AQueueWaitsForAnotherQueuesCopy) {
  const int64_t n = 1 << 22;
  std::vector<float> host = Normal(n, 1), back(n);
  auto src = dev_->Allocate(MemoryTag::kResidentSlots, n * 4);
  auto dst = dev_->Allocate(MemoryTag::kWorkspace, n * 4);
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_TRUE(dev_->CopyToDevice(Queue::kPrefetch, host.data(), *src, 0, n * 4).ok());
  dev_->Wait(Queue::kCompute, dev_->Record(Queue::kPrefetch));
  ASSERT_TRUE(dev_->Copy(Queue::kCompute, *src, 0, *dst, 0, n * 4).ok());
  ASSERT_TRUE(dev_->CopyToHost(Queue::kCompute, *dst, 0, back.data(), n * 4).ok());
  ASSERT_TRUE(dev_->Synchronize(dev_->Record(Queue::kCompute)).ok());
  EXPECT_EQ(host, back);
  EXPECT_EQ(dev_->CopyToHost(Queue::kCompute, *dst, 4, back.data(), n * 4).code(), absl::StatusCode::kInvalidArgument);
  dev_->Free(*src);
  dev_->Free(*dst);
}

TEST_F(GpuBackendTest, GathersBlocksFromARegisteredHostRegion) {
  const int64_t block = 4096, blocks = 64;
  std::vector<uint8_t> pool(block * blocks);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 7 + i / block);
  auto region = dev_->RegisterHostRegion(pool.data(), static_cast<int64_t>(pool.size()));
  ASSERT_TRUE(region.ok()) << region.status();
  std::vector<backend::GatherBlock> list;
  for (int64_t i = 0; i < 16; ++i) list.push_back({((i * 5) % blocks) * block, (15 - i) * block});
  uint8_t* dst = Out<uint8_t>(16 * block);
  ASSERT_TRUE(dev_->Gather(Queue::kUrgent, *region, list, block, bufs_.back()).ok());
  dev_->Wait(Queue::kCompute, dev_->Record(Queue::kUrgent));
  const std::vector<uint8_t> got = Get(dst, 16 * block);
  for (const auto& b : list) {
    ASSERT_EQ(0, std::memcmp(&got[b.dst], &pool[b.src], block)) << "block from " << b.src;
  }
  list.push_back({static_cast<int64_t>(pool.size()), 0});  // past the region
  EXPECT_EQ(dev_->Gather(Queue::kUrgent, *region, list, block, bufs_.back()).code(),
            absl::StatusCode::kInvalidArgument);
  dev_->UnregisterHostRegion(*region);
}

TEST_F(GpuBackendTest, CopyEnginePrefetchesGatherTheSameBytes) {
  auto d = CudaDevice::Create(64 << 20, false, /*copy_engine_prefetch=*/true);
  ASSERT_TRUE(d.ok()) << d.status();
  const int64_t block = 4096, blocks = 64;
  std::vector<uint8_t> pool(block * blocks);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<uint8_t>(i * 5 + i / block);
  auto region = (*d)->RegisterHostRegion(pool.data(), static_cast<int64_t>(pool.size()));
  ASSERT_TRUE(region.ok()) << region.status();
  // Runs adjacent on both sides (merged into one copy), and scattered blocks.
  std::vector<backend::GatherBlock> list;
  for (int64_t i = 0; i < 8; ++i) list.push_back({(20 + i) * block, i * block});
  for (int64_t i = 8; i < 24; ++i) list.push_back({((i * 7) % blocks) * block, (31 - i) * block});
  auto buf = (*d)->Allocate(MemoryTag::kResidentSlots, 32 * block);
  ASSERT_TRUE(buf.ok());
  std::vector<uint8_t> zero(32 * block, 0);
  ASSERT_TRUE((*d)->CopyToDevice(Queue::kCompute, zero.data(), *buf, 0, 32 * block).ok());
  (*d)->Wait(Queue::kPrefetch, (*d)->Record(Queue::kCompute));
  for (Queue q : {Queue::kPrefetch, Queue::kUrgent}) {  // the copy engines, then the kernel
    ASSERT_TRUE((*d)->Gather(q, *region, list, block, *buf).ok());
    std::vector<uint8_t> got(32 * block);
    (*d)->Wait(Queue::kCompute, (*d)->Record(q));
    ASSERT_TRUE((*d)->CopyToHost(Queue::kCompute, *buf, 0, got.data(), 32 * block).ok());
    ASSERT_TRUE((*d)->Synchronize((*d)->Record(Queue::kCompute)).ok());
    for (const auto& b : list) {
      ASSERT_EQ(0, std::memcmp(&got[b.dst], &pool[b.src], block)) << "queue " << static_cast<int>(q) << " block from "
                                                                    << b.src;
    }
    // Blocks 24-31 of the buffer are no gather's destination: a run copied too far shows here.
    EXPECT_TRUE(std::all_of(got.begin() + 24 * block, got.end(), [](uint8_t v) { return v == 0; }));
    if (q == Queue::kPrefetch) {
      EXPECT_EQ((*d)->copy_engine_gathers(), 1) << "the copy engines ran it";
    }
    ASSERT_TRUE((*d)->CopyToDevice(Queue::kCompute, zero.data(), *buf, 0, 32 * block).ok());
    ASSERT_TRUE((*d)->Synchronize((*d)->Record(Queue::kCompute)).ok());
  }
  (*d)->Free(*buf);
  (*d)->UnregisterHostRegion(*region);
}

struct LinearShape {
  int64_t n, k;
};
// Both real models' and Llama-3.1-8B's projections (rows cut to keep the test short).
constexpr LinearShape kLinearShapes[] = {{640, 640}, {256, 2048}, {576, 1536}, {384, 576}, {256, 4096}, {128, 14336}};

TEST_F(GpuBackendTest, Int8LinearIsTheCpusBitsForEveryTypeAndShape) {
  for (DType t : kTypes) {
    for (const LinearShape& s : kLinearShapes) {
      if (s.k % 256 != 0 && (t == DType::kQ4_K || t == DType::kQ5_K || t == DType::kQ6_K)) continue;
      std::mt19937 rng(static_cast<uint32_t>(s.n + s.k + static_cast<int>(t)));
      const std::vector<uint8_t> w = RandomWeights(t, s.n, s.k, rng);
      for (int64_t m : {1, 3, 11}) {
        const std::vector<float> x = Normal(m * s.k, static_cast<uint32_t>(m)), bias = Normal(s.n, 5);
        std::vector<float> want(m * s.n);
        cpu_.Linear(HostWeights(t, s.n, s.k, w), backend::LinearKind::kInt8, x.data(), m, s.k, bias.data(), want.data(),
                    s.n);
        float* y = Out<float>(m * s.n);
        dev_->ops().Linear(Weights(t, s.n, s.k, w), backend::LinearKind::kInt8, In(x), m, s.k, In(bias), y, s.n);
        EXPECT_EQ(Get(y, m * s.n), want) << DTypeName(t) << " " << s.n << "x" << s.k << " rows " << m;
      }
    }
  }
}

TEST_F(GpuBackendTest, LinearRowsAreBatchInvariant) {
  const int64_t n = 512, k = 2048;
  std::mt19937 rng(9);
  for (DType t : {DType::kQ4_K, DType::kQ6_K, DType::kQ8_0}) {
    const WeightView w = Weights(t, n, k, RandomWeights(t, n, k, rng));
    for (backend::LinearKind kind : {backend::LinearKind::kInt8, backend::LinearKind::kF32}) {
      const std::vector<float> row = Normal(k, 3);
      float* alone = Out<float>(n);
      dev_->ops().Linear(w, kind, In(row), 1, k, nullptr, alone, n);
      const std::vector<float> want = Get(alone, n);
      for (int64_t m : {2, 8, 9, 64}) {
        std::vector<float> x = Normal(m * k, static_cast<uint32_t>(m));
        const int64_t slot = m - 1;
        std::copy(row.begin(), row.end(), x.begin() + slot * k);
        float* y = Out<float>(m * n);
        dev_->ops().Linear(w, kind, In(x), m, k, nullptr, y, n);
        const std::vector<float> got = Get(y + slot * n, n);
        EXPECT_EQ(got, want) << DTypeName(t) << " kind " << static_cast<int>(kind) << " batch " << m;
      }
    }
  }
}

TEST_F(GpuBackendTest, F32LinearAndDequantizedRowsMatchTheCpu) {
  const int64_t n = 96, k = 512;
  std::mt19937 rng(4);
  for (DType t : kTypes) {
    const std::vector<uint8_t> w = RandomWeights(t, n, k, rng);
    const std::vector<float> x = Normal(3 * k, 8);
    std::vector<float> want(3 * n);
    cpu_.Linear(HostWeights(t, n, k, w), backend::LinearKind::kF32, x.data(), 3, k, nullptr, want.data(), n);
    const WeightView dw = Weights(t, n, k, w);
    float* y = Out<float>(3 * n);
    dev_->ops().Linear(dw, backend::LinearKind::kF32, In(x), 3, k, nullptr, y, n);
    EXPECT_LT(MaxRelErr(Get(y, 3 * n), want), 1e-4) << DTypeName(t);  // other summation orders
    const std::vector<int32_t> ids = {5, 0, 95, 5};
    std::vector<float> rows(ids.size() * k);
    cpu_.Embed(HostWeights(t, n, k, w), ids, 2.0f, rows.data());
    float* got = Out<float>(static_cast<int64_t>(rows.size()));
    dev_->ops().Embed(dw, ids, 2.0f, got);
    EXPECT_LT(MaxRelErr(Get(got, static_cast<int64_t>(rows.size())), rows), 1e-6) << DTypeName(t);
    std::vector<float> scores(ids.size());
    cpu_.ScoreRows(HostWeights(t, n, k, w), ids, x.data(), scores.data());
    float* s = Out<float>(4);
    dev_->ops().ScoreRows(dw, ids, In(std::vector<float>(x.begin(), x.begin() + k)), s);
    EXPECT_LT(MaxRelErr(Get(s, 4), scores), 1e-4) << DTypeName(t);
  }
}

TEST_F(GpuBackendTest, NormsRopeAndActivationsMatchTheCpu) {
  const int64_t rows = 5, d = 640, heads = 2, hd = 256, half = 128;  // heads × hd within a row
  const std::vector<float> x = Normal(rows * d, 1), w = Normal(d, 2), g = Normal(rows * d, 3);
  std::vector<float> want(rows * d);
  cpu_.RmsNormRows(x.data(), w.data(), 1e-6f, rows, d, want.data());
  float* y = Out<float>(rows * d);
  const float* dx = In(x);
  const float* dw = In(w);
  dev_->ops().RmsNormRows(dx, dw, 1e-6f, rows, d, y);
  EXPECT_LT(MaxRelErr(Get(y, rows * d), want), 1e-6);
  const std::vector<int64_t> pick = {4, 1};
  std::vector<float> sel(2 * d);
  cpu_.RmsNormSelected(x.data(), pick, w.data(), 1e-6f, d, sel.data());
  float* ys = Out<float>(2 * d);
  dev_->ops().RmsNormSelected(dx, pick, dw, 1e-6f, d, ys);
  EXPECT_LT(MaxRelErr(Get(ys, 2 * d), sel), 1e-6);

  std::vector<float> inv(half);
  for (int64_t j = 0; j < half; ++j) inv[j] = static_cast<float>(std::pow(10000.0, -2.0 * j / hd));
  const std::vector<int64_t> pos = {0, 7, 4095, 32767, 131071};
  std::vector<float> cs(rows * half), sn(rows * half);
  cpu_.RopeAngles(inv.data(), half, pos, cs.data(), sn.data());
  float* dc = Out<float>(rows * half);
  float* ds = Out<float>(rows * half);
  dev_->ops().RopeAngles(inv.data(), half, pos, dc, ds);
  EXPECT_LT(MaxRelErr(Get(dc, rows * half), cs), 1e-6);
  EXPECT_LT(MaxRelErr(Get(ds, rows * half), sn), 1e-6);
  const std::vector<float> hw = Normal(hd, 6);
  for (bool neox : {false, true}) {
    for (bool norm : {false, true}) {
      std::vector<float> h = x;
      cpu_.HeadNormRope(h.data(), rows, d, heads, hd, norm ? hw.data() : nullptr, 1e-6f, cs.data(), sn.data(), half, neox);
      float* dh = In(x);
      dev_->ops().HeadNormRope(dh, rows, d, heads, hd, norm ? In(hw) : nullptr, 1e-6f, In(cs), In(sn), half, neox);
      EXPECT_LT(MaxRelErr(Get(dh, rows * d), h), 1e-5) << "neox " << neox << " norm " << norm;
    }
  }
  for (auto act : {backend::GatedActivation::kGeluTanh, backend::GatedActivation::kSilu}) {
    std::vector<float> out(rows * d);
    cpu_.GatedMul(act, g.data(), x.data(), out.data(), rows, d);
    float* o = Out<float>(rows * d);
    dev_->ops().GatedMul(act, In(g), dx, o, rows, d);
    EXPECT_LT(MaxRelErr(Get(o, rows * d), out), 1e-5) << static_cast<int>(act);
  }
  std::vector<float> sum = x, cap = g;
  cpu_.Add(sum.data(), g.data(), rows * d);
  cpu_.Softcap(cap.data(), rows * d, 3.0f);
  float* ds2 = In(x);
  float* dcap = In(g);
  dev_->ops().Add(ds2, In(g), rows * d);
  dev_->ops().Softcap(dcap, rows * d, 3.0f);
  EXPECT_EQ(Get(ds2, rows * d), sum);
  EXPECT_LT(MaxRelErr(Get(dcap, rows * d), cap), 1e-6);
}

struct AttnShape {
  int64_t n_head, n_head_kv, head_dim;
};
constexpr AttnShape kAttnShapes[] = {{4, 1, 256}, {9, 3, 64}, {32, 8, 128}};

TEST_F(GpuBackendTest, CausalAttentionMatchesTheCpu) {
  for (const AttnShape& s : kAttnShapes) {
   for (KvDtype t : {KvDtype::kF32, KvDtype::kF16}) {
    const backend::AttentionShape shape{s.n_head, s.n_head_kv, s.head_dim, t};
    const int64_t kv_dim = s.n_head_kv * s.head_dim, q_dim = s.n_head * s.head_dim, n_keys = 700;
    const int64_t eb = KvDtypeBytes(t);
    const std::vector<uint8_t> k = AsKv(Normal(n_keys * kv_dim, 1), t), v = AsKv(Normal(n_keys * kv_dim, 2), t);
    for (bool sliding : {false, true}) {
      // Every row's first key at or after lo (a window of 64 from lo + 63 on).
      const int64_t lo = sliding ? 40 : 0;
      const std::vector<int64_t> positions = {lo + 63, 300, 301, 699};
      const int64_t rows = static_cast<int64_t>(positions.size());
      const std::vector<float> q = Normal(rows * q_dim, 3);
      // The keys from lo on, in three runs (as a sparse layer's sinks, ring and wrap).
      const int64_t cut1 = 100, cut2 = 400;
      auto runs_at = [&](const uint8_t* kb, const uint8_t* vb) {
        const int64_t row = kv_dim * eb;
        return std::vector<backend::KvRun>{{kb + lo * row, vb + lo * row, cut1 - lo},
                                           {kb + cut1 * row, vb + cut1 * row, cut2 - cut1},
                                           {kb + cut2 * row, vb + cut2 * row, n_keys - cut2}};
      };
      backend::CausalAttention a{shape, 0.125f, sliding, 64, q.data(), nullptr, positions, lo, {}};
      std::vector<float> want(rows * q_dim);
      const auto host_runs = runs_at(k.data(), v.data());
      a.out = want.data();
      a.runs = host_runs;
      cpu_.AttendCausal(a);
      const uint8_t* dk = In(k);
      const uint8_t* dv = In(v);
      const auto dev_runs = runs_at(dk, dv);
      a.q = In(q);
      a.out = Out<float>(rows * q_dim);
      a.runs = dev_runs;
      dev_->ops().AttendCausal(a);
      EXPECT_LT(MaxRelErr(Get(a.out, rows * q_dim), want), 1e-5)
          << s.n_head << "/" << s.n_head_kv << " sliding " << sliding << " " << KvDtypeName(t);
    }
   }
  }
}

TEST_F(GpuBackendTest, ListAttentionMatchesTheCpuAndAGroupsBitsDoNotDependOnTheOthers) {
  for (const AttnShape& s : kAttnShapes) {
   for (KvDtype t : {KvDtype::kF32, KvDtype::kF16}) {
    const backend::AttentionShape shape{s.n_head, s.n_head_kv, s.head_dim, t};
    const int64_t hd = s.head_dim, q_dim = s.n_head * hd, n_keys = 300, row = hd * KvDtypeBytes(t);
    const std::vector<uint8_t> keys = AsKv(Normal(n_keys * hd, 1), t), vals = AsKv(Normal(n_keys * hd, 2), t);
    const uint8_t* dk = In(keys);
    const uint8_t* dvv = In(vals);
    // Group i: two rows (real, speculative with the last key hidden from the real one) over
    // lists of 20 + 37 i keys per KV head, picked with a stride.
    const int n_groups = 5;
    std::vector<std::vector<const void*>> hk(n_groups * s.n_head_kv), hv(hk.size()), dkp(hk.size()), dvp(hk.size());
    const std::vector<float> q = Normal(n_groups * 2 * q_dim, 3);
    const float* dq = In(q);
    float* dout = Out<float>(n_groups * 2 * q_dim);
    float* alone = Out<float>(2 * q_dim);
    std::vector<float> want(n_groups * 2 * q_dim);
    std::vector<std::vector<backend::KeyValueList>> hl(n_groups), dl(n_groups);
    std::vector<std::vector<backend::ListQuery>> hr(n_groups), dr(n_groups);
    for (int i = 0; i < n_groups; ++i) {
      for (int64_t g = 0; g < s.n_head_kv; ++g) {
        const size_t li = i * s.n_head_kv + g;
        for (int64_t j = 0; j < 20 + 37 * i; ++j) {
          const int64_t key = (j * 7 + g + i) % n_keys;
          hk[li].push_back(&keys[key * row]);
          hv[li].push_back(&vals[key * row]);
          dkp[li].push_back(dk + key * row);
          dvp[li].push_back(dvv + key * row);
        }
        const int64_t n = static_cast<int64_t>(hk[li].size());
        hl[i].push_back({hk[li].data(), hv[li].data(), n});
        dl[i].push_back({dkp[li].data(), dvp[li].data(), n});
      }
      for (int r = 0; r < 2; ++r) {
        const int64_t at = (2 * i + r) * q_dim;
        hr[i].push_back({&q[at], &want[at], r == 0 ? 1 : 0});
        dr[i].push_back({dq + at, dout + at, r == 0 ? 1 : 0});
      }
    }
    std::vector<backend::AttentionGroup> hg, dg;
    for (int i = 0; i < n_groups; ++i) {
      hg.push_back({hr[i], hl[i]});
      dg.push_back({dr[i], dl[i]});
    }
    cpu_.AttendGroups(hg, shape, 0.1f);
    dev_->ops().AttendGroups(dg, shape, 0.1f);
    const std::vector<float> got = Get(dout, n_groups * 2 * q_dim);
    EXPECT_LT(MaxRelErr(got, want), 1e-5) << s.n_head << "/" << s.n_head_kv;
    // Group 3 alone: its rows' bits as in the batch.
    const std::vector<backend::ListQuery> solo = {{dq + 6 * q_dim, alone, 1}, {dq + 7 * q_dim, alone + q_dim, 0}};
    const std::vector<backend::AttentionGroup> one = {{solo, dl[3]}};
    dev_->ops().AttendGroups(one, shape, 0.1f);
    EXPECT_EQ(Get(alone, 2 * q_dim), std::vector<float>(got.begin() + 6 * q_dim, got.begin() + 8 * q_dim));
   }
  }
}

// Landmarks where the keys are: the CPU's bits (double sums in row order), rows scattered.
TEST_F(GpuBackendTest, ChunkMeansGiveTheCpusBits) {
  const int64_t chunk = 8, dim = 256, chunks = 700, n = chunk * chunks;
  const std::vector<float> keys = Normal(n * dim, 5);
  const float* dkeys = In(keys);
  const std::vector<uint8_t> keys16 = AsKv(keys, KvDtype::kF16);
  const uint8_t* dkeys16 = In(keys16);
  std::vector<const void*> hrows(n), drows(n), hrows16(n), drows16(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = (i * 7919) % n;
    hrows[i] = &keys[at * dim];
    drows[i] = dkeys + at * dim;
    hrows16[i] = &keys16[at * dim * 2];
    drows16[i] = dkeys16 + at * dim * 2;
  }
  for (KvDtype t : {KvDtype::kF32, KvDtype::kF16}) {
    const bool f16 = t == KvDtype::kF16;
    std::vector<float> want(chunks * dim);
    cpu_.ChunkMeans(f16 ? hrows16.data() : hrows.data(), t, chunks, chunk, dim, want.data());
    float* out = Out<float>(chunks * dim);
    dev_->ops().ChunkMeans(f16 ? drows16.data() : drows.data(), t, chunks, chunk, dim, out);
    const std::vector<float> got = Get(out, chunks * dim);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << KvDtypeName(t);
  }
}

TEST_F(GpuBackendTest, KeyScoresDotRowsAndTopChunksMatchTheCpu) {
  const int64_t hd = 128, nq = 4, nk = 3000;
  const std::vector<float> q = Normal(nq * hd, 1), keys = Normal(nk * hd, 2);
  const float* dkeys = In(keys);
  std::vector<const float*> hk(nk), dk(nk);
  for (int64_t j = 0; j < nk; ++j) {
    hk[j] = &keys[j * hd];
    dk[j] = dkeys + j * hd;
  }
  std::vector<float> want(nq * nk);
  cpu_.KeyScores(q.data(), nq, hd, hk.data(), nk, want.data(), nk);
  float* s = Out<float>(nq * nk);
  dev_->ops().KeyScores(In(q), nq, hd, dk.data(), nk, s, nk);
  const std::vector<float> got = Get(s, nq * nk);
  EXPECT_LT(MaxRelErr(got, want), 1e-5);  // one run of keys
  {
    // Keys in scattered order (a speculative shortlist): sent as pointers, not runs.
    std::vector<const float*> hs(nk), ds(nk);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t at = (j * 1237) % nk;
      hs[j] = hk[at];
      ds[j] = dk[at];
    }
    std::vector<float> want_s(nq * nk);
    cpu_.KeyScores(q.data(), nq, hd, hs.data(), nk, want_s.data(), nk);
    float* ss = Out<float>(nq * nk);
    dev_->ops().KeyScores(In(q), nq, hd, ds.data(), nk, ss, nk);
    EXPECT_LT(MaxRelErr(Get(ss, nq * nk), want_s), 1e-5);
  }
  std::vector<float> dots(nk);
  cpu_.DotRows(hk, q.data(), hd, dots.data());
  float* dd = Out<float>(nk);
  dev_->ops().DotRows(dk, In(std::vector<float>(q.begin(), q.begin() + hd)), hd, dd);
  EXPECT_LT(MaxRelErr(Get(dd, nk), dots), 1e-5);

  // Top chunks over the CPU's scores (so both rank the same floats), all made negative, then:
  // -0 (chunk 1020) and +0 (chunk 1021) best, tied (the lower id first); chunks 1010 and 1011
  // next, tied at -1 in one row.
  std::vector<float> scores = want;
  for (float& x : scores) x -= 1000.0f;
  for (int64_t h = 0; h < nq; ++h) {
    scores[h * nk + 20] = -0.0f;
    scores[h * nk + 21] = 0.0f;
  }
  scores[10] = scores[11] = -1.0f;
  std::vector<int64_t> chunks(nk);
  for (int64_t j = 0; j < nk; ++j) chunks[j] = 1000 + j;
  const float* dscores = In(scores);
  for (int64_t take : {1, 64, 300, 3000, 4000}) {
    for (bool sorted : {false, true}) {
      const int64_t k = std::min<int64_t>(take, 64), n_out = std::min(take, nk);
      std::vector<int64_t> cpu_ids(n_out);
      const backend::ChunkScores hl{scores.data(), chunks, cpu_ids.data(), take, sorted};
      cpu_.TopChunks({&hl, 1}, nq, k);
      int64_t* ids = Out<int64_t>(n_out);
      const backend::ChunkScores dl{dscores, chunks, ids, take, sorted};
      dev_->ops().TopChunks({&dl, 1}, nq, k);
      std::vector<int64_t> gpu_ids = Get(ids, n_out);
      if (sorted) {
        EXPECT_TRUE(std::equal(cpu_ids.begin(), cpu_ids.begin() + k, gpu_ids.begin())) << "take " << take;
        EXPECT_EQ(gpu_ids[0], 1020) << "-0 and +0 tie: the lower chunk first";
        if (k >= 4) {
          EXPECT_EQ(std::vector<int64_t>(gpu_ids.begin() + 1, gpu_ids.begin() + 4),
                    (std::vector<int64_t>{1021, 1010, 1011}));
        }
      }
      std::sort(cpu_ids.begin(), cpu_ids.begin() + k);
      std::vector<int64_t> best(gpu_ids.begin(), gpu_ids.begin() + k);
      std::sort(best.begin(), best.end());
      EXPECT_TRUE(std::equal(cpu_ids.begin(), cpu_ids.begin() + k, best.begin())) << "best k, take " << take;
      std::sort(cpu_ids.begin(), cpu_ids.end());
      std::sort(gpu_ids.begin(), gpu_ids.end());
      EXPECT_EQ(gpu_ids, cpu_ids) << "take " << take;
    }
  }
}

TEST_F(GpuBackendTest, ArgmaxRowsIsTheCpusFirstLargest) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> pick(0, 9);
  for (const int64_t n : {1, 7, 256, 1000, 131072, 262144}) {
    const int64_t rows = 6;
    std::vector<float> x(rows * n);
    for (float& v : x) {  // few distinct values: ties, NaN, ±inf, ±0
      const int k = pick(rng);
      v = k == 0 ? nan : k == 1 ? -inf : k == 2 ? -0.0f : k == 3 ? 0.0f : static_cast<float>(k % 3);
    }
    x[1 * n] = nan;                                              // row 1: NaN first gives 0
    std::fill(x.begin() + 2 * n, x.begin() + 3 * n, -inf);       // row 2: all -inf gives 0
    std::fill(x.begin() + 3 * n, x.begin() + 4 * n, nan);        // row 3: all NaN gives 0
    x[5 * n + n - 1] = inf;                                      // row 5: the last element wins
    int32_t* out = Out<int32_t>(rows);
    dev_->ops().ArgmaxRows(In(x), rows, n, out);
    const std::vector<int32_t> got = Get(out, rows);
    for (int64_t r = 0; r < rows; ++r) {
      EXPECT_EQ(got[r], ArgmaxFirst(x.data() + r * n, n)) << "n " << n << " row " << r;
    }
  }
}

// The low-rank key ops: the CPU's results within f32 rounding (the CUDA sums fuse their
// multiply-adds), for f32 and f16 keys, rows and items in scattered order.
TEST_F(GpuBackendTest, LowRankKeyOpsMatchTheCpu) {
  const int64_t heads = 8, dim = 128, d = heads * dim, rank = 160, chunk = 8, n = 64 * chunk, half = 64;
  const std::vector<float> basis = Normal(rank * d, 11), keys = Normal(n * d, 12);
  std::vector<float> freq(half);
  for (int64_t i = 0; i < half; ++i) freq[i] = std::pow(500000.0f, -static_cast<float>(i) / half);
  const float* dbasis = In(basis);
  for (KvDtype t : {KvDtype::kF32, KvDtype::kF16}) {
    const std::vector<uint8_t> kv = AsKv(keys, t);
    const uint8_t* dkv = In(kv);
    const int64_t eb = KvDtypeBytes(t);
    std::vector<const void*> hrows(n), drows(n);
    std::vector<int64_t> pos(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = (i * 7919) % n;
      hrows[i] = &kv[at * d * eb];
      drows[i] = dkv + at * d * eb;
      pos[i] = 30000 + i;
    }
    backend::LowRankKeys f{.basis = basis.data(), .rank = rank, .n_head_kv = heads, .head_dim = dim,
                           .inv_freq = freq.data(), .half = half, .neox = true, .kv = t};
    std::vector<float> want(n * rank);
    cpu_.ProjectKeys(f, hrows.data(), pos, want.data());
    backend::LowRankKeys g = f;
    g.basis = dbasis;
    float* dcoeffs = Out<float>(n * rank);
    dev_->ops().ProjectKeys(g, drows.data(), pos, dcoeffs);
    const std::vector<float> got = Get(dcoeffs, n * rank);
    EXPECT_LT(MaxRelErr(got, want), 1e-4) << KvDtypeName(t);
    // Rebuild 40 items (chunk, head) from the CPU's coefficients on both.
    const float* dwant = In(want);
    std::vector<const float*> hc, dc;
    std::vector<int64_t> first;
    std::vector<int32_t> hs;
    for (int64_t i = 0; i < 40; ++i) {
      const int64_t c = (i * 13) % (n / chunk);
      hc.push_back(&want[c * chunk * rank]);
      dc.push_back(dwant + c * chunk * rank);
      first.push_back(30000 + c * chunk);
      hs.push_back(static_cast<int32_t>(i % heads));
    }
    std::vector<uint8_t> host_out(40 * chunk * dim * eb);
    uint8_t* dout = Out<uint8_t>(40 * chunk * dim * eb);
    std::vector<void*> ho, dout_ptrs;
    for (int64_t i = 0; i < 40; ++i) {
      ho.push_back(&host_out[i * chunk * dim * eb]);
      dout_ptrs.push_back(dout + i * chunk * dim * eb);
    }
    cpu_.ReconstructKeys(f, hc.data(), first, hs, chunk, ho.data());
    dev_->ops().ReconstructKeys(g, dc.data(), first, hs, chunk, dout_ptrs.data());
    const std::vector<uint8_t> back = Get(dout, 40 * chunk * dim * eb);
    EXPECT_LT(MaxRelErr(Widen(back, t), Widen(host_out, t)), t == KvDtype::kF16 ? 2e-3 : 1e-4) << KvDtypeName(t);
  }
}

}  // namespace
}  // namespace dd::kernels::cuda
