#include "kv-pool/server/ucx_server.h"

#include <ucp/api/ucp.h>

#include "absl/strings/str_cat.h"

namespace dd::kvpool {

struct UcxServer::Impl {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<ucp_mem_h> memh;
};

absl::StatusOr<std::unique_ptr<UcxServer>> UcxServer::Create() {
  std::unique_ptr<UcxServer> s(new UcxServer());
  s->impl_ = std::make_unique<Impl>();
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  ucp_config_t* config = nullptr;
  if (ucs_status_t st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_config_read: ", ucs_status_string(st)));
  }
  ucs_status_t st = ucp_init(&params, config, &s->impl_->context);
  ucp_config_release(config);
  if (st != UCS_OK) return absl::InternalError(absl::StrCat("ucp_init: ", ucs_status_string(st)));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it (signal is safe)
  if ((st = ucp_worker_create(s->impl_->context, &wp, &s->impl_->worker)) != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_create: ", ucs_status_string(st)));
  }
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  if ((st = ucp_worker_get_address(s->impl_->worker, &addr, &len)) != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_get_address: ", ucs_status_string(st)));
  }
  s->address_.assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(s->impl_->worker, addr);
  return s;
}

absl::StatusOr<std::string> UcxServer::Register(void* base, size_t bytes) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = bytes;
  ucp_mem_h memh = nullptr;
  if (ucs_status_t st = ucp_mem_map(impl_->context, &mp, &memh); st != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_mem_map of ", bytes, " bytes: ", ucs_status_string(st)));
  }
  impl_->memh.push_back(memh);
  void* rkey = nullptr;
  size_t len = 0;
  if (ucs_status_t st = ucp_rkey_pack(impl_->context, memh, &rkey, &len); st != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_rkey_pack: ", ucs_status_string(st)));
  }
  std::string packed(static_cast<const char*>(rkey), len);
  ucp_rkey_buffer_release(rkey);
  return packed;
}

void UcxServer::Start() {
  thread_ = std::thread([this] { Progress(); });
}

void UcxServer::Progress() {
  while (!stop_.load(std::memory_order_acquire)) {
    while (ucp_worker_progress(impl_->worker) != 0) {
    }
    const ucs_status_t st = ucp_worker_arm(impl_->worker);
    if (st == UCS_ERR_BUSY) continue;  // more events arrived meanwhile
    if (stop_.load(std::memory_order_acquire)) break;
    ucp_worker_wait(impl_->worker);
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
