// A fixed pool of worker threads for data-parallel kernels.
//
// ParallelFor splits [0, n) into contiguous ranges, one per thread, and blocks until all are
// done. The split depends only on n and the thread count, never on timing, and kernels split
// over *output* elements only, so every result is independent of the thread count
// (batch invariance, docs/decisions/0001-batch-invariant-cpu-kernels.md). Which thread runs which
// range is decided at run time: the caller and the workers claim ranges from a counter, so when a
// worker is not scheduled (a busy machine) the caller runs its range instead of waiting for it. One
// ParallelFor at a time per pool: callers serialize (the engine's compute stream owns the pool).
//
// Dispatch is cheap enough for per-layer decode work: idle workers spin for a short while
// (~50 µs) on the job counter before sleeping on a condition variable, and the caller spins
// on the completion counter, so back-to-back ParallelFor calls cost microseconds, not a
// futex wake-up each.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dd {

class ThreadPool {
 public:
  // n_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Threads that take part in ParallelFor from now on: 1..size() (n <= 0 or > size(): all).
  // The others sleep until they are active again, so a core can be left to something else
  // (the benchmarks leave one to the transfer thread, as a GPU's copy engines are not its
  // compute). Results do not change: splits are over output elements. Call between
  // ParallelFor calls, from the thread that makes them.
  void SetActive(int n);
  int active() const { return active_.load(std::memory_order_relaxed); }

  // fn(begin, end) over a partition of [0, n). The calling thread takes part.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);  // index 1..size()-1 (the caller is 0)

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;  // published before generation_
  int64_t job_n_ = 0;
  int job_parts_ = 0;
  std::atomic<uint64_t> generation_{0};
  // (generation << 32) | next range to claim; a claim only succeeds for the current job.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};  // ranges of the current job finished
  // Claims and runs ranges of job `gen` until none are left.
  void RunRanges(uint64_t gen, const std::function<void(int64_t, int64_t)>& fn, int64_t n, int parts);
  std::atomic<int> sleepers_{0};  // active workers waiting on work_cv_
  std::atomic<int> active_{1};
  std::condition_variable idle_cv_;  // inactive workers wait here for SetActive
  std::atomic<bool> stop_{false};
};

}  // namespace dd
