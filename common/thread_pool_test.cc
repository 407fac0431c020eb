#include "common/thread_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace dd {
namespace {

TEST(ThreadPoolTest, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    for (int64_t n : {1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(n);
      pool.ParallelFor(n, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
    }
  }
}

TEST(ThreadPoolTest, ReusableManyTimes) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 200; ++round) {
    pool.ParallelFor(10, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) sum += i;
    });
  }
  EXPECT_EQ(sum.load(), 200 * 45);
}

// SetActive(n) splits every job into n ranges (n = 1: all on the calling thread), still
// covering each index once, and can grow back to the whole pool.
TEST(ThreadPoolTest, SetActiveLimitsTheRangesAndThreads) {
  ThreadPool pool(3);
  for (int active : {1, 2, 3, 0, 1, 3}) {
    pool.SetActive(active);
    const int expected = active == 0 ? 3 : active;
    EXPECT_EQ(pool.active(), expected);
    for (int round = 0; round < 50; ++round) {
      std::mutex mu;
      int ranges = 0;
      std::set<std::thread::id> threads;
      std::vector<std::atomic<int>> hits(100);
      pool.ParallelFor(100, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        std::lock_guard<std::mutex> lock(mu);
        ++ranges;
        threads.insert(std::this_thread::get_id());
      });
      for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(hits[i].load(), 1) << "active=" << active << " i=" << i;
      ASSERT_EQ(ranges, expected) << "active=" << active;
      ASSERT_LE(static_cast<int>(threads.size()), expected) << "active=" << active;
      if (expected == 1) {
        ASSERT_EQ(*threads.begin(), std::this_thread::get_id());
      }
    }
  }
}

}  // namespace
}  // namespace dd
