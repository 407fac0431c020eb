// The compute-backend seam, device half: memory, queues, events, copies and gathers of one
// compute device, in plain C++ (no CUDA types), so the engine is written once for every
// backend (docs/architecture.md, "The compute-backend seam").
//
//   cpu   device memory is host memory counted against the budget; every queue runs its work
//         inline on the calling thread, so an event is complete when it is recorded.
//   sim   a simulated device that runs queues on threads and checks every wait.
//   cuda  one allocation of the budget, streams with priorities, CUDA events
//         (kernels/cuda/cuda_device.h).
//
// Ownership: a DeviceBuffer is owned by whoever allocated it and must be freed (Free) before
// the Device is destroyed. Host regions stay registered until unregistered; the caller keeps
// their memory alive until then. Thread-compatible: one engine thread drives a Device.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace dd::backend {

class Ops;

// What device memory is for. The allocator's per-tag totals are what the engine's memory plan
// projects, tag by tag.
enum class MemoryTag : int {
  kWeights = 0,
  kWorkspace,      // activations, logits, scratch of the forward pass
  kKv,             // dense KV: full-mode layers, sliding windows, sinks, windows of sparse layers
  kLandmarks,      // one key vector per (layer, KV head, chunk)
  kResidentSlots,  // chunks kept resident across steps (sparse-cached, dualdecoder)
  kLowRankKeys,    // low-rank key caches: a basis and per-position coefficients per sparse layer
  kCount,
};
absl::string_view MemoryTagName(MemoryTag tag);

// Queues in priority order: work on a higher-priority queue is started before queued work of a
// lower one (on backends that run queues concurrently).
enum class Queue : int {
  kUrgent = 0,  // gathers of mispredicted chunks the current layer waits for
  kCompute,     // the forward pass
  kPrefetch,    // gathers of predicted chunks
  kWriteBack,   // offload of full chunks and landmarks to the KV store
  kCount,
};
absl::string_view QueueName(Queue q);

// Device memory. `data` is a device address: the host may dereference it only on backends
// whose device memory is host memory (cpu); engine code passes it to ops and copies only.
struct DeviceBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
  MemoryTag tag = MemoryTag::kWorkspace;
  explicit operator bool() const { return data != nullptr; }
};

// Completion of everything submitted to one queue before it was recorded.
struct Event {
  Queue queue = Queue::kCompute;
  uint64_t seq = 0;  // 0: no event (already complete)
};

// A host memory region the device may read (pinned staging, a KV pool's mapped region).
struct HostRegion {
  int64_t id = -1;
  const void* base = nullptr;
  int64_t bytes = 0;
};

// One block copy of a gather: `bytes` from region offset `src` to buffer offset `dst`.
struct GatherBlock {
  int64_t src = 0;
  int64_t dst = 0;
};

// What a device's memory is (Device::caps).
struct MemoryCaps {
  // The host may read and write device memory in place (the cpu device's is host memory): a
  // result needs no copy to be read, and a store's transfer thread may write device slots.
  bool host_reads_device_memory = false;
  // Buffers are memory at their `data` addresses that a transport library may write itself
  // when told so (CUDA memory, which UCX with CUDA support writes by GPUDirect RDMA or its CUDA
  // copy: KvStore::WritesDeviceMemory).
  bool transport_writes_device_memory = false;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual absl::string_view name() const = 0;
  // What the device's memory is, fixed for the device's life: callers read it once, where they
  // pick a data path (ChunkStore's landing, Transformer's logits), not per call.
  virtual MemoryCaps caps() const = 0;
  // For reading a device result on the host: where the host reads device memory in place
  // (caps().host_reads_device_memory), the address of `bytes` of `src` at `offset`; elsewhere
  // `staging` (at least `bytes`), into which a copy is enqueued on `q`. Either way readable once
  // an event recorded on `q` after this call is complete.
  [[nodiscard]] absl::StatusOr<const void*> ReadOnHost(Queue q, const DeviceBuffer& src, int64_t offset,
                                                       int64_t bytes, void* staging) {
    if (caps().host_reads_device_memory) {
      if (offset < 0 || bytes < 0 || offset > src.bytes || bytes > src.bytes - offset) {
        return absl::InvalidArgumentError(absl::StrCat("read of ", bytes, " bytes at ", offset, " outside a buffer of ",
                                                       src.bytes));
      }
      return static_cast<const char*>(src.data) + offset;
    }
    if (absl::Status st = CopyToHost(q, src, offset, staging, bytes); !st.ok()) return st;
    return static_cast<const void*>(staging);
  }

  // ---- memory ----
  // `bytes` of device memory for `tag`, 64-byte aligned, contents unspecified.
  // RESOURCE_EXHAUSTED naming the tag and the figures when the budget would be exceeded;
  // INVALID_ARGUMENT for a negative size.
  [[nodiscard]] virtual absl::StatusOr<DeviceBuffer> Allocate(MemoryTag tag, int64_t bytes) = 0;
  // Returns the buffer's bytes to the budget; `buf` becomes empty. No queue may still use it.
  virtual void Free(DeviceBuffer& buf) = 0;
  // Budget in bytes (0 = unlimited), bytes allocated per tag and in all.
  virtual int64_t budget() const = 0;
  virtual int64_t bytes_in_use(MemoryTag tag) const = 0;
  virtual int64_t bytes_in_use() const = 0;
  // A buffer for `tag` holding the `bytes` at host address `src`, complete when it returns:
  // how weights reach the device. The caller keeps `src` alive and unchanged while the buffer
  // lives; a backend whose device memory is host memory uses it in place (cpu). The bytes
  // count against the budget either way; Free returns them.
  [[nodiscard]] virtual absl::StatusOr<DeviceBuffer> Upload(MemoryTag tag, const void* src, int64_t bytes) = 0;

  // ---- ordering ----
  // Marks the point after everything submitted to `q` so far.
  virtual Event Record(Queue q) = 0;
  // Work submitted to `q` from now on starts after `e` is complete.
  virtual void Wait(Queue q, const Event& e) = 0;
  // Blocks the host until `e` is complete; the error of a failed piece of work, if any.
  [[nodiscard]] virtual absl::Status Synchronize(const Event& e) = 0;

  // ---- copies ----
  // Enqueued on `q`: the host memory must stay unchanged (ToDevice) or unread (ToHost) until
  // an event recorded after the copy is complete. Offsets and sizes are checked against the
  // buffer (INVALID_ARGUMENT, nothing copied).
  [[nodiscard]] virtual absl::Status CopyToDevice(Queue q, const void* src, const DeviceBuffer& dst,
                                                  int64_t dst_offset, int64_t bytes) = 0;
  [[nodiscard]] virtual absl::Status CopyToHost(Queue q, const DeviceBuffer& src, int64_t src_offset, void* dst,
                                                int64_t bytes) = 0;

  // Enqueued on `q`: `bytes` from `src` at `src_offset` to `dst` at `dst_offset`, both device
  // buffers. Ranges are checked (INVALID_ARGUMENT, nothing copied), and must not overlap.
  [[nodiscard]] virtual absl::Status Copy(Queue q, const DeviceBuffer& src, int64_t src_offset,
                                          const DeviceBuffer& dst, int64_t dst_offset, int64_t bytes) = 0;

  // ---- host regions and gathers ----
  [[nodiscard]] virtual absl::StatusOr<HostRegion> RegisterHostRegion(const void* base, int64_t bytes) = 0;
  virtual void UnregisterHostRegion(const HostRegion& region) = 0;
  // Enqueued on `q`: each block copies `block_bytes` from `region` at `src` into `dst` at
  // `dst`. Every block is checked against the region and the buffer first (INVALID_ARGUMENT
  // naming the block, nothing copied).
  [[nodiscard]] virtual absl::Status Gather(Queue q, const HostRegion& region, absl::Span<const GatherBlock> blocks,
                                            int64_t block_bytes, const DeviceBuffer& dst) = 0;

  // The forward pass's operations on this device; they run on Queue::kCompute.
  virtual Ops& ops() = 0;
};

}  // namespace dd::backend
