// UCX data path: one UCP context, worker and endpoint per store, to the pool's worker address;
// puts and gets against the tenant region's remote key. Every wait has a deadline: a request
// not done by then is cancelled and the path reports UNAVAILABLE (the endpoint runs in peer
// error-handling mode, so a dead pool surfaces as an error rather than an abort).
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kv-pool/client/data_path.h"

namespace dd::kvpool {
namespace {

using Clock = std::chrono::steady_clock;

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

  absl::Status Init(const v1::HandshakeResponse& hs) {
    if (hs.ucx_worker_address().empty() || hs.ucx_rkey().empty()) {
      return absl::FailedPreconditionError("the kv pool runs without UCX (start it with --ucx)");
    }
    base_ = hs.remote_base();
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA;
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
      // pool cannot stall a get (the segment stays mapped), so connect without it. Our
      // deadlines and the lease renewal still bound every wait.
      ep.field_mask &= ~(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      if ((st = ucp_ep_create(worker_, &ep, &ep_)) != UCS_OK) return Error("ucp_ep_create", st);
    }
    if ((st = ucp_ep_rkey_unpack(ep_, hs.ucx_rkey().data(), &rkey_)) != UCS_OK) return Error("ucp_ep_rkey_unpack", st);
    return absl::OkStatus();
  }

  absl::Status Put(int64_t offset, const void* src, int64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
    ucp_request_param_t p{};
    absl::Status st = WaitAll({ucp_put_nbx(ep_, src, bytes, base_ + offset, rkey_, &p)});
    dirty_ = true;
    return Keep(st);
  }

  absl::Status Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<float* const> dsts) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.ok()) return broken_;
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

 private:
  // UCX_TLS names only shared-memory transports (sm, posix, sysv, cma, self).
  static bool SharedMemoryOnly() {
    const char* tls = std::getenv("UCX_TLS");
    if (tls == nullptr || *tls == '\0') return false;
    for (absl::string_view t : absl::StrSplit(tls, ',')) {
      if (t != "sm" && t != "shm" && t != "posix" && t != "sysv" && t != "cma" && t != "self") return false;
    }
    return true;
  }
  static absl::Status Error(const char* what, ucs_status_t st) {
    return absl::UnavailableError(absl::StrCat("kv pool ucx: ", what, ": ", ucs_status_string(st)));
  }
  absl::Status Keep(absl::Status st) {
    if (!st.ok()) broken_ = st;
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
  ucp_rkey_h rkey_ = nullptr;
  uint64_t base_ = 0;
  bool dirty_ = false;
  bool peer_failed_ = false;  // set by UCX's error callback (from ucp_worker_progress)
  absl::Status broken_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DataPath>> NewUcxDataPath(const v1::HandshakeResponse& hs, int64_t timeout_ms) {
  auto path = std::make_unique<UcxDataPath>(timeout_ms);
  if (absl::Status st = path->Init(hs); !st.ok()) return st;
  return path;
}

}  // namespace dd::kvpool
