// A fixed pool of worker threads for data-parallel kernels.
//
// ParallelFor splits [0, n) into contiguous ranges, one per thread, and blocks until all are
// done. The split depends only on n and the thread count, never on timing, and kernels split
// over *output* elements only, so every result is independent of the thread count
// (DESIGN §5 batch invariance). Which thread runs which range is decided at run time: the
// caller and the workers claim ranges from a counter, so when a worker is not scheduled (a
// busy machine) the caller runs its range instead of waiting for it. One ParallelFor at a time per pool: callers serialize
// (the engine's compute stream owns the pool).
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

  // fn(begin, end) over a partition of [0, n). The calling thread takes part.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;  // published before generation_
  int64_t job_n_ = 0;
  std::atomic<uint64_t> generation_{0};
  // (generation << 32) | next range to claim; a claim only succeeds for the current job.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> done_{0};  // ranges of the current job finished
  // Claims and runs ranges of job `gen` until none are left.
  void RunRanges(uint64_t gen, const std::function<void(int64_t, int64_t)>& fn, int64_t n, int parts);
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace dd
