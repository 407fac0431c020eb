// How a pool client moves block bytes (internal to kv-pool/client): the shared-memory path
// maps the tenant's region and copies; the UCX path sends active messages the pool answers
// from the tenant's region (or, against a pool run with --ucx_rma, does one-sided puts and
// gets). Offsets are bytes into the tenant's region. Implementations serialize their own calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv-pool/client/pool_kv_store.h"
#include "proto/kvpool.pb.h"

namespace dd::kvpool {

class DataPath {
 public:
  virtual ~DataPath() = default;
  virtual absl::Status Put(int64_t offset, const void* src, int64_t bytes) = 0;
  // Reads `block_bytes` at offsets[i] into dsts[i] (CUDA device memory when `cuda`: only where
  // cuda_destinations()). Synchronous; called from the transfer thread. Fails (never hangs past
  // `timeout_ms`) when the pool is gone.
  virtual absl::Status Get(absl::Span<const int64_t> offsets, int64_t block_bytes, absl::Span<void* const> dsts,
                           bool cuda = false) = 0;
  // For the shared-memory path: the mapped address of `offset` (gathers then copy directly).
  virtual const uint8_t* Mapped(int64_t offset) const { return nullptr; }
  // The mapped region's size in bytes (0: nothing mapped).
  virtual int64_t mapped_bytes() const { return 0; }
  // Whether Get may be given CUDA device memory as destinations (KvStore::WritesDeviceMemory).
  virtual bool cuda_destinations() const { return false; }
  // Raised by the store when it learns the pool is gone: waits in progress give up at once.
  void set_abort(const std::atomic<bool>* flag) { abort_ = flag; }

 protected:
  bool aborted() const { return abort_ != nullptr && abort_->load(std::memory_order_acquire); }
  const std::atomic<bool>* abort_ = nullptr;
};

// Receives the region's descriptor from the pool's socket (hs.fd_socket), showing `token`.
absl::StatusOr<std::unique_ptr<DataPath>> NewShmDataPath(const v1::HandshakeResponse& hs, const std::string& token);
// `pool_is_local`: the pool's address names this host (loopback or its hostname).
absl::StatusOr<std::unique_ptr<DataPath>> NewUcxDataPath(const v1::HandshakeResponse& hs, int64_t timeout_ms,
                                                         UcxPath mode, bool pool_is_local);

}  // namespace dd::kvpool
