// The host side of a sparse cache's offloaded KV (docs/architecture.md, "The compute-backend
// seam"): the KV store's sequences, full chunks written as one [K | V] block per KV head,
// blocks landing in device memory, and a fork's copy of the blocks. It calls no kernel and names no backend: every device gets the same host-side
// logic, and SparseKvCache keeps only what lives in device memory and the attention plan.
//
// Landing: blocks gathered from the store into device slots, three ways.
//  - Where the host may write device memory (cpu), the store's transfer thread writes the
//    slots directly.
//  - Elsewhere, from a store whose blocks lie in host memory mapped into this process (a
//    shm:// pool, the in-process store's arena: KvStore::MappedRanges), the device gathers
//    them itself: the ranges are
//    registered with it once, and StartLanding enqueues Device::Gather on the urgent queue
//    (urgent priority) or the prefetch queue (background), after the compute queue's earlier
//    readers of those slots. No host copy, no transfer thread; FinishLanding has the compute
//    queue wait for the gather.
//  - Otherwise (a ucx:// store) the store writes the landing's host staging,
//    page-aligned memory registered (pinned) with the device, and FinishLanding moves the
//    blocks with one Device::Gather per destination buffer on the given queue, after the
//    compute queue's earlier readers of those slots, and makes the compute queue wait for it.
//    Where the device refuses to register the staging, a copy per block instead. But where
//    the device's memory is CUDA memory and the store's transport writes it itself
//    (MemoryCaps::transport_writes_device_memory and KvStore::WritesDeviceMemory: a ucx://
//    pool over one-sided gets, UCX with CUDA, $DD_UCX_GPUDIRECT=on), the store gathers
//    straight into the slots (GatherTo with DstMemory::kDevice), after
//    the host has waited for the compute queue's earlier readers of them (GPUDirect; no
//    staging, no device gather). After one such landing fails, staging from then on.
//
// Not thread-safe (the engine's thread); the store's transfer thread writes only into what a
// landing handed it until FinishLanding.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "decode-worker/model/model_config.h"
#include "kv-pool/client/kv_store.h"

namespace dd::engine {

class ChunkStore {
 public:
  // `store` and `device` outlive this. Without `device_gathers`, a store for host I/O only
  // (DensePrefixStore: writes and reads rows, lands nothing): it never registers the store's
  // memory with the device, which a second registration of the same memory would refuse (CUDA)
  // to the store that lands the blocks.
  // Blocks hold elements of `kv` (the caches' KV type).
  ChunkStore(const model::ModelConfig& config, int64_t chunk_tokens, kvpool::KvStore* store, backend::Device& device,
             bool device_gathers = true, KvDtype kv = KvDtype::kF32);
  ~ChunkStore();  // waits for the device's gathers, then unregisters the mapped ranges
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  kvpool::KvLayout layout() const { return {config_.n_layer, config_.n_head_kv, config_.head_dim, chunk_, kv_}; }
  KvDtype kv_dtype() const { return kv_; }
  // A sequence of the store. Also registers the store's mapped memory with the device here, at
  // admission, rather than at the first landing of a decode step (registering pins it: slow).
  absl::StatusOr<kvpool::SequenceId> Open();
  void Release(kvpool::SequenceId id) { (void)store_->Release(id); }
  absl::Status CommitPrefix(kvpool::SequenceId id, absl::Span<const uint64_t> keys, uint64_t owner) {
    return store_->CommitPrefix(id, keys, owner);
  }

  // Bytes of one block (one KV head of one chunk), and of one head's row in it.
  int64_t block_bytes() const { return layout().block_bytes(); }
  int64_t part_offset(kvpool::BlockPart p) const { return kvpool::PartOffset(layout(), p); }
  int64_t part_bytes(kvpool::BlockPart p) const { return kvpool::PartBytes(layout(), p); }
  int64_t head_bytes() const { return config_.head_dim * KvDtypeBytes(kv_); }
  // Blocks gathered so far (every landing's), and those of them the device gathered itself
  // from mapped host memory.
  int64_t fetched_chunks() const { return counts_.fetched; }
  // Of those, the ones whose V half alone moved (BlockPart::kValues).
  int64_t values_only_chunks() const { return counts_.values_only; }
  int64_t device_gathered_chunks() const { return counts_.device_gathered; }
  // Of the others, those moved by one device gather per buffer from registered staging.
  int64_t staged_gathered_chunks() const { return counts_.staged_gathered; }
  // Those the store's transport wrote into device memory itself (GPUDirect).
  int64_t direct_chunks() const { return counts_.direct; }
  // Host regions of the store's mapped memory registered with the device (tests).
  int64_t registered_regions() const { return static_cast<int64_t>(regions_.size()); }

  // Chunks [c0, c1) of `layer` from host rows k, v (n_head_kv × head_dim elements of the KV
  // type per position, from position c0 × chunk on): one block per KV head written to `id`.
  absl::Status WriteChunks(kvpool::SequenceId id, int64_t layer, int64_t c0, int64_t c1, const void* k,
                           const void* v);
  // Every block of `from` below chunks_per_layer[l] chunks of layer l, written to `to` (a fork),
  // read in gathers of up to 256 blocks.
  absl::Status CopyBlocks(kvpool::SequenceId from, kvpool::SequenceId to, absl::Span<const int64_t> chunks_per_layer);
  // Chunks [c0, c1) of `layer` of `handle` (e.g. a committed prefix), every KV head, as rows k
  // and v (n_head_kv × head_dim elements of the KV type per position from c0 × chunk on, as
  // bytes), read urgently.
  absl::Status ReadRows(kvpool::SequenceId handle, int64_t layer, int64_t c0, int64_t c1, std::vector<uint8_t>* k,
                        std::vector<uint8_t>* v);

  // A landing's host staging (see above). A copy starts without staging of its own (a
  // landing's staging is never shared); destroying or replacing it first waits for the
  // device's last read of it (`last_read`), then unregisters and unmaps it.
  class HostStaging {
   public:
    HostStaging() = default;
    HostStaging(const HostStaging&) {}
    HostStaging& operator=(const HostStaging&) { return *this; }  // keeps its own memory
    HostStaging(HostStaging&& o) noexcept { Take(o); }
    HostStaging& operator=(HostStaging&& o) noexcept;
    ~HostStaging() { Release(); }
    // At least `bytes`, registered with `device` where it takes it. INTERNAL if the memory
    // cannot be mapped.
    absl::Status Ensure(backend::Device& device, int64_t bytes);
    uint8_t* data() const { return static_cast<uint8_t*>(data_); }
    int64_t bytes() const { return bytes_; }
    bool registered() const { return registered_; }
    const backend::HostRegion& region() const { return region_; }
    backend::Event last_read;  // the device's last read of it (a copy or gather)

   private:
    void Take(HostStaging& o);
    void Release();
    backend::Device* device_ = nullptr;
    void* data_ = nullptr;
    int64_t bytes_ = 0;
    backend::HostRegion region_;
    bool registered_ = false;
  };

  // Where a block lands: a device buffer and a byte offset in it.
  struct BlockDst {
    backend::DeviceBuffer buf;
    int64_t offset = 0;
  };
  struct Landing {
    kvpool::TransferId tid = 0;
    bool pending = false;        // started, not finished
    HostStaging staging;         // host-invisible devices without a mapped store: where the store writes
    std::vector<BlockDst> dsts;
    backend::Event copied;       // staging's copies (the staging is reused only after them), or the gather's
    bool on_device = false;      // the device gathers it from mapped host memory
    bool direct = false;         // the store writes device memory itself (DstMemory::kDevice)
    kvpool::BlockPart part = kvpool::BlockPart::kWhole;  // what of each block moves
  };
  // Starts gathering `refs` of sequence `id` into `dsts` (one each, where the whole block
  // goes) at `priority`. With `part` kValues only each block's V half moves, into the V half of
  // its destination; the K half there is left as it is.
  absl::Status StartLanding(kvpool::SequenceId id, absl::Span<const kvpool::ChunkRef> refs, std::vector<BlockDst> dsts,
                            kvpool::Priority priority, Landing* l,
                            kvpool::BlockPart part = kvpool::BlockPart::kWhole);
  // Waits for the store's transfer; on a host-invisible device copies the blocks over on `q`
  // (or, gathered by the device, has nothing to copy) and has the compute queue wait for them.
  // Nothing to do when not pending.
  absl::Status FinishLanding(Landing& l, backend::Queue q);
  // Waits for the device's gathers, then unregisters the store's mapped memory: before the
  // store's Recover unmaps it (the next landing registers the new mapping).
  void ForgetMappings();
  // Fault injection for the tests that show a missing wait is caught (on the sim device):
  // every landing of the process leaves out the compute queue's wait for its copies.
  static void SkipComputeWaitForTesting(bool skip);

 private:
  const model::ModelConfig& config_;
  const int64_t chunk_;
  kvpool::KvStore* store_;
  backend::Device& device_;
  // Whether landings are device gathers: the store's mapped ranges, registered with the device
  // at the first call after construction or ForgetMappings and again, the new ones only, when
  // the store's MappingGeneration changes (one atomic load per landing: no lock, no list). A
  // mapping the device refuses to register is logged once and not tried again before the next
  // ForgetMappings: its landings go through host staging.
  bool DeviceGathers();
  absl::Status StartDeviceGather(kvpool::SequenceId id, absl::Span<const kvpool::ChunkRef> refs,
                                 const std::vector<BlockDst>& dsts, kvpool::Priority priority, Landing* l);
  // Blocks landed and their bytes.
  void Landed(int64_t blocks, kvpool::BlockPart part);

  const backend::MemoryCaps caps_;  // the device's, read once
  const bool device_gathers_;       // false: host I/O only, nothing registered
  const KvDtype kv_;
  struct Counts {  // blocks landed: all, gathered by the device, moved from staging, written directly
    int64_t fetched = 0, device_gathered = 0, staged_gathered = 0, direct = 0, values_only = 0;
  };
  Counts counts_;
  bool direct_off_ = false;  // a direct landing failed: staging from then on
  // Turns direct landings off (logged once) and returns `st`.
  absl::Status DirectFailed(const absl::Status& st);
  // KvStore::MappingGeneration (>= 0) whose ranges are registered; kUnchecked before the first
  // look and after ForgetMappings.
  static constexpr int64_t kUnchecked = -1;
  int64_t generation_ = kUnchecked;
  bool refused_ = false;                            // the device refused a range: staging until ForgetMappings
  std::vector<backend::HostRegion> regions_;        // its ranges, registered, by base address
  std::vector<const void*> addrs_;                  // a gather's block addresses
  std::vector<int> ranges_;                         // the index in regions_ of each (-1: none)
  std::vector<backend::GatherBlock> gather_;        // one Device::Gather call's blocks
  std::vector<uint8_t> block_;      // one [K | V] block being written
};

}  // namespace dd::engine
