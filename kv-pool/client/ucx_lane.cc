#include "kv-pool/client/ucx_lane.h"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "kv-pool/client/ucx_config.h"

namespace dd::kvpool {

using Clock = std::chrono::steady_clock;
namespace wire = ucxproto;

absl::Status UcxError(const char* what, ucs_status_t st) {
  return absl::UnavailableError(absl::StrCat("kv pool ucx: ", what, ": ", ucs_status_string(st)));
}

namespace {

// A gather of 512 KiB or more with a packed reply (tcp, RDMA) travels as at least this many
// requests (default 2), sent at once: the pool has the second piece's request in hand when the
// first leaves (it sends one reply per endpoint at a time, reply_queue.h). Over tcp (64 x 16 KiB,
// runs alternating) 2 pieces were ~10% faster than 1. Over shared memory (iov replies) splitting
// gained nothing, so there a gather is one request. Every request carries at most 16 MiB; over
// tcp pieces are cut smaller still, to fit an eager reply (below). $DD_UCX_PIECES overrides, for
// benchmarks.
int64_t Pieces() {
  static const int64_t v = [] {
    const char* e = std::getenv("DD_UCX_PIECES");
    const int64_t n = e != nullptr ? std::atoll(e) : 0;
    return n > 0 ? std::min<int64_t>(n, 64) : 2;
  }();
  return v;
}
constexpr int64_t kMaxPieceBytes = int64_t{16} << 20;
// Over tcp a reply that fits the receiver's tcp segment (less room for UCX's and our headers:
// UcxEagerReplyBytes) goes as one eager message (kEagerReply), and a larger gather is cut into
// pieces that fit, up to this many (beyond, rendezvous pieces of up to kMaxPieceBytes). The pieces are the
// gain: 256 x 16 KiB gathers 3.3 -> 4.9 GB/s (medians of 6 alternations; rendezvous cut into 5
// pieces does as well), 16 and 64 blocks unchanged within the runs' spread
// (docs/decisions/0022-ucx-replies.md). $DD_UCX_EAGER=0 turns it off, for benchmarks.
constexpr int64_t kMaxEagerPieces = 64;
bool EagerAllowed() {
  static const bool v = [] {
    const char* e = std::getenv("DD_UCX_EAGER");
    return e == nullptr || std::string(e) != "0";
  }();
  return v;
}
// Below this a gather is one request (a second round trip costs more than it overlaps).
constexpr int64_t kSplitBytes = int64_t{512} << 10;

// How long a waiter spins after UCX stops making progress before it sleeps on the event fd;
// $DD_UCX_SPIN_US overrides (0: sleep at once).
std::chrono::microseconds SpinTime() {
  static const std::chrono::microseconds v = [] {
    const char* e = std::getenv("DD_UCX_SPIN_US");
    return std::chrono::microseconds(e != nullptr && *e != '\0' ? std::max(0, std::atoi(e)) : 50);
  }();
  return v;
}

// Whether a spinning waiter yields its core every 16 polls; $DD_UCX_SPIN_YIELD=0 (or false,
// off, no) turns it off, for benchmarks; unset or empty: on. On 2 cores, two gatherers and the
// pool's thread: without it a spinning waiter held the core the pool needed (two gatherers over
// sm 1.1-4.4 GB/s, p99 4-12.5 ms; with it, and the pool yielding too, 1.9-7.3 GB/s, p99
// 0.15-3.0 ms; docs/decisions/0023-ucx-progress-and-waiting.md).
bool SpinYield() {
  static const bool v = [] {
    const char* e = std::getenv("DD_UCX_SPIN_YIELD");
    if (e == nullptr || *e == '\0') return true;
    const std::string s(e);
    return !(s == "0" || s == "false" || s == "off" || s == "no");
  }();
  return v;
}

}  // namespace

// One active-message request and its answer. Owned by the lane until UCX no longer refers to
// it (a request abandoned at a deadline is kept, not freed under UCX's feet).
struct UcxLane::Pending {
  uint64_t id = 0;
  wire::GetRequest get;            // the header UCX sends (valid until the send completes)
  wire::PutRequest put;
  std::vector<int64_t> offsets;    // a get's data
  absl::Span<void* const> dsts;   // where a get's blocks go
  int64_t block_bytes = 0;
  std::vector<ucp_dt_iov_t> iov;   // rendezvous receive into dsts
  ucs_status_ptr_t send = nullptr;
  ucs_status_ptr_t recv = nullptr;
  bool replied = false, received = false;
  absl::Status status;
  bool done() const {
    return replied && received && (send == nullptr || ucp_request_check_status(send) != UCS_INPROGRESS);
  }
};

UcxLane::UcxLane(const UcxLaneConfig& config) : config_(config) {}

absl::StatusOr<std::unique_ptr<UcxLane>> UcxLane::Create(const UcxLaneConfig& config) {
  std::unique_ptr<UcxLane> lane(new UcxLane(config));
  if (absl::Status st = lane->Init(); !st.ok()) return st;
  return lane;
}

absl::Status UcxLane::Init() {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // calls are serialized by mu_
  ucs_status_t st = ucp_worker_create(config_.context, &wp, &worker_);
  if (st != UCS_OK) return UcxError("ucp_worker_create", st);
  if (!config_.rma) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = wire::kReplyId;
    hp.cb = &UcxLane::OnReply;
    hp.arg = this;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    if ((st = ucp_worker_set_am_recv_handler(worker_, &hp)) != UCS_OK) {
      return UcxError("ucp_worker_set_am_recv_handler", st);
    }
  }
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(config_.pool_address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) { static_cast<UcxLane*>(arg)->peer_failed_ = true; };
  ep.err_handler.arg = this;
  if (config_.shared_memory_only) {  // skip the attempt below, which UCX logs as an error
    ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  }
  if (ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;  // then Drive only spins
  if ((st = ucp_ep_create(worker_, &ep, &ep_)) != UCS_OK) {
    // UCX 1.13's shared-memory transports have no peer-failure handling; over them a dead
    // pool cannot stall a transfer (the segment stays mapped), so connect without it. Our
    // deadlines and the lease renewal still bound every wait.
    ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    if ((st = ucp_ep_create(worker_, &ep, &ep_)) != UCS_OK) return UcxError("ucp_ep_create", st);
  }
  if (config_.rma && (st = ucp_ep_rkey_unpack(ep_, config_.rkey.data(), &rkey_)) != UCS_OK) {
    return UcxError("ucp_ep_rkey_unpack", st);
  }
  // The worker's and the pool's tcp segments are equal (the Handshake checked), so a reply
  // that fits ours fits the one the pool sends from.
  if (!config_.rma && config_.pack && EagerAllowed() && UcxAmTransport(ep_) == "tcp") {
    eager_bytes_ = UcxEagerReplyBytes();
  }
  return absl::OkStatus();
}

UcxLane::~UcxLane() {
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
  if (ep_ != nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucp_ep_h ep = ep_;
    ep_ = nullptr;  // a failed wait below must not close it again (Abandon)
    (void)WaitAll({ucp_ep_close_nbx(ep, &p)});
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
}

// After a wait gave up. ucp_request_cancel acts on tag receives only, so UCX may still hold
// gets and rendezvous receives that would write into the caller's buffers (which the caller
// frees once it has the error) whenever this worker progresses again. Closing the endpoint by
// force completes them with an error; and the lane takes no further work, so no other thread
// that was waiting for it progresses this worker.
void UcxLane::Abandon() {
  dead_ = true;
  if (ep_ == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep_, &p);
  ep_ = nullptr;
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  const auto until = Clock::now() + std::chrono::milliseconds(500);
  while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
  if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);  // else leaked, not freed under UCX
}

absl::Status UcxLane::Put(int64_t offset, const void* src, int64_t bytes) {
  if (dead_) return absl::UnavailableError("kv pool ucx: this lane gave up on the pool earlier");
  if (config_.rma) {  // flushed before returning: a get on another lane must see the bytes
    ucp_request_param_t p{};
    ucs_status_ptr_t put = ucp_put_nbx(ep_, src, bytes, config_.base + offset, rkey_, &p);
    return WaitAll({put, ucp_ep_flush_nbx(ep_, &p)});
  }
  if (bytes <= 0 || bytes > wire::kMaxReplyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv pool ucx: a put of ", bytes, " bytes"));
  }
  Pending* p = NewPending();
  p->received = true;  // a put's reply carries no data
  p->put.id = p->id;
  std::memcpy(p->put.session, config_.session, sizeof(config_.session));
  p->put.offset = offset;
  p->put.bytes = bytes;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_REPLY;
  p->send = ucp_am_send_nbx(ep_, wire::kPutId, &p->put, sizeof(p->put), src, bytes, &rp);
  return WaitPending({p});  // the pool answers once the bytes are in its region
}

absl::Status UcxLane::Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                          bool cuda) {
  if (dead_) return absl::UnavailableError("kv pool ucx: this lane gave up on the pool earlier");
  if (config_.rma) return GetRma(offsets, block_bytes, dsts, cuda);
  if (cuda) return absl::InternalError("kv pool ucx: active-message replies cannot land in CUDA memory");
  if (offsets.empty()) return absl::OkStatus();
  if (block_bytes <= 0 || block_bytes > wire::kMaxReplyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv pool ucx: blocks of ", block_bytes, " bytes"));
  }
  const int64_t n_all = static_cast<int64_t>(offsets.size());
  const bool split = config_.pack && n_all * block_bytes >= kSplitBytes;
  const int64_t fit = eager_bytes_ / block_bytes;  // blocks per eager reply
  const bool eager = fit > 0 && (n_all + fit - 1) / fit <= kMaxEagerPieces;
  int64_t per;
  if (eager) {
    const int64_t pieces = std::max((n_all + fit - 1) / fit, split ? Pieces() : 1);
    per = (n_all + pieces - 1) / pieces;
  } else {
    per = split ? (n_all + Pieces() - 1) / Pieces() : n_all;
    per = std::min(per, std::max<int64_t>(1, kMaxPieceBytes / block_bytes));
  }
  const size_t per_batch = static_cast<size_t>(std::clamp<int64_t>(per, 1, wire::kMaxBlocksPerGet));
  std::vector<Pending*> batch;
  for (size_t first = 0; first < offsets.size(); first += per_batch) {
    const size_t n = std::min(per_batch, offsets.size() - first);
    Pending* p = NewPending();
    p->offsets.assign(offsets.begin() + first, offsets.begin() + first + n);
    p->dsts = dsts.subspan(first, n);
    p->block_bytes = block_bytes;
    p->get.id = p->id;
    p->get.count = static_cast<uint32_t>(n);
    // kPackReply with kEagerReply: a pool older than kEagerReply still packs.
    p->get.flags = eager ? wire::kPackReply | wire::kEagerReply : config_.pack ? wire::kPackReply : 0;
    p->get.block_bytes = block_bytes;
    std::memcpy(p->get.session, config_.session, sizeof(config_.session));
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p->send = ucp_am_send_nbx(ep_, wire::kGetId, &p->get, sizeof(p->get), p->offsets.data(), n * sizeof(int64_t),
                              &rp);
    batch.push_back(p);
  }
  return WaitPending(batch);
}

absl::Status UcxLane::GetRma(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                             bool cuda) {
  ucp_request_param_t p{};
  if (cuda) {  // UCX's memory-type cache may not know memory allocated before it started
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  std::vector<ucs_status_ptr_t> reqs;
  reqs.reserve(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    reqs.push_back(ucp_get_nbx(ep_, dsts[i], block_bytes, config_.base + offsets[i], rkey_, &p));
  }
  return WaitAll(reqs);
}

UcxLane::Pending* UcxLane::NewPending() {
  pending_.emplace_back(std::make_unique<Pending>());
  Pending* p = pending_.back().get();
  p->id = next_id_++;
  by_id_[p->id] = p;
  return p;
}

void UcxLane::Forget(Pending* p) {
  by_id_.erase(p->id);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->get() == p) {
      pending_.erase(it);
      return;
    }
  }
}

// The pool's answer to request `id` (called from ucp_worker_progress on the owner's thread).
ucs_status_t UcxLane::OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxLane*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  wire::Reply reply;
  Pending* p = nullptr;
  if (header_length == sizeof(reply)) {
    std::memcpy(&reply, header, sizeof(reply));
    auto it = self->by_id_.find(reply.id);
    if (it != self->by_id_.end() && !it->second->replied) p = it->second;
  }
  // Returning UCS_OK without receiving rendezvous data drops it; releasing it here as well made
  // UCX release it twice (ucx_server.cc).
  if (p == nullptr) {  // a late answer to an abandoned request, or noise
    return UCS_OK;
  }
  p->replied = true;
  const size_t want = p->dsts.size() * static_cast<size_t>(p->block_bytes);
  if (reply.code != 0 || length != want) {
    p->status = reply.code != 0
                    ? absl::Status(static_cast<absl::StatusCode>(reply.code), "kv pool ucx: the pool refused the request")
                    : absl::InternalError(absl::StrCat("kv pool ucx: a reply of ", length, " bytes, expected ", want));
    p->received = true;
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
  for (void* d : p->dsts) p->iov.push_back({d, static_cast<size_t>(p->block_bytes)});
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  rp.datatype = ucp_dt_make_iov();
  rp.user_data = p;
  rp.cb.recv_am = [](void* r, ucs_status_t st, size_t, void* user) {
    auto* q = static_cast<Pending*>(user);
    if (st != UCS_OK && q->status.ok()) q->status = UcxError("receive", st);
    q->received = true;
    q->recv = nullptr;
    ucp_request_free(r);
  };
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_, data, p->iov.data(), p->iov.size(), &rp);
  if (r == nullptr) {
    p->received = true;
  } else if (UCS_PTR_IS_ERR(r)) {
    p->status = UcxError("receive", UCS_PTR_STATUS(r));
    p->received = true;
  } else {
    p->recv = r;
  }
  return UCS_OK;
}

bool UcxLane::GiveUp() const {
  const std::atomic<bool>* flag = config_.abort != nullptr ? *config_.abort : nullptr;
  return peer_failed_ || (flag != nullptr && flag->load(std::memory_order_acquire));
}

absl::Status UcxLane::Lost() const {
  return absl::UnavailableError(GiveUp() ? "kv pool ucx: the pool is gone" : "kv pool ucx: no answer before the deadline");
}

// Progresses the worker until done() or the deadline (false; also when the pool is gone).
// Spins while UCX makes progress and for SpinTime() after it stops (the answer usually comes
// within tens of µs), then sleeps on the worker's event fd, so a waiting gatherer leaves the
// core to the pool and to other gatherers (on a small host a spinning waiter delayed the very
// thread it waited for). The clock is read every 16th round only (it showed in profiles).
bool UcxLane::Drive(const std::function<bool()>& done, Clock::time_point deadline) {
  Clock::time_point quiet_since;
  bool quiet = false;
  for (unsigned n = 1; !done(); ++n) {
    if (ucp_worker_progress(worker_) != 0) {
      quiet = false;
      continue;
    }
    if (n % 16 != 0) continue;
    const auto now = Clock::now();
    if (now > deadline || GiveUp()) return false;
    if (!quiet) {
      quiet = true;
      quiet_since = now;
      continue;
    }
    if (efd_ < 0 || now - quiet_since < SpinTime()) {
      if (SpinYield()) sched_yield();  // the pool's thread or another gatherer may need this core
      continue;
    }
    if (ucp_worker_arm(worker_) != UCS_OK) continue;  // BUSY: events arrived meanwhile
    // At most 1 ms: the abort flag and the deadline are checked, and progress that raises no
    // event (a send stalled on a full shared-memory FIFO) is not held for long.
    pollfd p{efd_, POLLIN, 0};
    const timespec bound{0, 1000 * 1000};
    (void)ppoll(&p, 1, &bound, nullptr);
    quiet = false;
  }
  return true;
}

// Progresses until every request in `ps` is answered and sent, or the deadline passes (then
// cancels what UCX still holds and keeps those requests; the path is broken from then on).
absl::Status UcxLane::WaitPending(const std::vector<Pending*>& ps) {
  const auto deadline = Clock::now() + config_.timeout;
  absl::Status result;
  for (Pending* p : ps) {
    if (UCS_PTR_IS_ERR(p->send)) {
      if (result.ok()) result = UcxError("send", UCS_PTR_STATUS(p->send));
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
  if (!Drive(all_done, deadline)) {
    for (Pending* p : ps) {
      if (p->send != nullptr && ucp_request_check_status(p->send) == UCS_INPROGRESS) ucp_request_cancel(worker_, p->send);
      if (p->recv != nullptr) ucp_request_cancel(worker_, p->recv);
    }
    const auto grace = Clock::now() + std::chrono::milliseconds(200);
    while (!all_done() && Clock::now() < grace) ucp_worker_progress(worker_);
    if (result.ok()) result = Lost();
    if (!all_done()) Abandon();
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

// Progresses until every request is done or the deadline passes (or the pool is gone); then
// cancels all that are left at once and gives them one grace period together (one each, in
// turn, made a gather of 96 one-sided gets take 19 s to fail against a killed pool), and
// abandons the lane if any is still held (a cancel does not reach gets: Abandon).
absl::Status UcxLane::WaitAll(const std::vector<ucs_status_ptr_t>& reqs) {
  const auto deadline = Clock::now() + config_.timeout;
  absl::Status result;
  std::vector<ucs_status_ptr_t> live;
  live.reserve(reqs.size());
  for (ucs_status_ptr_t r : reqs) {
    if (UCS_PTR_IS_ERR(r)) {
      if (result.ok()) result = UcxError("request", UCS_PTR_STATUS(r));
    } else if (r != nullptr) {  // nullptr: completed immediately
      live.push_back(r);
    }
  }
  size_t first_open = 0;  // requests before it are done (they complete in any order; checked in turn)
  auto all_done = [&] {
    while (first_open < live.size() && ucp_request_check_status(live[first_open]) != UCS_INPROGRESS) ++first_open;
    return first_open == live.size();
  };
  if (!Drive(all_done, deadline)) {
    for (ucs_status_ptr_t r : live) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(worker_, r);
    }
    first_open = 0;
    const auto grace = Clock::now() + std::chrono::milliseconds(200);
    while (!all_done() && Clock::now() < grace) ucp_worker_progress(worker_);
    if (result.ok()) result = Lost();
    if (!all_done()) Abandon();
  }
  for (ucs_status_ptr_t r : live) {
    const ucs_status_t st = ucp_request_check_status(r);
    if (st != UCS_OK && result.ok()) result = UcxError("request", st);
    // A request that ignored the cancel is leaked rather than freed under UCX's feet; the
    // path is broken from now on and makes no further requests.
    if (st != UCS_INPROGRESS) ucp_request_free(r);
  }
  return result;
}

}  // namespace dd::kvpool
