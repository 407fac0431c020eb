// One UCX worker and its endpoint to the pool (internal to kv-pool/client): the unit a thread
// owns while it moves blocks. ucx_data_path.cc keeps one per concurrent caller, so two
// gathering threads never wait on each other's worker (a UCX worker is single-threaded; one
// shared worker behind a mutex serialized every gather of a store). Every wait has a deadline:
// a request not done by then is cancelled and the lane reports UNAVAILABLE.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv-pool/client/ucx_protocol.h"

namespace dd::kvpool {

// What every lane of one data path shares; owned by the path, outlives its lanes.
struct UcxLaneConfig {
  ucp_context_h context = nullptr;
  std::string pool_address;  // the pool worker's UCX address
  bool rma = false;          // one-sided gets and puts against `rkey` (else active messages)
  bool pack = false;         // ask the pool for contiguous replies
  bool shared_memory_only = false;  // only shared-memory transports will reach the pool
  std::string rkey;          // packed remote key of the tenant's region (rma)
  uint64_t base = 0;         // the region's address in the pool (rma)
  uint8_t session[ucxproto::kSessionBytes] = {};
  std::chrono::milliseconds timeout{5000};
  const std::atomic<bool>* const* abort = nullptr;  // -> the flag the store raises when the pool is gone
};

class UcxLane {
 public:
  static absl::StatusOr<std::unique_ptr<UcxLane>> Create(const UcxLaneConfig& config);
  ~UcxLane();
  UcxLane(const UcxLane&) = delete;
  UcxLane& operator=(const UcxLane&) = delete;

  // The caller holds mu() around Put and Get.
  std::mutex& mu() { return mu_; }
  // Returns when the bytes are in the pool's region (a later Get on any lane sees them).
  absl::Status Put(int64_t offset, const void* src, int64_t bytes);
  // `cuda`: the destinations are CUDA device memory (one-sided gets only; UCX is told).
  absl::Status Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                   bool cuda = false);

 private:
  struct Pending;
  explicit UcxLane(const UcxLaneConfig& config);
  absl::Status Init();
  absl::Status GetRma(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                      bool cuda);
  Pending* NewPending();
  void Forget(Pending* p);
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param);
  bool Drive(const std::function<bool()>& done, std::chrono::steady_clock::time_point deadline);
  absl::Status WaitPending(const std::vector<Pending*>& ps);
  absl::Status WaitAll(const std::vector<ucs_status_ptr_t>& reqs);
  bool GiveUp() const;
  absl::Status Lost() const;
  void Abandon();

  const UcxLaneConfig& config_;
  std::mutex mu_;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  int efd_ = -1;  // the worker's event fd (owned by UCX)
  ucp_rkey_h rkey_ = nullptr;
  uint64_t next_id_ = 1;
  std::list<std::unique_ptr<Pending>> pending_;
  absl::flat_hash_map<uint64_t, Pending*> by_id_;
  bool peer_failed_ = false;  // set by UCX's error callback (from ucp_worker_progress)
  bool dead_ = false;         // a wait gave up: the lane takes no further work (Abandon)
  int64_t eager_bytes_ = 0;   // the largest reply the pool may send eager (0: none; Init)
};

absl::Status UcxError(const char* what, ucs_status_t st);

}  // namespace dd::kvpool
