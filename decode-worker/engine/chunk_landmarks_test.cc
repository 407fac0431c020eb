#include "decode-worker/engine/chunk_landmarks.h"

#include <vector>

#include "gtest/gtest.h"

namespace dd::engine {
namespace {

std::vector<float> ChunkOf(int64_t c, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(c * 1000 + i);
  return v;
}

// What a reader took before later chunks came (Select keeps pointers into it) stays valid and
// unchanged: the storage never moves, across segment boundaries too.
TEST(ChunkLandmarksTest, EarlierChunksNeverMove) {
  constexpr int64_t kN = 3 * 64;  // SmolLM2: 3 KV heads x 64
  const int64_t per_segment = ChunkLandmarks::kSegmentFloats / kN;  // at least the chunks of one segment
  ChunkLandmarks l;
  std::vector<const float*> first;
  for (int64_t c = 0; c < 3 * per_segment + 5; ++c) {
    l.Append(ChunkOf(c, kN).data(), kN);
    first.push_back(l.At(c, 0));
  }
  EXPECT_EQ(l.chunks(), 3 * per_segment + 5);
  EXPECT_EQ(l.floats(), l.chunks() * kN);
  for (int64_t c = 0; c < l.chunks(); ++c) {
    ASSERT_EQ(l.At(c, 0), first[c]) << c;
    EXPECT_EQ(*l.At(c, 0), static_cast<float>(c * 1000)) << c;
    EXPECT_EQ(*l.At(c, 64), static_cast<float>(c * 1000 + 64)) << c;  // head 1
  }
}

// A copy (a forked sequence) is independent and keeps growing without touching the original.
TEST(ChunkLandmarksTest, ACopyGrowsOnItsOwn) {
  constexpr int64_t kN = 8;
  ChunkLandmarks a;
  for (int64_t c = 0; c < 10; ++c) a.Append(ChunkOf(c, kN).data(), kN);
  ChunkLandmarks b = a;
  b.Append(ChunkOf(10, kN).data(), kN);
  EXPECT_EQ(a.chunks(), 10);
  EXPECT_EQ(b.chunks(), 11);
  EXPECT_EQ(*b.At(10, 3), 10003.0f);
  EXPECT_NE(a.At(9, 0), b.At(9, 0));
  EXPECT_EQ(*b.At(9, 7), *a.At(9, 7));
}

// A chunk larger than a segment gets a segment of its own.
TEST(ChunkLandmarksTest, ChunksLargerThanASegment) {
  const int64_t n = ChunkLandmarks::kSegmentFloats + 1;
  ChunkLandmarks l;
  l.Append(ChunkOf(1, n).data(), n);
  l.Append(ChunkOf(2, n).data(), n);
  EXPECT_EQ(*l.At(1, n - 1), static_cast<float>(2000 + n - 1));
}

}  // namespace
}  // namespace dd::engine
