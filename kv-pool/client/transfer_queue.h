// The asynchronous copy engine shared by the KvStore backends: copies from addressable memory
// (in-process heap, a mapped shared-memory region) or remote gets (`fetch`). Lanes (threads)
// serve the jobs, urgent jobs before any queued background job (a job in progress is not
// interrupted), through a link model (latency + bytes / bandwidth; one link, shared by the
// lanes). `lanes` = 0 is the in-process store's model: one lane, and with an infinite link a
// job is copied inside Submit (an infinitely fast link). `lanes` >= 1: background jobs run on a
// lane, so a pool's real transport overlaps the caller's compute; several lanes keep several
// gathers in flight, as a GPU has several copy engines and UCX several rails. An urgent job
// runs inside Submit whatever the lanes (its caller waits for it anyway): on an infinite link
// as fast as it goes, on a modelled link in the link's next window (after the piece in
// progress), Submit returning when the window ends — unless another urgent job is queued,
// which keeps its place ahead of it.
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
    std::vector<void*> dst;  // one per block
    int64_t block_bytes = 0;
    std::vector<const void*> src;  // one per block, copied to dst[i]
    // When set, run instead of the copy (a remote get of blocks [begin, end)); its error is
    // what Wait returns.
    std::function<absl::Status(size_t begin, size_t end)> fetch;
  };
  // A background job is served in pieces of at most this many bytes, and queued urgent jobs go
  // between its pieces, so an urgent job waits for at most one piece, while its submitter pays
  // for one job. Small on a modelled link (serial, slow), larger on a real transport (one
  // request per piece).
  static constexpr int64_t kModelledLinkPieceBytes = 32 << 10;
  static constexpr int64_t kTransportPieceBytes = 256 << 10;
  static constexpr int kMaxLanes = 16;
  // lanes: 0 (in-process: inline on an infinite link) or 1..kMaxLanes threads.
  explicit TransferQueue(const LinkModel& link, int lanes = 0);
  ~TransferQueue();  // finishes the job in progress, drops the queued ones
  TransferQueue(const TransferQueue&) = delete;
  TransferQueue& operator=(const TransferQueue&) = delete;

  TransferId Submit(Job job, Priority priority);
  // Returns at once for an unknown or finished id; a failed fetch's error is returned once.
  absl::Status Wait(TransferId id);
  void Drain();              // until nothing is queued or in progress
  void SetLink(const LinkModel& link);  // after draining
  // Time callers spent in Wait, plus the jobs they ran inline in Submit (their compute stood
  // still either way).
  int64_t wait_ns() const;

 private:
  struct Queued {
    TransferId id;
    Job job;
    std::chrono::steady_clock::time_point submitted;
    size_t next = 0;  // blocks before this one are done
  };
  static absl::Status Run(const Job& job, size_t begin, size_t end);
  // The link's next window for `bytes`, starting no earlier than `earliest` (mu_ held).
  std::chrono::steady_clock::time_point Reserve(std::chrono::steady_clock::time_point earliest, int64_t bytes);
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
  const bool always_queue_;  // lanes >= 1: background jobs never inline
  std::vector<std::thread> workers_;
  std::chrono::steady_clock::time_point link_free_{};  // when the link is next idle
};

}  // namespace dd::kvpool
