// The pool's UCX side (docs/architecture.md, "KV store and pool";
// docs/decisions/0019-ucx-active-messages.md): one UCP context and worker, and a thread that
// progresses it. Data moves by active messages
// (ucx_protocol.h): a worker names its session and region-relative offsets, the progress thread
// bounds them by the session's tenant region and answers on the same endpoint, so no tenant can
// address another's region or the pool's heap whatever transport UCX picked. With `rma` the
// regions are also registered for one-sided gets and puts (fast on RDMA, whose keys the NIC
// enforces; over tcp and shared memory UCX cannot confine a key to its region, so only for trusted
// tenants). Replies with blocks go out at most two at a time, one per endpoint, in turn
// (reply_queue.h). Replies complete only as fast as this thread progresses: after traffic it keeps
// polling for `spin_us`, then sleeps on the worker's event fd; `busy_poll` spins always (lowest
// latency, one core spent). While it spins with nothing to do it yields the core every 16 polls
// (`spin_yield`): on a host with more runnable threads than cores a spinning pool thread held the
// core its gatherer needed to send the next request.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace dd::kvpool {

struct UcxServerOptions {
  bool rma = false;        // also register regions for one-sided access (trusted tenants / RDMA)
  bool busy_poll = false;  // spin instead of sleeping on the event fd
  int64_t spin_us = 0;     // else keep polling this long after the last progress before sleeping
  bool spin_yield = true;  // sched_yield every 16 idle polls while spinning
  bool tcp = false;        // load UCX's tcp transport (--ucx_tcp: any peer can write the pool's
                           // memory over it, ucx_config.h); without it Create fails if UCX did
};

struct UcxRegion {
  uint8_t* base = nullptr;
  int64_t bytes = 0;
};

// What the active-message path served and refused (for /metrics and tests).
struct UcxCounters {
  std::atomic<int64_t> gets{0}, get_blocks{0}, get_bytes{0}, puts{0}, put_bytes{0}, refused{0};
  std::atomic<int64_t> eager_replies{0};  // get replies sent as one eager message (kEagerReply)
  std::atomic<int64_t> reply_bytes_held{0};  // packed copies of replies in flight (a gauge)
};

class UcxServer {
 public:
  // `regions[t]`: tenant t's region; the memory must outlive the server.
  static absl::StatusOr<std::unique_ptr<UcxServer>> Create(std::vector<UcxRegion> regions,
                                                          UcxServerOptions options = {});
  ~UcxServer();
  // The packed remote key of tenant t's region ("" without `rma`).
  const std::string& rkey(int t) const { return rkeys_[t]; }
  // A fresh session for tenant t (kSessionBytes random bytes), handed out by an authenticated
  // Handshake. Each tenant keeps its newest kMaxSessionsPerTenant sessions.
  std::string NewSession(int t);
  static constexpr size_t kMaxSessionsPerTenant = 1024;
  void Start();
  const std::string& worker_address() const { return address_; }
  // UCX's version and shared-memory settings in this process (ucx_config.h), for the Handshake.
  const std::string& shm_settings() const { return shm_settings_; }
  const std::string& tcp_settings() const { return tcp_settings_; }
  const UcxCounters& counters() const { return counters_; }

  struct Impl;  // public for the C callbacks in ucx_server.cc

 private:
  UcxServer() = default;
  void Progress();
  std::unique_ptr<Impl> impl_;
  std::vector<UcxRegion> regions_;
  std::vector<std::string> rkeys_;
  UcxServerOptions options_;
  std::string address_;
  std::string shm_settings_;
  std::string tcp_settings_;
  std::mutex mu_;  // sessions (Handshake threads write, the progress thread reads)
  absl::flat_hash_map<std::string, int> sessions_;
  std::vector<std::deque<std::string>> session_order_;
  UcxCounters counters_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace dd::kvpool
