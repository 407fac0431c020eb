// Key lists packed as runs (key_segments.h) give back every key and value pointer, in order,
// for the shapes the sparse cache builds (sinks, chunk blocks, the window's rows, a speculative
// row's own key, landmarks) and for lists with no structure at all.
#include "kernels/cuda/key_segments.h"

#include <random>

#include "gtest/gtest.h"

namespace dd::kernels::cuda {
namespace {

void ExpectRoundTrip(const std::vector<const float*>& keys, const std::vector<const float*>& values,
                     int64_t want_runs = -1) {
  std::vector<KeySeg> segs = {{nullptr, nullptr, 0, 0}};  // something before: runs are appended
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t runs = AppendKeySegments(keys.data(), values.empty() ? nullptr : values.data(), n,
                                          static_cast<int64_t>(sizeof(float)), &segs);
  ASSERT_EQ(static_cast<int64_t>(segs.size()), 1 + runs);
  if (want_runs >= 0) {
    EXPECT_EQ(runs, want_runs);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float *k = nullptr, *v = nullptr;
    KeySegAt(segs.data() + 1, runs, i, &k, &v);
    EXPECT_EQ(k, keys[i]) << i;
    EXPECT_EQ(v, values.empty() ? nullptr : values[i]) << i;
  }
}

TEST(KeySegmentsTest, TheSparseCachesListsComeBackKeyByKey) {
  constexpr int64_t hd = 128, n_kv = 8, C = 8;
  std::vector<float> sinks(16 * n_kv * hd), window(73 * n_kv * hd), slots(40 * 2 * C * hd), own(2 * n_kv * hd);
  const int64_t g = 3;  // one KV head's list
  std::vector<const float*> keys, values;
  for (int64_t t = 0; t < 16; ++t) {  // sinks: rows of n_kv heads
    keys.push_back(&sinks[t * n_kv * hd + g * hd]);
    values.push_back(&sinks[t * n_kv * hd + g * hd] + 1);
  }
  for (int64_t slot : {7, 2, 30, 31, 12}) {  // chunk blocks [K | V], 8 keys each, slots in any order
    for (int64_t t = 0; t < C; ++t) {
      keys.push_back(&slots[slot * 2 * C * hd + t * hd]);
      values.push_back(&slots[slot * 2 * C * hd + (C + t) * hd]);
    }
  }
  for (int64_t t = 60; t < 72; ++t) {  // the window's ring, wrapping
    keys.push_back(&window[t * n_kv * hd + g * hd]);
    values.push_back(&window[(t + 1) * n_kv * hd + g * hd]);
  }
  for (int64_t t = 0; t < 20; ++t) {
    keys.push_back(&window[t * n_kv * hd + g * hd]);
    values.push_back(&window[(t + 1) * n_kv * hd + g * hd]);
  }
  keys.push_back(&own[g * hd]);  // the speculative row's own key
  values.push_back(&own[n_kv * hd + g * hd]);
  // Sinks one run, the chunks one each (adjacent slots 30 and 31 too: a block's keys are
  // followed by its values), the ring two, the own key one.
  ExpectRoundTrip(keys, values, 1 + 5 + 2 + 1);
}

TEST(KeySegmentsTest, LandmarksAreOneRunAndKeyOnlyListsWork) {
  std::vector<float> landmarks(500 * 8 * 64);
  std::vector<const float*> marks;
  for (int64_t c = 2; c < 500; ++c) marks.push_back(&landmarks[(c * 8 + 5) * 64]);
  ExpectRoundTrip(marks, {}, 1);
}

TEST(KeySegmentsTest, AnyListAtAllRoundTrips) {
  std::vector<float> pool(8192);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = rng() % 40;
    std::vector<const float*> keys, values;
    for (int64_t i = 0; i < n; ++i) {
      // Runs of random length and stride (negative and zero included), broken at random.
      keys.push_back(&pool[rng() % 2048 + 1024]);
      values.push_back(rng() % 4 == 0 ? keys.back() : &pool[rng() % 4096 + 2048]);
      if (i > 0 && rng() % 2 == 0) {
        const int64_t stride = static_cast<int64_t>(rng() % 5) - 2;
        keys.back() = keys[i - 1] + stride;
        values.back() = values[i - 1] + stride;
      }
    }
    ExpectRoundTrip(keys, values);
    ExpectRoundTrip(keys, {});
  }
  ExpectRoundTrip({}, {}, 0);
}

}  // namespace
}  // namespace dd::kernels::cuda
