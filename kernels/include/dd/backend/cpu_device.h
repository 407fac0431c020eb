// The `cpu` backend: device memory is host memory counted against the budget, every queue runs
// its work inline on the calling thread (so an event is complete once recorded), and the ops
// are the reference kernels of cpu_ops.h, split over the thread pool by rows only.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <unordered_set>

#include "common/thread_pool.h"
#include "dd/backend/device.h"
#include "dd/backend/ops.h"
#include "dd/backend/device_checks.h"

namespace dd::backend {
namespace cpu {
struct AttentionScratch;
}

class CpuOps final : public Ops {
 public:
  explicit CpuOps(ThreadPool& pool);
  ~CpuOps() override;
  void Embed(const kernels::WeightView& table, absl::Span<const int32_t> tokens, float scale, float* x) override;
  void RopeAngles(const float* inv_freq, int64_t half, absl::Span<const int64_t> positions, float* cos,
                  float* sin) override;
  void RmsNormRows(const float* x, const float* w, float eps, int64_t n_rows, int64_t d, float* y) override;
  void RmsNormSelected(const float* x, absl::Span<const int64_t> rows, const float* w, float eps, int64_t d,
                       float* y) override;
  void Linear(const kernels::WeightView& w, LinearKind kind, const float* x, int64_t n_rows, int64_t x_stride,
              const float* bias, float* y, int64_t y_stride) override;
  void HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                    const float* norm_w, float eps, const float* cos, const float* sin, int64_t half,
                    bool neox) override;
  void GatedMul(GatedActivation act, const float* gate, const float* up, float* out, int64_t n_rows,
                int64_t n) override;
  void Add(float* x, const float* y, int64_t n) override;
  void Softcap(float* x, int64_t n, float cap) override;
  void AttendCausal(const CausalAttention& a) override;
  void AttendGroups(absl::Span<const AttentionGroup> groups, const AttentionShape& shape, float scale) override;
  void KeyScores(const float* q, int64_t nq, int64_t head_dim, const float* const* keys, int64_t nk, float* s,
                 int64_t ld) override;
  void ChunkMeans(const void* const* rows, KvDtype t, int64_t n, int64_t chunk, int64_t kv_dim,
                  float* out) override;
  void StoreKv(const float* x, int64_t n, KvDtype t, void* out) override;
  int64_t KvOverflows() override { return kv_overflows_.load(std::memory_order_relaxed); }
  void ProjectKeys(const LowRankKeys& f, const void* const* rows, absl::Span<const int64_t> positions,
                   float* out) override;
  void ReconstructKeys(const LowRankKeys& f, const float* const* coeffs, absl::Span<const int64_t> first,
                       absl::Span<const int32_t> heads, int64_t chunk, void* const* out) override;
  void TopChunks(absl::Span<const ChunkScores> lists, int64_t rows, int64_t k) override;
  void DequantizeRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, float* out) override;
  void DotRows(absl::Span<const float* const> rows, const float* x, int64_t d, float* out) override;
  void ScoreRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, const float* x, float* out) override;
  void ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) override;

 private:
  ThreadPool& pool_;
  std::unique_ptr<cpu::AttentionScratch> scratch_;
  std::atomic<int64_t> kv_overflows_{0};
};

class CpuDevice final : public Device {
 public:
  // `budget_bytes` 0 = unlimited. `pool` must outlive the device.
  CpuDevice(int64_t budget_bytes, ThreadPool& pool) : budget_(budget_bytes), ops_(pool) {}
  ~CpuDevice() override;  // CHECKs that every buffer was freed

  MemoryCaps caps() const override { return {.host_reads_device_memory = true}; }
  absl::string_view name() const override { return "cpu"; }
  absl::StatusOr<DeviceBuffer> Allocate(MemoryTag tag, int64_t bytes) override;
  void Free(DeviceBuffer& buf) override;
  int64_t budget() const override { return budget_; }
  int64_t bytes_in_use(MemoryTag tag) const override { return in_use_[static_cast<int>(tag)]; }
  int64_t bytes_in_use() const override { return total_in_use_; }
  absl::StatusOr<DeviceBuffer> Upload(MemoryTag tag, const void* src, int64_t bytes) override;

  Event Record(Queue q) override;
  void Wait(Queue, const Event&) override {}  // inline queues: every event is complete
  absl::Status Synchronize(const Event&) override { return absl::OkStatus(); }

  absl::Status CopyToDevice(Queue q, const void* src, const DeviceBuffer& dst, int64_t dst_offset,
                            int64_t bytes) override;
  absl::Status CopyToHost(Queue q, const DeviceBuffer& src, int64_t src_offset, void* dst, int64_t bytes) override;

  absl::Status Copy(Queue q, const DeviceBuffer& src, int64_t src_offset, const DeviceBuffer& dst,
                    int64_t dst_offset, int64_t bytes) override;
  absl::StatusOr<HostRegion> RegisterHostRegion(const void* base, int64_t bytes) override;
  void UnregisterHostRegion(const HostRegion& region) override;
  absl::Status Gather(Queue q, const HostRegion& region, absl::Span<const GatherBlock> blocks, int64_t block_bytes,
                      const DeviceBuffer& dst) override;

  Ops& ops() override { return ops_; }

 private:
  int64_t budget_;
  std::array<int64_t, static_cast<int>(MemoryTag::kCount)> in_use_{};
  int64_t total_in_use_ = 0;
  int64_t live_buffers_ = 0;
  std::unordered_set<const void*> in_place_;  // uploads that use the caller's memory
  std::array<uint64_t, static_cast<int>(Queue::kCount)> recorded_{};
  internal::HostRegions regions_;
  CpuOps ops_;
};

}  // namespace dd::backend
