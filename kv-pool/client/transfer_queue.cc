#include "kv-pool/client/transfer_queue.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace dd::kvpool {

using Clock = std::chrono::steady_clock;

TransferQueue::TransferQueue(const LinkModel& link) : link_(link) {
  worker_ = std::thread([this] { Loop(); });
}

TransferQueue::~TransferQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

absl::Status TransferQueue::Run(const Job& job) {
  if (job.fetch) return job.fetch();
  for (size_t i = 0; i < job.src.size(); ++i) {
    std::memcpy(job.dst[i], job.src[i], job.block_floats * sizeof(float));
  }
  return absl::OkStatus();
}

TransferId TransferQueue::Submit(Job job, Priority priority) {
  std::unique_lock<std::mutex> lock(mu_);
  const TransferId id = ++next_;
  if (link_.infinite()) {
    ++inline_;  // Drain waits for copies running in callers' threads too
    lock.unlock();
    absl::Status st = Run(job);
    lock.lock();
    if (!st.ok()) failed_[id] = std::move(st);
    if (--inline_ == 0) done_cv_.notify_all();
    return id;
  }
  pending_.insert(id);
  (priority == Priority::kUrgent ? urgent_ : background_).push_back({id, std::move(job), Clock::now()});
  cv_.notify_all();
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
    std::deque<Queued>& q = urgent_.empty() ? background_ : urgent_;
    Queued item = std::move(q.front());
    q.pop_front();
    const LinkModel link = link_;
    lock.unlock();
    // The link: latency plus size over bandwidth, then the data is there. A job starts when the
    // link finished the previous one or when it was submitted, whichever is later — on the
    // link's own clock, not when this thread woke up: sleep_until overshoots by tens of µs,
    // which would otherwise add up over many small transfers into a slower link than modelled.
    const double bytes = static_cast<double>(item.job.dst.size() * item.job.block_floats * sizeof(float));
    const auto start = std::max(link_free_, item.submitted);
    const auto until = start + std::chrono::nanoseconds(static_cast<int64_t>(
                                   link.latency_us * 1e3 + bytes / link.bandwidth_gbps));
    link_free_ = until;
    absl::Status st = Run(item.job);
    std::this_thread::sleep_until(until);
    lock.lock();
    if (!st.ok()) failed_[item.id] = std::move(st);
    pending_.erase(item.id);
    done_cv_.notify_all();
  }
}

}  // namespace dd::kvpool
