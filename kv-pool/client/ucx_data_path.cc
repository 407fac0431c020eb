// UCX data path: one UCP context, worker and endpoint per store, to the pool's worker address.
// By default blocks move by active messages (ucx_protocol.h): a get sends the pool region-
// relative offsets (in batches of up to BatchBytes() of reply, all in flight at once) and the
// reply lands straight in the destinations (eager: copied in the handler; rendezvous: received
// into an iov of the destinations). The pool sends the blocks from the region as an iov when
// the pool is on this host and UCX may use shared memory (cma reads them, one copy), else
// packed into one buffer (tcp's and RDMA's zero-copy rendezvous need contiguous memory);
// $DD_UCX_PACK=0|1 overrides. With a pool started with --ucx_rma the path can
// instead do one-sided gets and puts against the region's remote key (UcxPath). Every wait has
// a deadline: a request not done by then is cancelled and the path reports UNAVAILABLE (the
// endpoint runs in peer error-handling mode, so a dead pool surfaces as an error, not an abort).
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kv-pool/client/data_path.h"
#include "kv-pool/client/ucx_protocol.h"

namespace dd::kvpool {
namespace {

using Clock = std::chrono::steady_clock;
namespace wire = ucxproto;

// Reply bytes per get request: a whole gather travels as one message up to this (over tcp,
// several rendezvous messages in flight were slower than one; over shared memory no faster).
// $DD_UCX_BATCH_KIB overrides, for benchmarks.
int64_t BatchBytes() {
  static const int64_t v = [] {
    const char* e = std::getenv("DD_UCX_BATCH_KIB");
    const int64_t kib = e != nullptr ? std::atoll(e) : 0;
    return kib > 0 ? std::min<int64_t>(kib << 10, ucxproto::kMaxReplyBytes) : int64_t{16} << 20;
  }();
  return v;
}

// One active-message request and its answer. Owned by the path until UCX no longer refers to
// it (a request abandoned at a deadline is kept, not freed under UCX's feet).
struct Pending {
  uint64_t id = 0;
  wire::GetRequest get;            // the header UCX sends (valid until the send completes)
  wire::PutRequest put;
  std::vector<int64_t> offsets;    // a get's data
  absl::Span<float* const> dsts;   // where a get's blocks go
  int64_t block_bytes = 0;
  std::vector<ucp_dt_iov_t> iov;   // rendezvous receive into dsts
  ucs_status_ptr_t send = nullptr;
  ucs_status_ptr_t recv = nullptr;
  bool replied = false, received = false;
  absl::Status status;
  bool done() const { return replied && received && (send == nullptr || ucp_request_check_status(send) != UCS_INPROGRESS); }
};

class UcxDataPath : public DataPath {
 public:
  explicit UcxDataPath(int64_t timeout_ms) : timeout_(std::chrono::milliseconds(timeout_ms)) {}

  ~UcxDataPath() override {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    if (ep_ != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      (void)WaitAll({ucp_ep_close_nbx(ep_, &p)});
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  absl::Status Init(const v1::HandshakeResponse& hs, UcxPath mode, bool pool_is_local) {
    const char* pack = std::getenv("DD_UCX_PACK");
    pack_ = pack != nullptr && *pack != '\0' ? std::string(pack) != "0" : !(pool_is_local && SharedMemoryAllowed());
    if (hs.ucx_worker_address().empty()) {
      return absl::FailedPreconditionError("the kv pool runs without UCX (start it with --ucx)");
    }
    rma_ = mode == UcxPath::kRma || (mode == UcxPath::kAuto && !hs.ucx_rkey().empty());
    if (rma_ && hs.ucx_rkey().empty()) {
      return absl::FailedPreconditionError("the kv pool offers no one-sided UCX access (start it with --ucx_rma)");
    }
    if (!rma_ && hs.ucx_session().size() != static_cast<size_t>(wire::kSessionBytes)) {
      return absl::FailedPreconditionError("the kv pool handed out no UCX session (an older pool?)");
    }
    std::memcpy(session_, hs.ucx_session().data(), std::min<size_t>(hs.ucx_session().size(), sizeof(session_)));
    base_ = hs.remote_base();
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = rma_ ? UCP_FEATURE_RMA : UCP_FEATURE_AM;
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return Error("ucp_config_read", st);
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return Error("ucp_init", st);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // calls are serialized by mu_
    if ((st = ucp_worker_create(context_, &wp, &worker_)) != UCS_OK) return Error("ucp_worker_create", st);
    if (!rma_) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = wire::kReplyId;
      hp.cb = &UcxDataPath::OnReply;
      hp.arg = this;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      if ((st = ucp_worker_set_am_recv_handler(worker_, &hp)) != UCS_OK) return Error("ucp_worker_set_am_recv_handler", st);
    }
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(hs.ucx_worker_address().data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) { static_cast<UcxDataPath*>(arg)->peer_failed_ = true; };
    ep.err_handler.arg = this;
    if (SharedMemoryOnly()) {  // skip the attempt below, which UCX logs as an error
      ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
    if ((st = ucp_ep_create(worker_, &ep, &ep_)) != UCS_OK) {
      // UCX 1.13's shared-memory transports have no peer-failure handling; over them a dead
      // pool cannot stall a transfer (the segment stays mapped), so connect without it. Our
      // deadlines and the lease renewal still bound every wait.
      ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      if ((st = ucp_ep_create(worker_, &ep, &ep_)) != UCS_OK) return Error("ucp_ep_create", st);
    }
    if (rma_ && (st = ucp_ep_rkey_unpack(ep_, hs.ucx_rkey().data(), &rkey_)) != UCS_OK) {
      return Error("ucp_ep_rkey_unpack", st);
    }
    return absl::OkStatus();
  }

  absl::Status Put(int64_t offset, const void* src, int64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
    if (rma_) {
      ucp_request_param_t p{};
      absl::Status st = WaitAll({ucp_put_nbx(ep_, src, bytes, base_ + offset, rkey_, &p)});
      dirty_ = true;
      return Keep(st);
    }
    if (bytes <= 0 || bytes > wire::kMaxReplyBytes) {
      return absl::InvalidArgumentError(absl::StrCat("kv pool ucx: a put of ", bytes, " bytes"));
    }
    Pending* p = NewPending();
    p->received = true;  // a put's reply carries no data
    p->put.id = p->id;
    std::memcpy(p->put.session, session_, sizeof(session_));
    p->put.offset = offset;
    p->put.bytes = bytes;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY;
    p->send = ucp_am_send_nbx(ep_, wire::kPutId, &p->put, sizeof(p->put), src, bytes, &rp);
    return Keep(WaitPending({p}));
  }

  absl::Status Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<float* const> dsts) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
    if (rma_) return GetRma(offsets, block_bytes, dsts);
    if (offsets.empty()) return absl::OkStatus();
    if (block_bytes <= 0 || block_bytes > wire::kMaxReplyBytes) {
      return absl::InvalidArgumentError(absl::StrCat("kv pool ucx: blocks of ", block_bytes, " bytes"));
    }
    const size_t per_batch = static_cast<size_t>(
        std::clamp<int64_t>(BatchBytes() / block_bytes, 1, wire::kMaxBlocksPerGet));
    std::vector<Pending*> batch;
    for (size_t first = 0; first < offsets.size(); first += per_batch) {
      const size_t n = std::min(per_batch, offsets.size() - first);
      Pending* p = NewPending();
      p->offsets.assign(offsets.begin() + first, offsets.begin() + first + n);
      p->dsts = dsts.subspan(first, n);
      p->block_bytes = block_bytes;
      p->get.id = p->id;
      p->get.count = static_cast<uint32_t>(n);
      p->get.flags = pack_ ? wire::kPackReply : 0;
      p->get.block_bytes = block_bytes;
      std::memcpy(p->get.session, session_, sizeof(session_));
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
      p->send = ucp_am_send_nbx(ep_, wire::kGetId, &p->get, sizeof(p->get), p->offsets.data(),
                                n * sizeof(int64_t), &rp);
      batch.push_back(p);
    }
    return Keep(WaitPending(batch));
  }

 private:
  absl::Status GetRma(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<float* const> dsts) {
    ucp_request_param_t p{};
    if (dirty_) {  // puts must land before gets on the same endpoint read them
      if (absl::Status st = WaitAll({ucp_ep_flush_nbx(ep_, &p)}); !st.ok()) return Keep(st);
      dirty_ = false;
    }
    std::vector<ucs_status_ptr_t> reqs;
    reqs.reserve(offsets.size());
    for (size_t i = 0; i < offsets.size(); ++i) {
      reqs.push_back(ucp_get_nbx(ep_, dsts[i], block_bytes, base_ + offsets[i], rkey_, &p));
    }
    return Keep(WaitAll(reqs));
  }

  Pending* NewPending() {
    pending_.emplace_back(std::make_unique<Pending>());
    Pending* p = pending_.back().get();
    p->id = next_id_++;
    by_id_[p->id] = p;
    return p;
  }

  void Forget(Pending* p) {
    by_id_.erase(p->id);
    for (auto it = pending_.begin(); it != pending_.end(); ++it) {
      if (it->get() == p) {
        pending_.erase(it);
        return;
      }
    }
  }

  // The pool's answer to request `id` (called from ucp_worker_progress on this thread).
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxDataPath*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    wire::Reply reply;
    Pending* p = nullptr;
    if (header_length == sizeof(reply)) {
      std::memcpy(&reply, header, sizeof(reply));
      auto it = self->by_id_.find(reply.id);
      if (it != self->by_id_.end() && !it->second->replied) p = it->second;
    }
    if (p == nullptr) {  // a late answer to an abandoned request, or noise
      if (rndv) ucp_am_data_release(self->worker_, data);
      return UCS_OK;
    }
    p->replied = true;
    const size_t want = p->dsts.size() * static_cast<size_t>(p->block_bytes);
    if (reply.code != 0 || length != want) {
      p->status = reply.code != 0
                      ? absl::Status(static_cast<absl::StatusCode>(reply.code), "kv pool ucx: the pool refused the request")
                      : absl::InternalError(absl::StrCat("kv pool ucx: a reply of ", length, " bytes, expected ", want));
      p->received = true;
      if (rndv) ucp_am_data_release(self->worker_, data);
      return UCS_OK;
    }
    if (want == 0) {
      p->received = true;
      return UCS_OK;
    }
    if (!rndv) {
      const auto* src = static_cast<const uint8_t*>(data);
      for (size_t i = 0; i < p->dsts.size(); ++i) std::memcpy(p->dsts[i], src + i * p->block_bytes, p->block_bytes);
      p->received = true;
      return UCS_OK;
    }
    p->iov.reserve(p->dsts.size());
    for (float* d : p->dsts) p->iov.push_back({d, static_cast<size_t>(p->block_bytes)});
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    rp.datatype = ucp_dt_make_iov();
    rp.user_data = p;
    rp.cb.recv_am = [](void* r, ucs_status_t st, size_t, void* user) {
      auto* q = static_cast<Pending*>(user);
      if (st != UCS_OK && q->status.ok()) q->status = Error("receive", st);
      q->received = true;
      q->recv = nullptr;
      ucp_request_free(r);
    };
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_, data, p->iov.data(), p->iov.size(), &rp);
    if (r == nullptr) {
      p->received = true;
    } else if (UCS_PTR_IS_ERR(r)) {
      p->status = Error("receive", UCS_PTR_STATUS(r));
      p->received = true;
    } else {
      p->recv = r;
    }
    return UCS_OK;
  }

  // Progresses until every request in `ps` is answered and sent, or the deadline passes (then
  // cancels what UCX still holds and keeps those requests; the path is broken from then on).
  absl::Status WaitPending(const std::vector<Pending*>& ps) {
    const auto deadline = Clock::now() + timeout_;
    absl::Status result;
    for (Pending* p : ps) {
      if (UCS_PTR_IS_ERR(p->send)) {
        if (result.ok()) result = Error("send", UCS_PTR_STATUS(p->send));
        p->send = nullptr;
        p->replied = p->received = true;
      }
    }
    auto all_done = [&] {
      for (Pending* p : ps) {
        if (!p->done()) return false;
      }
      return true;
    };
    while (!all_done()) {
      ucp_worker_progress(worker_);
      if (Clock::now() > deadline || peer_failed_ || aborted()) {
        for (Pending* p : ps) {
          if (p->send != nullptr && ucp_request_check_status(p->send) == UCS_INPROGRESS) ucp_request_cancel(worker_, p->send);
          if (p->recv != nullptr) ucp_request_cancel(worker_, p->recv);
        }
        const auto grace = Clock::now() + std::chrono::milliseconds(200);
        while (!all_done() && Clock::now() < grace) ucp_worker_progress(worker_);
        if (result.ok()) {
          result = absl::UnavailableError(peer_failed_ || aborted() ? "kv pool ucx: the pool is gone"
                                                                    : "kv pool ucx: no answer before the deadline");
        }
        break;
      }
    }
    for (Pending* p : ps) {
      if (result.ok() && !p->status.ok()) result = p->status;
      const bool send_done = p->send == nullptr || ucp_request_check_status(p->send) != UCS_INPROGRESS;
      if (!send_done || p->recv != nullptr) {
        by_id_.erase(p->id);  // UCX still refers to it: keep the memory, drop late answers
        continue;
      }
      if (p->send != nullptr) ucp_request_free(p->send);
      Forget(p);
    }
    return result;
  }

  static bool IsSharedMemoryTransport(absl::string_view t) {
    return t == "sm" || t == "shm" || t == "posix" || t == "sysv" || t == "cma" || t == "xpmem" || t == "knem";
  }
  // UCX_TLS is unset or names a shared-memory transport.
  static bool SharedMemoryAllowed() {
    const char* tls = std::getenv("UCX_TLS");
    if (tls == nullptr || *tls == '\0') return true;
    for (absl::string_view t : absl::StrSplit(tls, ',')) {
      if (t == "all" || IsSharedMemoryTransport(t)) return true;
    }
    return false;
  }
  // UCX_TLS names only shared-memory transports (sm, posix, sysv, cma, self).
  static bool SharedMemoryOnly() {
    const char* tls = std::getenv("UCX_TLS");
    if (tls == nullptr || *tls == '\0') return false;
    for (absl::string_view t : absl::StrSplit(tls, ',')) {
      if (!IsSharedMemoryTransport(t) && t != "self") return false;
    }
    return true;
  }
  static absl::Status Error(const char* what, ucs_status_t st) {
    return absl::UnavailableError(absl::StrCat("kv pool ucx: ", what, ": ", ucs_status_string(st)));
  }
  absl::Status Keep(absl::Status st) {
    if (!st.ok() && st.code() != absl::StatusCode::kOutOfRange && st.code() != absl::StatusCode::kInvalidArgument) {
      broken_ = st;  // a refused request (bad offset or size) leaves the path usable; a lost pool does not
    }
    return st;
  }
  // Progresses until every request is done or the deadline passes (then cancels them).
  absl::Status WaitAll(const std::vector<ucs_status_ptr_t>& reqs) {
    const auto deadline = Clock::now() + timeout_;
    absl::Status result;
    for (ucs_status_ptr_t r : reqs) {
      if (UCS_PTR_IS_ERR(r)) {
        if (result.ok()) result = Error("request", UCS_PTR_STATUS(r));
        continue;
      }
      if (r == nullptr) continue;  // completed immediately
      ucs_status_t st;
      while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        ucp_worker_progress(worker_);
        if (Clock::now() > deadline || peer_failed_ || aborted()) {
          ucp_request_cancel(worker_, r);
          const auto grace = Clock::now() + std::chrono::milliseconds(200);
          while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS && Clock::now() < grace) {
            ucp_worker_progress(worker_);
          }
          if (result.ok()) {
            result = absl::UnavailableError(peer_failed_ || aborted() ? "kv pool ucx: the pool is gone"
                                                                      : "kv pool ucx: no answer before the deadline");
          }
          break;
        }
      }
      if (st != UCS_OK && result.ok()) result = Error("request", st);
      // A request that ignored the cancel is leaked rather than freed under UCX's feet; the
      // path is broken from now on and makes no further requests.
      if (st != UCS_INPROGRESS) ucp_request_free(r);
    }
    return result;
  }

  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  bool rma_ = false;
  bool pack_ = false;  // ask the pool for contiguous replies
  ucp_rkey_h rkey_ = nullptr;
  uint64_t base_ = 0;
  bool dirty_ = false;
  uint8_t session_[wire::kSessionBytes] = {};
  uint64_t next_id_ = 1;
  std::list<std::unique_ptr<Pending>> pending_;
  absl::flat_hash_map<uint64_t, Pending*> by_id_;
  bool peer_failed_ = false;  // set by UCX's error callback (from ucp_worker_progress)
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
