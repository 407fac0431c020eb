// UCX data path: one UCP context per store and a lane (ucx_lane.h: a worker and its endpoint to
// the pool's worker) per concurrent caller, up to $DD_UCX_LANES (default 4); a caller takes a
// free lane, opens a new one while under the limit, else waits for one. By default blocks move
// by active messages (ucx_protocol.h): a get sends the pool region-relative offsets (a packed
// reply of 512 KiB or more as two requests sent at once, each at most 16 MiB) and the
// reply lands straight in the destinations (eager: copied in the handler; rendezvous: received
// into an iov of them). The pool sends the blocks from the region as an iov when the pool is on
// this host and UCX may use shared memory (cma reads them, one copy), else packed into one
// buffer (tcp's and RDMA's zero-copy rendezvous need contiguous memory; blocks that lie together
// go as they lie; over tcp as eager replies that fit the 1 MiB tcp segment, ucx_lane.cc);
// $DD_UCX_PACK=0|1 overrides. With a pool started
// with --ucx_rma the path can instead do one-sided gets and puts against the region's remote
// key (UcxPath). A lane that lost the pool breaks the path: every later call fails at once.
#include <ucp/api/ucp.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kv-pool/client/data_path.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/client/ucx_lane.h"

namespace dd::kvpool {
namespace {

namespace wire = ucxproto;

int MaxLanes() {
  static const int v = [] {
    const char* e = std::getenv("DD_UCX_LANES");
    const int n = e != nullptr ? std::atoi(e) : 0;
    return n > 0 ? std::min(n, 64) : 4;
  }();
  return v;
}

class UcxDataPath : public DataPath {
 public:
  explicit UcxDataPath(int64_t timeout_ms) { config_.timeout = std::chrono::milliseconds(timeout_ms); }

  ~UcxDataPath() override {
    lanes_.clear();  // endpoints and workers before the context
    if (config_.context != nullptr) ucp_cleanup(config_.context);
  }

  absl::Status Init(const v1::HandshakeResponse& hs, UcxPath mode, bool pool_is_local) {
    // First: a segment UCX cannot carry is this worker's own error, whatever the pool's settings.
    if (absl::Status st = CheckUcxSegmentSizes(); !st.ok()) return st;
    const absl::StatusOr<bool> gpudirect = UcxGpuDirectAllowed();
    if (!gpudirect.ok()) return gpudirect.status();
    const char* pack = std::getenv("DD_UCX_PACK");
    config_.pack = pack != nullptr && *pack != '\0' ? std::string(pack) != "0"
                                                    : !(pool_is_local && SharedMemoryAllowed());
    // Only shared memory will carry it: UCX_TLS says so, or the pool is on this host and serves no
    // tcp (then UCX takes shared memory, which has no peer-failure handling to ask for).
    const bool pool_tcp = hs.ucx_tcp_settings() != kNoTcp;
    config_.shared_memory_only = SharedMemoryOnly() || (pool_is_local && !pool_tcp && SharedMemoryAllowed());
    if (hs.ucx_worker_address().empty() && hs.ucx_shm_settings().empty()) {
      return absl::FailedPreconditionError("the kv pool runs without UCX (start it with --ucx)");
    }
    // Over UCX's shared memory both ends must size the FIFO alike, or the pool crashes inside
    // UCX (ucx_config.h): refuse rather than connect when the settings differ. Whatever the
    // address: UCX reaches a pool over shared memory whenever it shares the host and IPC
    // namespace (a pod IP on the same node included), which the address cannot tell.
    if (!UcxSharedMemoryCompatible(hs.ucx_shm_settings(), UcxSharedMemorySettings())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv pool ucx: this worker's UCX shared-memory settings (", UcxSharedMemorySettings(), ") differ from the pool's (",
          hs.ucx_shm_settings().empty() ? "not reported: an older pool" : hs.ucx_shm_settings(),
          "); over shared memory a mismatch crashes the pool. Run both with the same UCX and UCX_MM_*/UCX_POSIX_*/"
          "UCX_SYSV_* settings", hs.ucx_shm_settings().empty() ? " (upgrade the pool)" : "",
          ", or leave shared memory out of this worker's UCX_TLS (it then needs RDMA, or tcp on a pool run with "
          "--ucx_tcp)"));
    }
    // Over tcp too: a fragment larger than the receiver's segment kills the receiver inside UCX.
    if (!UcxTcpCompatible(hs.ucx_tcp_settings(), UcxTcpSettings())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv pool ucx: this worker's UCX tcp settings (", UcxTcpSettings(), ") differ from the pool's (",
          hs.ucx_tcp_settings().empty() ? "not reported: an older pool" : hs.ucx_tcp_settings(),
          "); over tcp a mismatch kills the receiving process inside UCX. ",
          hs.ucx_tcp_settings().empty() ? "Upgrade the pool" : "Run both with the same UCX_TCP_RX_SEG_SIZE and UCX_TCP_TX_SEG_SIZE",
          ", or leave tcp out of this worker's UCX_TLS (e.g. sm,self on the pool's host)"));
    }
    if (hs.ucx_worker_address().empty()) {  // withheld: the pool judged our settings incompatible
      return absl::FailedPreconditionError(absl::StrCat(
          "kv pool ucx: the pool withheld its UCX address: it found this worker's settings (shared memory: ",
          UcxSharedMemorySettings(), "; tcp: ", UcxTcpSettings(), ") incompatible with its own (",
          hs.ucx_shm_settings(), "; tcp: ", hs.ucx_tcp_settings(), ")"));
    }
    config_.rma = mode == UcxPath::kRma || (mode == UcxPath::kAuto && !hs.ucx_rkey().empty());
    if (config_.rma && hs.ucx_rkey().empty()) {
      return absl::FailedPreconditionError("the kv pool offers no one-sided UCX access (start it with --ucx_rma)");
    }
    if (!config_.rma && hs.ucx_session().size() != static_cast<size_t>(wire::kSessionBytes)) {
      return absl::FailedPreconditionError("the kv pool handed out no UCX session (an older pool?)");
    }
    std::memcpy(config_.session, hs.ucx_session().data(),
                std::min<size_t>(hs.ucx_session().size(), sizeof(config_.session)));
    config_.pool_address = hs.ucx_worker_address();
    config_.rkey = hs.ucx_rkey();
    config_.base = hs.remote_base();
    config_.abort = &abort_;  // set by the store after Init, before any call
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = (config_.rma ? UCP_FEATURE_RMA : UCP_FEATURE_AM) | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;  // each lane's worker runs on its caller's thread
    // A pool that serves no tcp (its operator did not pass --ucx_tcp) gets no tcp from us either:
    // over tcp any peer could write into this process (ucx_config.h).
    constexpr char kNoTcpWhy[] =
        "the pool serves UCX without tcp (any process that can reach a UCX tcp port can write the memory of the "
        "process behind it; the pool's operator enables tcp with --ucx_tcp, on a trusted network only)";
    absl::StatusOr<ucp_config_t*> config = ReadUcxConfig(pool_tcp);
    if (!config.ok()) {
      if (pool_tcp || config.status().code() != absl::StatusCode::kFailedPrecondition) return config.status();
      return absl::FailedPreconditionError(absl::StrCat(config.status().message(), ", and ", kNoTcpWhy));
    }
    ucs_status_t st = ucp_init(&params, *config, &config_.context);
    ucp_config_release(*config);
    if (st != UCS_OK) return UcxError("ucp_init", st);
    cuda_destinations_ = UcxCudaDestinations(config_.rma, UcxMemoryTypes(config_.context), *gpudirect);
    if (!pool_tcp && UcxContextHasTcp(config_.context)) {  // fail closed, whatever UCX_TLS said
      return absl::FailedPreconditionError(absl::StrCat(
          "kv pool ucx: UCX loaded its tcp transport although ", kNoTcpWhy, "; check UCX_TLS and UCX's config files"));
    }
    auto lane = UcxLane::Create(config_);  // the first lane now: a pool UCX cannot reach fails here
    if (!lane.ok()) {
      if (pool_tcp || pool_is_local) return lane.status();
      return absl::Status(lane.status().code(), absl::StrCat(lane.status().message(), " (", kNoTcpWhy,
                                                             ", and no RDMA device reaches it from here?)"));
    }
    lanes_.push_back(std::move(*lane));
    return absl::OkStatus();
  }

  absl::Status Put(int64_t offset, const void* src, int64_t bytes) override {
    return OnLane([&](UcxLane& lane) { return lane.Put(offset, src, bytes); });
  }

  absl::Status Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                   bool cuda) override {
    if (cuda && !cuda_destinations_) {
      return absl::InternalError("kv pool ucx: a gather into CUDA memory on a path that cannot write it");
    }
    return OnLane([&](UcxLane& lane) { return lane.Get(offsets, block_bytes, dsts, cuda); });
  }

  bool cuda_destinations() const override { return cuda_destinations_; }

 private:
  // Runs `op` on a lane this thread holds alone (a template: no std::function per gather).
  template <typename Op>
  absl::Status OnLane(const Op& op) {
    UcxLane* lane = nullptr;
    std::unique_lock<std::mutex> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!broken_.ok()) return broken_;
      for (auto& l : lanes_) {
        std::unique_lock<std::mutex> try_hold(l->mu(), std::try_to_lock);
        if (try_hold.owns_lock()) {
          lane = l.get();
          held = std::move(try_hold);
          break;
        }
      }
      if (lane == nullptr && static_cast<int>(lanes_.size()) < MaxLanes()) {
        auto fresh = UcxLane::Create(config_);
        if (fresh.ok()) {
          lanes_.push_back(std::move(*fresh));
          lane = lanes_.back().get();
          held = std::unique_lock<std::mutex>(lane->mu());
        }  // else share an existing lane below
      }
      if (lane == nullptr) lane = lanes_[std::hash<std::thread::id>()(std::this_thread::get_id()) % lanes_.size()].get();
    }
    if (!held.owns_lock()) held = std::unique_lock<std::mutex>(lane->mu());
    absl::Status st = op(*lane);
    if (!st.ok() && st.code() != absl::StatusCode::kOutOfRange && st.code() != absl::StatusCode::kInvalidArgument) {
      std::lock_guard<std::mutex> lock(mu_);
      // A refused request (bad offset or size) leaves the path usable; a lost pool does not.
      if (broken_.ok()) broken_ = st;
    }
    return st;
  }

  UcxLaneConfig config_;
  bool cuda_destinations_ = false;  // set in Init
  std::mutex mu_;  // lanes_ (only grows) and broken_
  std::vector<std::unique_ptr<UcxLane>> lanes_;
  absl::Status broken_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataPath>> NewUcxDataPath(const v1::HandshakeResponse& hs, int64_t timeout_ms,
                                                         UcxPath mode, bool pool_is_local) {
  auto path = std::make_unique<UcxDataPath>(timeout_ms);
  if (absl::Status st = path->Init(hs, mode, pool_is_local); !st.ok()) return st;
  return path;
}

}  // namespace dd::kvpool
