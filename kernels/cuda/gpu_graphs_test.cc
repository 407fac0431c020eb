// Static segments as CUDA graphs (cuda_graphs.h) against the same ops launched one by one on a
// device without graphs: the same bits at every step, a graph replayed only for equal
// arguments, and a segment's work in order with the thread's other calls. Skips without a CUDA
// device, saying so.
#include <memory>
#include <random>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/cuda_device.h"
#include "gtest/gtest.h"
#include "kernels/cpu/test_weights.h"

namespace dd::kernels::cuda {
namespace {

using backend::DeviceBuffer;
using backend::MemoryTag;
using backend::Queue;

constexpr int64_t kD = 512, kMaxRows = 8;

// One device and a two-matrix "layer" on it: x += W2 · act(W1 · norm(x)).
struct Layer {
  std::unique_ptr<CudaDevice> dev;
  DeviceBuffer x, xn, h, w1, w2, norm;
  WeightView v1, v2;

  void Init(bool graphs, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::vector<float>& g) {
    auto d = CudaDevice::Create(int64_t{256} << 20, graphs);
    ASSERT_TRUE(d.ok()) << d.status();
    dev = std::move(*d);
    for (DeviceBuffer* buf : {&x, &xn, &h}) {
      auto r = dev->Allocate(MemoryTag::kWorkspace, kMaxRows * kD * 4);
      ASSERT_TRUE(r.ok()) << r.status();
      *buf = *r;
    }
    auto u1 = dev->Upload(MemoryTag::kWeights, a.data(), static_cast<int64_t>(a.size()));
    auto u2 = dev->Upload(MemoryTag::kWeights, b.data(), static_cast<int64_t>(b.size()));
    auto un = dev->Upload(MemoryTag::kWeights, g.data(), static_cast<int64_t>(g.size() * 4));
    ASSERT_TRUE(u1.ok() && u2.ok() && un.ok());
    w1 = *u1, w2 = *u2, norm = *un;
    v1 = {DType::kQ4_K, static_cast<const uint8_t*>(w1.data), kD, kD, *RowBytes(DType::kQ4_K, kD)};
    v2 = {DType::kQ4_K, static_cast<const uint8_t*>(w2.data), kD, kD, *RowBytes(DType::kQ4_K, kD)};
  }
  ~Layer() {
    if (dev == nullptr) return;
    (void)dev->Synchronize(dev->Record(Queue::kCompute));
    for (DeviceBuffer* b : {&x, &xn, &h, &w1, &w2, &norm}) dev->Free(*b);
  }
  float* F(const DeviceBuffer& b) { return static_cast<float*>(b.data); }

  // One step of `rows` rows from `input`: two segments (keys 0 and 1), the result read back.
  std::vector<float> Step(const std::vector<float>& input, int64_t rows) {
    backend::Ops& ops = dev->ops();
    EXPECT_TRUE(dev->CopyToDevice(Queue::kCompute, input.data(), x, 0, rows * kD * 4).ok());
    for (int64_t key : {0, 1}) {
      ops.BeginSegment(key);
      ops.RmsNormRows(F(x), F(norm), 1e-6f, rows, kD, F(xn));
      ops.Linear(v1, backend::LinearKind::kInt8, F(xn), rows, kD, nullptr, F(h), kD);
      ops.GatedMul(backend::GatedActivation::kSilu, F(h), F(h), F(h), rows, kD);
      ops.Linear(v2, backend::LinearKind::kInt8, F(h), rows, kD, nullptr, F(xn), kD);
      ops.Add(F(x), F(xn), rows * kD);
      ops.EndSegment();
    }
    std::vector<float> out(rows * kD);
    EXPECT_TRUE(dev->CopyToHost(Queue::kCompute, x, 0, out.data(), rows * kD * 4).ok());
    EXPECT_TRUE(dev->Synchronize(dev->Record(Queue::kCompute)).ok());
    return out;
  }
};

class GpuGraphsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: CUDA graphs are not run here";
    std::mt19937 rng(3);
    const std::vector<uint8_t> a = RandomWeights(DType::kQ4_K, kD, kD, rng), b = RandomWeights(DType::kQ4_K, kD, kD, rng);
    std::vector<float> g(kD);
    for (float& v : g) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
    ASSERT_NO_FATAL_FAILURE(eager_.Init(false, a, b, g));
    ASSERT_NO_FATAL_FAILURE(graphs_.Init(true, a, b, g));
  }
  static std::vector<float> Input(int64_t rows, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::vector<float> v(rows * kD);
    for (float& f : v) f = nd(rng);
    return v;
  }
  Layer eager_, graphs_;
};

TEST_F(GpuGraphsTest, StepsReplayedAsGraphsGiveTheBitsOfOpsLaunchedOneByOne) {
  const int64_t batches[] = {4, 4, 2, 4, 8, 2};
  uint32_t seed = 1;
  for (int64_t rows : batches) {
    const std::vector<float> in = Input(rows, seed++);
    EXPECT_EQ(graphs_.Step(in, rows), eager_.Step(in, rows)) << "batch " << rows;
  }
  // Per key: records are launched one by one when first seen and captured when seen again, so
  // graphs for batches 4 (its second step) and 2 (its second), the third 4 replayed, 8 seen
  // once. Inputs differ every step: replays read device memory, never recorded values.
  EXPECT_EQ(graphs_.dev->segments().graphs_made(), 2 * 2);
  EXPECT_EQ(graphs_.dev->segments().replays(), 2 * 1);
  EXPECT_EQ(eager_.dev->segments().graphs_made(), 0);
  // More batch sizes than a key keeps (SegmentGraphs::kPerKey): graphs dropped, possibly still
  // running, and made again; the bits never change.
  for (int round = 0; round < 3; ++round) {
    for (int64_t rows = 1; rows <= kMaxRows; ++rows) {
      const std::vector<float> in = Input(rows, seed++);
      EXPECT_EQ(graphs_.Step(in, rows), eager_.Step(in, rows)) << "round " << round << " batch " << rows;
    }
  }
  EXPECT_GT(graphs_.dev->segments().replays(), 2 * 1);
}

TEST_F(GpuGraphsTest, AnotherCallInsideASegmentSeesTheSegmentsWorkBeforeIt) {
  const int64_t rows = 3;
  for (uint32_t seed : {7, 8, 9}) {  // the third a replay
    std::vector<float> want(rows * kD), got(rows * kD);
    for (Layer* l : {&eager_, &graphs_}) {
      const std::vector<float> in = Input(rows, seed);
      ASSERT_TRUE(l->dev->CopyToDevice(Queue::kCompute, in.data(), l->x, 0, rows * kD * 4).ok());
      l->dev->ops().BeginSegment(5);
      l->dev->ops().RmsNormRows(l->F(l->x), l->F(l->norm), 1e-6f, rows, kD, l->F(l->xn));
      std::vector<float>& out = l == &eager_ ? want : got;
      ASSERT_TRUE(l->dev->CopyToHost(Queue::kCompute, l->xn, 0, out.data(), rows * kD * 4).ok());
      l->dev->ops().Add(l->F(l->x), l->F(l->xn), rows * kD);  // after the copy: not in what it read
      l->dev->ops().EndSegment();
      ASSERT_TRUE(l->dev->Synchronize(l->dev->Record(Queue::kCompute)).ok());
    }
    EXPECT_EQ(got, want) << "seed " << seed;
  }
  EXPECT_EQ(graphs_.dev->segments().graphs_made(), 1) << "the norm alone, ended by the copy";
  EXPECT_EQ(graphs_.dev->segments().replays(), 1);
}

}  // namespace
}  // namespace dd::kernels::cuda
