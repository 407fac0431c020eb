// The sim device's internals, shared by sim_device.cc (memory, queues, hazards) and sim_ops.cc
// (the ops as compute-queue work with their declared ranges). See dd/backend/sim_device.h.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dd/backend/cpu_device.h"
#include "dd/backend/sim_device.h"
#include "dd/backend/device_checks.h"

namespace dd::backend::sim {

constexpr int kQueues = static_cast<int>(Queue::kCount);
using Clock = std::array<uint64_t, kQueues>;  // per queue: the last of its work known complete-before

// A byte range [begin, end) of addresses.
struct Range {
  uintptr_t begin = 0, end = 0;
};
inline Range RangeOf(const void* p, int64_t bytes) {
  const auto b = reinterpret_cast<uintptr_t>(p);
  return {b, b + static_cast<uintptr_t>(bytes > 0 ? bytes : 0)};
}

// Device ranges a piece of work reads and writes; a range outside every buffer (host memory)
// aborts the process, naming the work.
struct Accesses {
  std::vector<Range> reads, writes;
  void Read(const void* p, int64_t bytes) { reads.push_back(RangeOf(p, bytes)); }
  void Write(const void* p, int64_t bytes) { writes.push_back(RangeOf(p, bytes)); }
};

class SimDevice;

// The ops: each call becomes compute-queue work running the cpu kernels, declaring what it
// reads and writes. Host spans and pointer lists are copied at the call.
class SimOps final : public Ops {
 public:
  SimOps(SimDevice& device, ThreadPool& pool, SimFault fault) : device_(device), cpu_(pool), fault_(fault) {}
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
  int64_t KvOverflows() override;
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
  SimDevice& device_;
  CpuOps cpu_;  // runs on the compute queue's thread only
  const SimFault fault_;
};

class SimDevice final : public Device {
 public:
  explicit SimDevice(const SimOptions& options);
  ~SimDevice() override;  // drains the queues; CHECKs that every buffer was freed

  MemoryCaps caps() const override { return {}; }
  absl::string_view name() const override { return "sim"; }
  absl::StatusOr<DeviceBuffer> Allocate(MemoryTag tag, int64_t bytes) override;
  void Free(DeviceBuffer& buf) override;
  int64_t budget() const override { return budget_; }
  int64_t bytes_in_use(MemoryTag tag) const override { return in_use_[static_cast<int>(tag)]; }
  int64_t bytes_in_use() const override { return total_in_use_; }
  absl::StatusOr<DeviceBuffer> Upload(MemoryTag tag, const void* src, int64_t bytes) override;

  Event Record(Queue q) override;
  void Wait(Queue q, const Event& e) override;
  absl::Status Synchronize(const Event& e) override;

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

  // Checks `acc` against the program order (aborting on a hazard), then queues `fn` on `q`.
  void Submit(Queue q, const std::string& what, Accesses acc, std::function<void()> fn);

 private:
  struct Access {
    Range r;
    int queue = 0;
    uint64_t seq = 0;
    bool write = false;
    std::string what;
  };
  struct Buffer {
    size_t mapped = 0;  // bytes mapped (whole pages)
    int64_t bytes = 0;
    MemoryTag tag = MemoryTag::kWorkspace;
    std::vector<Access> accesses;
  };
  struct Work {
    uint64_t seq = 0;
    std::vector<Event> waits;
    std::vector<Range> touch;  // device ranges opened while it runs
    std::function<void()> fn;
  };
  struct QueueState {
    std::deque<Work> work;
    uint64_t submitted = 0;
    std::vector<Event> pending_waits;  // taken by the next piece of work
    std::thread thread;
  };

  // The buffer holding [r.begin, r.end), or nullptr (host memory). Aborts when a range
  // straddles a buffer's end.
  Buffer* Find(const Range& r, uintptr_t* base);
  void Check(int q, const Range& r, bool write, const std::string& what);
  bool Ordered(const Clock& knows, const Access& a) const { return knows[a.queue] >= a.seq; }
  void RunQueue(int q);
  void SetAccess(const std::vector<Range>& ranges, int prot);

  int64_t budget_;
  int64_t max_jitter_us_;
  uint64_t seed_;
  std::array<int64_t, static_cast<int>(MemoryTag::kCount)> in_use_{};
  int64_t total_in_use_ = 0;
  std::map<uintptr_t, Buffer> buffers_;  // by base address
  internal::HostRegions regions_;
  // Program-order knowledge (submitting thread only): per queue what it has waited for,
  // the host's, and each recorded event's clock.
  std::array<Clock, kQueues> knows_{};
  Clock host_knows_{};
  std::array<std::map<uint64_t, Clock>, kQueues> recorded_;
  // Execution (queue threads).
  std::mutex mu_;
  std::condition_variable cv_;
  std::array<QueueState, kQueues> queues_;
  Clock completed_{};
  bool stopping_ = false;
  std::mutex run_mu_;  // one piece of work at a time opens device memory
  SimOps ops_;
};

}  // namespace dd::backend::sim
