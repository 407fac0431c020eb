#include "kv-pool/client/transfer_queue.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace dd::kvpool {

using Clock = std::chrono::steady_clock;

TransferQueue::TransferQueue(const LinkModel& link, int lanes) : link_(link), always_queue_(lanes >= 1) {
  lanes = std::clamp(lanes, 1, kMaxLanes);
  for (int i = 0; i < lanes; ++i) workers_.emplace_back([this] { Loop(); });
}

TransferQueue::~TransferQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

absl::Status TransferQueue::Run(const Job& job, size_t begin, size_t end) {
  if (job.fetch) return job.fetch(begin, end);
  for (size_t i = begin; i < end; ++i) {
    std::memcpy(job.dst[i], job.src[i], job.block_bytes);
  }
  return absl::OkStatus();
}

namespace {

// Until `t`: sleeps while it is far (an OS sleep overshoots by tens of µs, more on a VM), then
// spins, so a waiter resumes within a µs or so of the modelled arrival.
void WaitUntil(Clock::time_point t) {
  constexpr auto kSpin = std::chrono::microseconds(200);
  if (t - Clock::now() > kSpin) std::this_thread::sleep_until(t - kSpin);
  while (Clock::now() < t) {
  }
}

int64_t Bytes(const TransferQueue::Job& job, size_t begin, size_t end) {
  return static_cast<int64_t>(end - begin) * job.block_bytes;
}

}  // namespace

Clock::time_point TransferQueue::Reserve(Clock::time_point earliest, int64_t bytes) {
  const Clock::time_point until =
      std::max(link_free_, earliest) +
      std::chrono::nanoseconds(static_cast<int64_t>(link_.latency_us * 1e3 + bytes / link_.bandwidth_gbps));
  link_free_ = until;
  return until;
}

TransferId TransferQueue::Submit(Job job, Priority priority) {
  std::unique_lock<std::mutex> lock(mu_);
  const TransferId id = ++next_;
  // Inline, in the caller's thread:
  // - on an infinite link, the in-process store's every job, and on a real transport an urgent
  //   job, whose submitter waits for it at once (a miss): handing it to a lane only adds two
  //   thread wake-ups per gather. Background jobs (prefetches) go to the lanes, so they overlap
  //   the caller's compute.
  // - on a modelled link, an urgent job with no other urgent job queued (that one keeps its
  //   place): it takes the link's next window (after the piece in progress), the caller copies,
  //   then waits until the window ends. Through a lane it paid two thread hand-offs per miss
  //   that no copy engine has (measured: 28 misses a step cost SmolLM2's dualdecoder 6.6 ms of
  //   waiting for 1.5 ms of modelled transfer).
  const bool urgent = priority == Priority::kUrgent;
  const bool modelled_inline = !link_.infinite() && urgent && urgent_.empty();
  if (modelled_inline || (link_.infinite() && (!always_queue_ || urgent))) {
    const Clock::time_point until =
        modelled_inline ? Reserve(Clock::now(), Bytes(job, 0, job.dst.size())) : Clock::time_point{};
    ++inline_;  // Drain waits for copies running in callers' threads too
    lock.unlock();
    const auto t0 = Clock::now();
    absl::Status st = Run(job, 0, job.dst.size());
    if (modelled_inline) WaitUntil(until);
    const auto took = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    lock.lock();
    wait_ns_ += took;  // the caller's compute stood still for the transfer it ran itself
    if (!st.ok()) failed_[id] = std::move(st);
    if (--inline_ == 0) done_cv_.notify_all();
    return id;
  }
  pending_.insert(id);
  (priority == Priority::kUrgent ? urgent_ : background_).push_back({id, std::move(job), Clock::now()});
  cv_.notify_one();
  return id;
}

absl::Status TransferQueue::Wait(TransferId id) {
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_.count(id) == 0; });
  wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  auto it = failed_.find(id);
  if (it == failed_.end()) return absl::OkStatus();
  absl::Status st = std::move(it->second);
  failed_.erase(it);
  return st;
}

void TransferQueue::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_.empty() && inline_ == 0; });
}

void TransferQueue::SetLink(const LinkModel& link) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_.empty() && inline_ == 0; });
  link_ = link;
}

int64_t TransferQueue::wait_ns() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wait_ns_;
}

void TransferQueue::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !urgent_.empty() || !background_.empty(); });
    if (stop_) return;
    const bool urgent = !urgent_.empty();
    std::deque<Queued>& q = urgent ? urgent_ : background_;
    Queued item = std::move(q.front());
    q.pop_front();
    const size_t n = item.job.dst.size();
    size_t end = n;
    if (!urgent && item.job.block_bytes > 0) {
      const int64_t piece = link_.infinite() ? kTransportPieceBytes : kModelledLinkPieceBytes;
      const size_t blocks = static_cast<size_t>(
          std::max<int64_t>(1, piece / item.job.block_bytes));
      end = std::min(n, item.next + blocks);
    }
    // The link: latency plus size over bandwidth, then the data is there. A job starts when the
    // link finished the previous one or when it was submitted, whichever is later — on the
    // link's own clock, not when this thread woke up: sleep_until overshoots by tens of µs,
    // which would otherwise add up over many small transfers into a slower link than modelled.
    // An infinite link (a pool's real transport) adds nothing: the job takes what it takes.
    Clock::time_point until{};
    if (!link_.infinite()) until = Reserve(item.submitted, Bytes(item.job, item.next, end));
    lock.unlock();
    absl::Status st = Run(item.job, item.next, end);
    if (until != Clock::time_point{}) std::this_thread::sleep_until(until);
    lock.lock();
    if (st.ok() && end < n) {  // more pieces: back at the head of its queue, after any urgent job
      item.next = end;  // `submitted` stays: the next piece starts when the link is free
      background_.push_front(std::move(item));
      continue;
    }
    if (!st.ok()) failed_[item.id] = std::move(st);
    pending_.erase(item.id);
    done_cv_.notify_all();
  }
}

}  // namespace dd::kvpool
