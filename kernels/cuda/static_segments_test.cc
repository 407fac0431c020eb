// Static segments' records and executables, matched and dropped on the host (no device needed).
#include "kernels/cuda/static_segments.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace dd::kernels::cuda {
namespace {

std::vector<StaticCall> Layer(int64_t rows, const void* x) {
  StaticCall norm = MakeStaticCall(StaticOp::kRmsNorm);
  norm.p[0] = x, norm.p[2] = x;
  norm.n[0] = rows, norm.n[1] = 640;
  norm.f[0] = 1e-6f;
  StaticCall add = MakeStaticCall(StaticOp::kAdd);
  add.p[0] = x;
  add.n[0] = rows * 640;
  return {norm, add};
}

TEST(StaticSegmentsTest, AnExecutableIsFoundOnlyForEqualRecordsUnderItsKey) {
  SegmentCache<int> cache(4);
  float buf[2] = {};
  const std::vector<StaticCall> calls = Layer(8, buf);
  std::vector<int> dropped;
  EXPECT_EQ(cache.Find(0, calls), nullptr);
  cache.Insert(0, calls, 7, &dropped);
  ASSERT_NE(cache.Find(0, calls), nullptr);
  EXPECT_EQ(*cache.Find(0, calls), 7);
  EXPECT_EQ(cache.Find(1, calls), nullptr) << "another key";
  EXPECT_EQ(cache.Find(0, Layer(9, buf)), nullptr) << "another batch size";
  EXPECT_EQ(cache.Find(0, Layer(8, buf + 1)), nullptr) << "another buffer";
  std::vector<StaticCall> shorter = calls;
  shorter.pop_back();
  EXPECT_EQ(cache.Find(0, shorter), nullptr) << "a prefix of the records";
  std::vector<StaticCall> longer = calls;
  longer.push_back(calls.back());
  EXPECT_EQ(cache.Find(0, longer), nullptr) << "more records";
  std::vector<StaticCall> eps = calls;
  eps[0].f[0] = 1e-5f;
  EXPECT_EQ(cache.Find(0, eps), nullptr) << "another float argument";
  std::vector<StaticCall> op = calls;
  op[1].op = StaticOp::kSoftcap;
  EXPECT_EQ(cache.Find(0, op), nullptr) << "another op";
  EXPECT_TRUE(dropped.empty());
  EXPECT_EQ(cache.made(), 1);
  EXPECT_EQ(cache.hits(), 2);
}

TEST(StaticSegmentsTest, EachKeyKeepsItsMostRecentlyUsedExecutables) {
  SegmentCache<int> cache(2);
  float buf[1] = {};
  std::vector<int> dropped;
  cache.Insert(5, Layer(1, buf), 1, &dropped);
  cache.Insert(5, Layer(2, buf), 2, &dropped);
  cache.Insert(6, Layer(3, buf), 3, &dropped);  // another key does not push key 5's out
  EXPECT_TRUE(dropped.empty());
  ASSERT_NE(cache.Find(5, Layer(1, buf)), nullptr);  // batch 1 now the most recent of key 5
  cache.Insert(5, Layer(4, buf), 4, &dropped);
  EXPECT_EQ(dropped, std::vector<int>({2})) << "the least recently used of key 5 is handed back";
  EXPECT_NE(cache.Find(5, Layer(1, buf)), nullptr);
  EXPECT_NE(cache.Find(5, Layer(4, buf)), nullptr);
  EXPECT_EQ(cache.Find(5, Layer(2, buf)), nullptr);
  EXPECT_NE(cache.Find(6, Layer(3, buf)), nullptr);
  EXPECT_EQ(cache.size(), 3);
  std::vector<int> all = cache.Clear();
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, std::vector<int>({1, 3, 4}));
  EXPECT_EQ(cache.size(), 0);
}

TEST(StaticSegmentsTest, RecordsCompareByEveryField) {
  StaticCall a = MakeStaticCall(StaticOp::kHeadNormRope);
  StaticCall b = MakeStaticCall(StaticOp::kHeadNormRope);
  EXPECT_TRUE(a == b);
  for (int i = 0; i < 6; ++i) {
    b = a;
    b.p[i] = &a;
    EXPECT_FALSE(a == b) << "pointer " << i;
  }
  for (int i = 0; i < 8; ++i) {
    b = a;
    b.n[i] = 1;
    EXPECT_FALSE(a == b) << "integer " << i;
  }
  for (int i = 0; i < 2; ++i) {
    b = a;
    b.f[i] = 0.5f;
    EXPECT_FALSE(a == b) << "float " << i;
  }
}

}  // namespace
}  // namespace dd::kernels::cuda
