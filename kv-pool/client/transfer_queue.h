// The asynchronous copy engine shared by the KvStore backends whose blocks are addressable
// memory (in-process heap, a mapped shared-memory region): one thread serves copy jobs through
// a link model (latency + bytes / bandwidth), urgent jobs before any queued background job (a
// job in progress is not interrupted). With an infinite link a job is copied inside Submit.
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/status.h"
#include "kv-pool/client/kv_store.h"

namespace dd::kvpool {

class TransferQueue {
 public:
  struct Job {
    std::vector<float*> dst;  // one per block
    int64_t block_floats = 0;
    std::vector<const float*> src;  // one per block, copied to dst[i]
    // When set, run instead of the copy (a remote get); its error is what Wait returns.
    std::function<absl::Status()> fetch;
  };
  explicit TransferQueue(const LinkModel& link);
  ~TransferQueue();  // finishes the job in progress, drops the queued ones
  TransferQueue(const TransferQueue&) = delete;
  TransferQueue& operator=(const TransferQueue&) = delete;

  TransferId Submit(Job job, Priority priority);
  // Returns at once for an unknown or finished id; a failed fetch's error is returned once.
  absl::Status Wait(TransferId id);
  void Drain();              // until nothing is queued or in progress
  void SetLink(const LinkModel& link);  // after draining
  int64_t wait_ns() const;

 private:
  struct Queued {
    TransferId id;
    Job job;
    std::chrono::steady_clock::time_point submitted;
  };
  static absl::Status Run(const Job& job);
  void Loop();

  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  LinkModel link_;
  std::deque<Queued> urgent_, background_;
  std::unordered_set<TransferId> pending_;
  std::unordered_map<TransferId, absl::Status> failed_;
  TransferId next_ = 0;
  int inline_ = 0;  // infinite-link copies running inside Submit
  int64_t wait_ns_ = 0;
  bool stop_ = false;
  std::thread worker_;
  std::chrono::steady_clock::time_point link_free_{};  // Loop's thread only: when the link is next idle
};

}  // namespace dd::kvpool
