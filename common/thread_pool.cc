#include "common/thread_pool.h"

#include <algorithm>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DD_CPU_RELAX() _mm_pause()
#else
#define DD_CPU_RELAX() std::this_thread::yield()
#endif

namespace dd {
namespace {
constexpr int kSpinIterations = 20000;  // ~0.3 ms of pause instructions on the development VM (measured)
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = std::max(1u, std::thread::hardware_concurrency());
  active_.store(n_threads);
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

void ThreadPool::SetActive(int n) {
  if (n <= 0 || n > size()) n = size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.store(n);
  }
  idle_cv_.notify_all();
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  work_cv_.notify_all();
  idle_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

static void RangeFor(int64_t n, int parts, int index, int64_t* begin, int64_t* end) {
  const int64_t base = n / parts, rem = n % parts;
  *begin = index * base + std::min<int64_t>(index, rem);
  *end = *begin + base + (index < rem ? 1 : 0);
}

void ThreadPool::RunRanges(uint64_t gen, const std::function<void(int64_t, int64_t)>& fn, int64_t n, int parts) {
  for (;;) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    if ((c >> 32) != (gen & 0xFFFFFFFFu) || static_cast<int>(c & 0xFFFFFFFFu) >= parts) return;
    if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
    int64_t b, e;
    RangeFor(n, parts, static_cast<int>(c & 0xFFFFFFFFu), &b, &e);
    fn(b, e);
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int parts = static_cast<int>(std::min<int64_t>(active_.load(std::memory_order_relaxed), n));
  if (parts == 1) {
    fn(0, n);
    return;
  }
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(mu_);  // orders the job fields before the counters
    job_ = &fn;
    job_n_ = n;
    job_parts_ = parts;
    gen = generation_.load(std::memory_order_relaxed) + 1;
    done_.store(0, std::memory_order_relaxed);
    claim_.store((gen & 0xFFFFFFFFu) << 32, std::memory_order_release);
    generation_.store(gen, std::memory_order_release);
  }
  if (sleepers_.load(std::memory_order_acquire) > 0) work_cv_.notify_all();
  RunRanges(gen, fn, n, parts);  // the caller claims ranges too, all of them if it must
  for (int spins = 0; done_.load(std::memory_order_acquire) != parts; ++spins) {
    if (spins < kSpinIterations) {
      DD_CPU_RELAX();
    } else {
      std::this_thread::yield();
    }
  }
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    if (index >= active_.load(std::memory_order_relaxed)) {
      // Not taking part: sleep until SetActive includes this thread (never on work_cv_, so
      // ParallelFor does not wake it for nothing).
      std::unique_lock<std::mutex> lock(mu_);
      idle_cv_.wait(lock, [&] { return stop_.load() || index < active_.load(); });
      if (stop_.load()) return;
      seen = generation_.load(std::memory_order_acquire);  // jobs of the idle time are over
    }
    // Spin briefly for the next job, then sleep.
    uint64_t gen = generation_.load(std::memory_order_acquire);
    for (int spins = 0; gen == seen && spins < kSpinIterations && !stop_.load(std::memory_order_relaxed); ++spins) {
      DD_CPU_RELAX();
      gen = generation_.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1, std::memory_order_acq_rel);
      work_cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    }
    if (stop_.load()) return;
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n;
    int parts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seen = generation_.load(std::memory_order_acquire);
      job = job_;
      n = job_n_;
      parts = job_parts_;
    }
    // A worker that wakes after its job is over finds no range to claim and never touches it.
    RunRanges(seen, *job, n, parts);
  }
}

}  // namespace dd
