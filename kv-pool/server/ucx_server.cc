#include "kv-pool/server/ucx_server.h"

#include <poll.h>
#include <sched.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/client/ucx_protocol.h"
#include "kv-pool/server/reply_queue.h"
#include "kv-pool/server/ucx_requests.h"

namespace dd::kvpool {

using namespace ucxproto;  // NOLINT(build/namespaces): the wire structs

struct UcxServer::Impl {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<ucp_mem_h> memh;
  UcxServer* server = nullptr;
  int efd = -1;          // the worker's event fd
  int64_t in_flight = 0;  // replies UCX has not finished sending (progress thread only)
  int64_t eager_max = 0;  // the largest reply sent eager when asked (UcxEagerReplyBytes; 0 without tcp)
  std::vector<Piece> get_pieces;  // CheckGet's output, kept for its capacity (progress thread only)

  // A reply in flight: its header and iov live until UCX is done with them.
  struct Outgoing {
    Reply reply;
    std::vector<ucp_dt_iov_t> iov;     // the blocks where they lie in the region, or
    std::unique_ptr<uint8_t[]> packed;  // copied together (kPackReply)
    size_t packed_bytes = 0;
    ucp_dt_iov_t contiguous{nullptr, 0};  // or, when they lie together, straight from the region
    bool pack = false;                    // to be packed when it is sent
    bool eager = false;                   // sent as one eager message (kEagerReply)
    uint64_t ticket = 0;                  // a reply with blocks: its place in `replies`
    ucp_ep_h ep = nullptr;
    Impl* impl = nullptr;
  };
  // A rendezvous put being received into the region; answered when it lands.
  struct Landing {
    Impl* impl;
    ucp_ep_h ep;
    uint64_t id;
  };
  // Replies with blocks wait their turn here (reply_queue.h): two in flight at a time, one per
  // endpoint, endpoints in turn, bounded per endpoint; and per tenant, however many endpoints it
  // opens, replies waiting for at most 1M blocks between them (their iovs, ~16 MiB) and packed
  // copies in flight (stalled ones included) of at most 256 MiB (one is always let through).
  ReplyQueue<std::unique_ptr<Outgoing>> replies{{.per_owner_bytes = int64_t{256} << 20, .per_owner_queued = 1 << 20}};

  // The copies replies in flight hold, for the metrics (progress thread writes).
  void CountHeld() { server->counters_.reply_bytes_held.store(replies.bytes_in_flight(), std::memory_order_relaxed); }

  // Sends the replies whose turn it is (progress thread).
  void Pump() {
    if (replies.queued() == 0) return;  // the common case, without reading the clock
    while (auto next = replies.Next(std::chrono::steady_clock::now())) {
      std::unique_ptr<Outgoing> out = std::move(next->item);
      out->ticket = next->ticket;
      if (out->pack) {  // packed only now, so a waiting reply holds no copy
        out->packed.reset(new uint8_t[out->packed_bytes]);
        uint8_t* at = out->packed.get();
        for (const ucp_dt_iov_t& piece : out->iov) {
          std::memcpy(at, piece.buffer, piece.length);
          at += piece.length;
        }
        out->iov.clear();
      }
      ucp_ep_h ep = out->ep;
      Send(ep, std::move(out));
    }
    CountHeld();
  }

  // The tenant a session belongs to, or -1.
  int TenantOf(const uint8_t* session) {
    std::lock_guard<std::mutex> lock(server->mu_);
    auto it = server->sessions_.find(std::string(reinterpret_cast<const char*>(session), kSessionBytes));
    return it == server->sessions_.end() ? -1 : it->second;
  }

  // Sends `out` (header, then the blocks as an iov or packed, if any) to `ep`; frees it when UCX is done.
  void Send(ucp_ep_h ep, std::unique_ptr<Outgoing> out) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    const bool eager = out->eager;
    if (eager) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_AM_SEND_FLAG_EAGER;
    }
    if (!out->iov.empty()) {  // a bare answer has no data (UCX wants no iov then)
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      p.datatype = ucp_dt_make_iov();
    }
    const void* buffer = nullptr;
    size_t count = 0;
    if (out->packed != nullptr) {
      buffer = out->packed.get();
      count = out->packed_bytes;
    } else if (out->contiguous.buffer != nullptr) {
      buffer = out->contiguous.buffer;
      count = out->contiguous.length;
    } else if (!out->iov.empty()) {
      buffer = out->iov.data();
      count = out->iov.size();
    }
    p.cb.send = [](void* req, ucs_status_t, void* user) {
      auto* o = static_cast<Outgoing*>(user);
      --o->impl->in_flight;
      if (o->ticket != 0) {
        o->impl->replies.Done(o->ticket);
        o->impl->CountHeld();
      }
      delete o;
      ucp_request_free(req);
    };
    Outgoing* o = out.release();
    o->impl = this;
    p.user_data = o;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, kReplyId, &o->reply, sizeof(Reply), buffer, count, &p);
    if (eager && !UCS_PTR_IS_ERR(r)) server->counters_.eager_replies.fetch_add(1, std::memory_order_relaxed);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      if (o->ticket != 0) replies.Done(o->ticket);
      delete o;  // done at once (no callback) or failed
    } else {
      ++in_flight;
    }
  }

  void Answer(ucp_ep_h ep, uint64_t id, absl::StatusCode code) {
    auto out = std::make_unique<Outgoing>();
    out->reply.id = id;
    out->reply.code = static_cast<int32_t>(code);
    if (code != absl::StatusCode::kOk) server->counters_.refused.fetch_add(1, std::memory_order_relaxed);
    Send(ep, std::move(out));
  }

  static bool Rndv(const ucp_am_recv_param_t* param) { return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0; }

  // A handler that returns UCS_OK without receiving rendezvous data drops it (UCX releases the
  // descriptor and tells the sender). It must not also call ucp_am_data_release: UCX then
  // released it twice, and the first refused rendezvous request crashed the pool over shared
  // memory (ucx_isolation_test RefusedRendezvousRequestsLeaveThePoolServing). Gets must come
  // eager (a rendezvous get is refused, its offsets dropped); a refused put's data is dropped.

  static ucs_status_t OnGet(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    UcxServer& s = *self->server;
    if (header_length != sizeof(GetRequest) || param->reply_ep == nullptr) {
      s.counters_.refused.fetch_add(1, std::memory_order_relaxed);
      return UCS_OK;  // nothing to answer to
    }
    GetRequest req;
    std::memcpy(&req, header, sizeof(req));
    if (req.magic != kMagic) return self->Answer(param->reply_ep, req.id, absl::StatusCode::kInvalidArgument), UCS_OK;
    const int t = self->TenantOf(req.session);
    if (t < 0) return self->Answer(param->reply_ep, req.id, absl::StatusCode::kUnauthenticated), UCS_OK;
    const UcxRegion& region = s.regions_[t];
    std::vector<Piece>& pieces = self->get_pieces;
    const absl::StatusCode checked =
        Rndv(param) ? absl::StatusCode::kInvalidArgument : CheckGet(req, data, length, region.bytes, &pieces);
    if (checked != absl::StatusCode::kOk) return self->Answer(param->reply_ep, req.id, checked), UCS_OK;
    auto out = std::make_unique<Outgoing>();
    out->reply.id = req.id;
    out->iov.reserve(pieces.size());
    for (const Piece& p : pieces) out->iov.push_back({region.base + p.offset, static_cast<size_t>(p.bytes)});
    // An eager reply is packed too: UCX 1.13's eager path over an iov of many blocks is not safe
    // (its multi-fragment iov send asserted, killing the pool, in a trial;
    // docs/decisions/0022-ucx-replies.md).
    const bool pack = (req.flags & (kPackReply | kEagerReply)) != 0;
    // Eager only as large as a tcp segment holds: a larger eager reply would be cut into fragments
    // by UCX and reassembled by the worker, and over shared memory copied through the FIFO by the
    // pool's thread alone; those go by rendezvous instead, whatever the worker asked.
    out->eager = (req.flags & kEagerReply) != 0 && req.count * req.block_bytes <= self->eager_max;
    if (pack && out->iov.size() == 1) {  // one piece: contiguous as it lies
      out->contiguous = out->iov[0];
      out->iov.clear();
    } else if (pack) {
      out->pack = true;
      out->packed_bytes = static_cast<size_t>(req.count) * req.block_bytes;
    }
    out->ep = param->reply_ep;
    const int64_t copy = out->pack ? static_cast<int64_t>(out->packed_bytes) : 0;  // what it will hold in flight
    if (!self->replies.Push(param->reply_ep, std::move(out), {t, copy, req.count})) {  // too many waiting here, or for t
      return self->Answer(param->reply_ep, req.id, absl::StatusCode::kResourceExhausted), UCS_OK;
    }
    s.counters_.gets.fetch_add(1, std::memory_order_relaxed);
    s.counters_.get_blocks.fetch_add(req.count, std::memory_order_relaxed);
    s.counters_.get_bytes.fetch_add(req.count * req.block_bytes, std::memory_order_relaxed);
    self->Pump();
    return UCS_OK;
  }

  static ucs_status_t OnPut(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    UcxServer& s = *self->server;
    auto refuse = [&](uint64_t id, absl::StatusCode code) {
      if (param->reply_ep != nullptr) self->Answer(param->reply_ep, id, code);
      return UCS_OK;
    };
    if (header_length != sizeof(PutRequest) || param->reply_ep == nullptr) {
      s.counters_.refused.fetch_add(1, std::memory_order_relaxed);
      return UCS_OK;
    }
    PutRequest req;
    std::memcpy(&req, header, sizeof(req));
    if (req.magic != kMagic) return refuse(req.id, absl::StatusCode::kInvalidArgument);
    const int t = self->TenantOf(req.session);
    if (t < 0) return refuse(req.id, absl::StatusCode::kUnauthenticated);
    const UcxRegion& region = s.regions_[t];
    if (const absl::StatusCode c = CheckPut(req, length, region.bytes); c != absl::StatusCode::kOk) {
      return refuse(req.id, c);
    }
    s.counters_.puts.fetch_add(1, std::memory_order_relaxed);
    s.counters_.put_bytes.fetch_add(req.bytes, std::memory_order_relaxed);
    if (!Rndv(param)) {
      std::memcpy(region.base + req.offset, data, length);
      self->Answer(param->reply_ep, req.id, absl::StatusCode::kOk);
      return UCS_OK;
    }
    auto* landing = new Landing{self, param->reply_ep, req.id};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.user_data = landing;
    p.cb.recv_am = [](void* r, ucs_status_t st, size_t, void* user) {
      std::unique_ptr<Landing> l(static_cast<Landing*>(user));
      l->impl->Answer(l->ep, l->id, st == UCS_OK ? absl::StatusCode::kOk : absl::StatusCode::kUnavailable);
      ucp_request_free(r);
    };
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker, data, region.base + req.offset, length, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {  // landed at once (no callback) or failed
      self->Answer(landing->ep, landing->id, r == nullptr ? absl::StatusCode::kOk : absl::StatusCode::kUnavailable);
      delete landing;
    }
    return UCS_OK;
  }
};

absl::StatusOr<std::unique_ptr<UcxServer>> UcxServer::Create(std::vector<UcxRegion> regions, UcxServerOptions options) {
  std::unique_ptr<UcxServer> s(new UcxServer());
  s->impl_ = std::make_unique<Impl>();
  s->impl_->server = s.get();
  s->impl_->eager_max = options.tcp ? UcxEagerReplyBytes() : 0;
  s->regions_ = std::move(regions);
  s->options_ = options;
  s->session_order_.resize(s->regions_.size());
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  // Without `rma` the context has no RMA feature, so UCX installs no handler that would serve a
  // software-emulated get or put against a forged key.
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (options.rma ? UCP_FEATURE_RMA : 0);
  absl::StatusOr<ucp_config_t*> config = ReadUcxConfig(options.tcp);
  if (!config.ok()) return config.status();
  s->shm_settings_ = UcxSharedMemorySettings();
  s->tcp_settings_ = options.tcp ? UcxTcpSettings() : std::string(kNoTcp);
  ucs_status_t st = ucp_init(&params, *config, &s->impl_->context);
  ucp_config_release(*config);
  if (st != UCS_OK) return absl::InternalError(absl::StrCat("ucp_init: ", ucs_status_string(st)));
  if (!options.tcp && UcxContextHasTcp(s->impl_->context)) {  // fail closed, whatever UCX_TLS said
    return absl::FailedPreconditionError(
        "UCX loaded its tcp transport although --ucx_tcp is off (check UCX_TLS and UCX's config files)");
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it (signal is safe)
  if ((st = ucp_worker_create(s->impl_->context, &wp, &s->impl_->worker)) != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_create: ", ucs_status_string(st)));
  }
  for (auto [id, cb] : {std::pair{kGetId, &Impl::OnGet}, std::pair{kPutId, &Impl::OnPut}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = s->impl_.get();
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    if ((st = ucp_worker_set_am_recv_handler(s->impl_->worker, &hp)) != UCS_OK) {
      return absl::InternalError(absl::StrCat("ucp_worker_set_am_recv_handler: ", ucs_status_string(st)));
    }
  }
  if (ucp_worker_get_efd(s->impl_->worker, &s->impl_->efd) != UCS_OK) s->impl_->efd = -1;
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  if ((st = ucp_worker_get_address(s->impl_->worker, &addr, &len)) != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_get_address: ", ucs_status_string(st)));
  }
  s->address_.assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(s->impl_->worker, addr);
  s->rkeys_.resize(s->regions_.size());
  if (!options.rma) return s;
  for (size_t t = 0; t < s->regions_.size(); ++t) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = s->regions_[t].base;
    mp.length = s->regions_[t].bytes;
    ucp_mem_h memh = nullptr;
    if ((st = ucp_mem_map(s->impl_->context, &mp, &memh)) != UCS_OK) {
      return absl::InternalError(absl::StrCat("ucp_mem_map of ", mp.length, " bytes: ", ucs_status_string(st)));
    }
    s->impl_->memh.push_back(memh);
    void* rkey = nullptr;
    size_t rlen = 0;
    if ((st = ucp_rkey_pack(s->impl_->context, memh, &rkey, &rlen)) != UCS_OK) {
      return absl::InternalError(absl::StrCat("ucp_rkey_pack: ", ucs_status_string(st)));
    }
    s->rkeys_[t].assign(static_cast<const char*>(rkey), rlen);
    ucp_rkey_buffer_release(rkey);
  }
  return s;
}

std::string UcxServer::NewSession(int t) {
  std::string session;
  while (session.size() < static_cast<size_t>(kSessionBytes)) {
    const uint64_t r = RandomU64();
    session.append(reinterpret_cast<const char*>(&r), sizeof(r));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::deque<std::string>& order = session_order_[t];
  if (order.size() >= kMaxSessionsPerTenant) {
    sessions_.erase(order.front());
    order.pop_front();
  }
  sessions_[session] = t;
  order.push_back(session);
  return session;
}

void UcxServer::Start() {
  thread_ = std::thread([this] { Progress(); });
}

// Progresses the worker until stopped. Between bursts it sleeps on the worker's event fd
// (unless busy_poll); while replies are still being sent it wakes at least every 200 µs, a
// safeguard: a send stalled on a full shared-memory FIFO need not raise an event when the
// receiver drains it. While spinning it yields the core every 16 idle polls (spin_yield).
void UcxServer::Progress() {
  const auto spin = std::chrono::microseconds(options_.spin_us);
  unsigned idle_polls = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    do {
      impl_->Pump();  // replies whose turn came (a send finished, or one in flight stalled)
    } while (ucp_worker_progress(impl_->worker) != 0);
    if (options_.busy_poll) {
      if (options_.spin_yield && ++idle_polls % 16 == 0) sched_yield();
      continue;
    }
    if (spin.count() > 0) {  // the next message of a rendezvous often follows within µs
      const auto until = std::chrono::steady_clock::now() + spin;
      bool more = false;
      for (unsigned n = 1; !more; ++n) {
        more = ucp_worker_progress(impl_->worker) != 0;
        if (n % 16 != 0) continue;
        if (std::chrono::steady_clock::now() > until) break;
        // Two gatherers and this thread on 2 cores: without the yield a spinning thread kept a
        // core the others waited for (two gatherers over sm 1.1-4.4 GB/s, p99 4-12.5 ms; with
        // it 1.9-7.3 GB/s, p99 0.15-3.0 ms; docs/decisions/0023-ucx-progress-and-waiting.md).
        if (options_.spin_yield) sched_yield();
      }
      if (more) continue;
    }
    const ucs_status_t st = ucp_worker_arm(impl_->worker);
    if (st == UCS_ERR_BUSY) continue;  // more events arrived meanwhile
    if (stop_.load(std::memory_order_acquire)) break;
    if (impl_->efd < 0) {
      ucp_worker_wait(impl_->worker);
      continue;
    }
    pollfd p{impl_->efd, POLLIN, 0};
    const timespec bound{0, 200 * 1000};
    (void)ppoll(&p, 1, impl_->in_flight > 0 ? &bound : nullptr, nullptr);
  }
}

UcxServer::~UcxServer() {
  if (thread_.joinable()) {
    stop_.store(true, std::memory_order_release);
    ucp_worker_signal(impl_->worker);
    thread_.join();
  }
  if (!impl_) return;
  for (ucp_mem_h m : impl_->memh) ucp_mem_unmap(impl_->context, m);
  if (impl_->worker != nullptr) ucp_worker_destroy(impl_->worker);
  if (impl_->context != nullptr) ucp_cleanup(impl_->context);
}

}  // namespace dd::kvpool
