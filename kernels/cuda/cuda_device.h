// The CUDA device behind the compute-backend seam (docs/architecture.md, "The compute-backend
// seam"). Internal to kernels/cuda (names CUDA types); the rest of the project gets it through
// backend::CreateDevice("cuda", ...).
//
//   memory   one cudaMalloc of the budget (0: 90% of the free memory at start) plus room for
//            rounding, sub-allocated first-fit by tag with neighbours merged on Free; nothing is
//            allocated later.
//   queues   one non-blocking stream per queue, with the device's priorities: urgent above
//            compute above prefetch and write-back.
//   events   CUDA events recorded on a queue's stream, numbered per queue; completed ones are
//            recycled (a stream completes them in order).
//   args     host-side lists an op or gather needs on the device (positions, pointer lists,
//            chunk ids, gather blocks) are packed into a pinned ring and copied on the queue
//            that uses them (ArgRing); the ring is outside the budget.
//   errors   ops return nothing, so a failed launch is kept and returned by the next
//            Synchronize (as a kernel's fault is, by CUDA).
//   graphs   with graphs on, a static segment's ops (ops.h) are recorded and launched as a
//            CUDA graph when the segment ends (cuda_graphs.h); every other call of the thread
//            that opened it ends it first, so its work is queued in program order.
//   linear   the int8 activations of Linear go to one scratch buffer outside the budget (the
//            compute stream orders its uses), so a recorded Linear's arguments repeat.
//   gathers  from a registered host region: urgent ones by the gather kernel (one block per
//            copy); prefetch and write-back ones too, or, with copy-engine prefetches, as one
//            cudaMemcpyBatchAsync of runs merged where adjacent (gather_runs.h).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/cuda_graphs.h"
#include "cuda/cuda_kernels.h"
#include "cuda/gather_runs.h"
#include "dd/backend/device.h"
#include "dd/backend/device_checks.h"
#include "dd/backend/ops.h"

namespace dd::kernels::cuda {

class CudaDevice;

constexpr int kQueues = static_cast<int>(backend::Queue::kCount);

// A pinned host ring and a device ring of the same size, in kParts parts. Stage packs bytes
// into the current part; Flush copies what was packed since the last Flush on the stream of
// the queue it was packed for. A part is reused only after the work of every queue that used
// it has completed (an event per queue, recorded when the ring leaves the part).
class ArgRing {
 public:
  static constexpr int kParts = 4;
  ~ArgRing();
  cudaError_t Init(int64_t bytes, const std::array<cudaStream_t, kQueues>& streams);
  int64_t part_bytes() const { return part_; }
  // Ring bytes one Stage of `bytes` takes.
  static int64_t Size(int64_t bytes) { return (std::max<int64_t>(bytes, 1) + 15) / 16 * 16; }
  // Makes room in one part for the Stages of one launch, `bytes` (the sum of their Size) in all,
  // so that the part they share is left only after that launch is queued. False when it
  // cannot (more than a part: the caller splits the launch).
  bool Begin(int q, int64_t bytes);
  // Device address of `bytes` (16-aligned) holding `src` once flushed; src null: scratch the
  // device writes (never copied). Null when bytes exceed a part.
  void* Stage(int q, const void* src, int64_t bytes);
  cudaError_t Flush();

 private:
  cudaError_t Advance();
  char* host_ = nullptr;
  char* dev_ = nullptr;
  int64_t part_ = 0;
  int cur_ = 0;
  int64_t head_ = 0;     // next free byte in the current part
  int64_t flushed_ = 0;  // bytes of the current part already copied
  int pending_q_ = -1;   // the queue of the unflushed bytes
  std::array<cudaStream_t, kQueues> streams_{};
  std::array<std::array<cudaEvent_t, kQueues>, kParts> done_{};
  std::array<std::array<bool, kQueues>, kParts> armed_{};
  std::array<std::array<bool, kQueues>, kParts> used_{};
};

class CudaOps final : public backend::Ops {
 public:
  explicit CudaOps(CudaDevice& device) : dev_(device) {}
  ~CudaOps() override;
  void Embed(const WeightView& table, absl::Span<const int32_t> tokens, float scale, float* x) override;
  void RopeAngles(const float* inv_freq, int64_t half, absl::Span<const int64_t> positions, float* cos,
                  float* sin) override;
  void RmsNormRows(const float* x, const float* w, float eps, int64_t n_rows, int64_t d, float* y) override;
  void RmsNormSelected(const float* x, absl::Span<const int64_t> rows, const float* w, float eps, int64_t d,
                       float* y) override;
  void Linear(const WeightView& w, backend::LinearKind kind, const float* x, int64_t n_rows, int64_t x_stride,
              const float* bias, float* y, int64_t y_stride) override;
  void HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                    const float* norm_w, float eps, const float* cos, const float* sin, int64_t half,
                    bool neox) override;
  void GatedMul(backend::GatedActivation act, const float* gate, const float* up, float* out, int64_t n_rows,
                int64_t n) override;
  void Add(float* x, const float* y, int64_t n) override;
  void Softcap(float* x, int64_t n, float cap) override;
  void AttendCausal(const backend::CausalAttention& a) override;
  void AttendGroups(absl::Span<const backend::AttentionGroup> groups, const backend::AttentionShape& shape,
                    float scale) override;
  void KeyScores(const float* q, int64_t nq, int64_t head_dim, const float* const* keys, int64_t nk, float* s,
                 int64_t ld) override;
  void ChunkMeans(const void* const* rows, KvDtype t, int64_t n, int64_t chunk, int64_t kv_dim,
                  float* out) override;
  void StoreKv(const float* x, int64_t n, KvDtype t, void* out) override;
  void ProjectKeys(const backend::LowRankKeys& f, const void* const* rows, absl::Span<const int64_t> positions,
                   float* out) override;
  void ReconstructKeys(const backend::LowRankKeys& f, const float* const* coeffs, absl::Span<const int64_t> first,
                       absl::Span<const int32_t> heads, int64_t chunk, void* const* out) override;
  int64_t KvOverflows() override;
  void TopChunks(absl::Span<const backend::ChunkScores> lists, int64_t rows, int64_t k) override;
  void DequantizeRows(const WeightView& w, absl::Span<const int32_t> ids, float* out) override;
  void DotRows(absl::Span<const float* const> rows, const float* x, int64_t d, float* out) override;
  void ScoreRows(const WeightView& w, absl::Span<const int32_t> ids, const float* x, float* out) override;
  void ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) override;
  void BeginSegment(int64_t key) override;
  void EndSegment() override;

 private:
  // Launches `c` on the compute stream, or records it while the caller's segment is open.
  void Issue(const StaticCall& c);
  CudaDevice& dev_;
  // The host-side tables of one launch, kept across calls so that a step does not allocate
  // (the engine's thread only; KeyScores, which other threads may call, uses none).
  std::vector<DevRun> runs_;
  std::vector<DevListRow> rows_;
  std::vector<DevList> lists_, group_lists_;
  std::vector<KeySeg> segs_, group_segs_;
  std::vector<const backend::ChunkScores*> batch_;
  std::vector<DevChunkList> chunk_lists_;
  // StoreKv's saturation count: mapped host memory the kernel adds to (allocated at the first
  // f16 store), read by the host without a copy.
  unsigned long long* saturated_ = nullptr;
  unsigned long long* saturated_dev_ = nullptr;
};

class CudaDevice final : public backend::Device {
 public:
  // Device 0 with `budget_bytes` of memory (0: 90% of what is free), static segments as
  // graphs when `graphs`, gathers on the prefetch and write-back queues by the copy engines
  // when `copy_engine_prefetch` (else, as urgent ones, by the gather kernel). UNAVAILABLE when
  // CUDA fails, RESOURCE_EXHAUSTED when the budget cannot be allocated.
  static absl::StatusOr<std::unique_ptr<CudaDevice>> Create(int64_t budget_bytes, bool graphs,
                                                            bool copy_engine_prefetch = false);
  ~CudaDevice() override;

  absl::string_view name() const override { return "cuda"; }
  backend::MemoryCaps caps() const override { return {.transport_writes_device_memory = true}; }
  absl::StatusOr<backend::DeviceBuffer> Allocate(backend::MemoryTag tag, int64_t bytes) override;
  void Free(backend::DeviceBuffer& buf) override;
  int64_t budget() const override { return budget_; }
  int64_t bytes_in_use(backend::MemoryTag tag) const override { return in_use_[static_cast<int>(tag)]; }
  int64_t bytes_in_use() const override { return total_in_use_; }
  absl::StatusOr<backend::DeviceBuffer> Upload(backend::MemoryTag tag, const void* src, int64_t bytes) override;
  backend::Event Record(backend::Queue q) override;
  void Wait(backend::Queue q, const backend::Event& e) override;
  absl::Status Synchronize(const backend::Event& e) override;
  absl::Status CopyToDevice(backend::Queue q, const void* src, const backend::DeviceBuffer& dst, int64_t dst_offset,
                            int64_t bytes) override;
  absl::Status CopyToHost(backend::Queue q, const backend::DeviceBuffer& src, int64_t src_offset, void* dst,
                          int64_t bytes) override;
  absl::Status Copy(backend::Queue q, const backend::DeviceBuffer& src, int64_t src_offset,
                    const backend::DeviceBuffer& dst, int64_t dst_offset, int64_t bytes) override;
  absl::StatusOr<backend::HostRegion> RegisterHostRegion(const void* base, int64_t bytes) override;
  void UnregisterHostRegion(const backend::HostRegion& region) override;
  absl::Status Gather(backend::Queue q, const backend::HostRegion& region, absl::Span<const backend::GatherBlock> blocks,
                      int64_t block_bytes, const backend::DeviceBuffer& dst) override;
  backend::Ops& ops() override { return ops_; }

  // For CudaOps: the compute stream, the argument ring (under its lock), and where a failed
  // launch is reported.
  cudaStream_t stream(backend::Queue q) const { return streams_[static_cast<int>(q)]; }
  ArgRing& args() { return args_; }
  std::mutex& args_mu() { return args_mu_; }
  void Report(cudaError_t err, const char* what);
  SegmentGraphs& segments() { return segments_; }
  // Ends the calling thread's static segment, if it has one open (its launches queued).
  void FlushSegment() {
    if (segments_.OpenHere()) Report(segments_.End(stream(backend::Queue::kCompute)), "static segment");
  }
  // Linear's int8 activations (compute stream only), and how many bytes it holds.
  void* linear_scratch() const { return linear_scratch_; }
  static constexpr int64_t kLinearScratchBytes = int64_t{16} << 20;
  // Gathers the copy engines ran (copy-engine prefetches).
  int64_t copy_engine_gathers() const { return copy_engine_gathers_; }

 private:
  CudaDevice() : ops_(*this) {}
  absl::Status Init(int64_t budget_bytes, bool graphs);
  struct Pending {
    uint64_t seq;
    cudaEvent_t event;
  };
  void Retire(int q, uint64_t upto);  // events of queue q up to `upto` are complete
  // Gather by one cudaMemcpyBatchAsync on q (under args_mu_); cudaErrorNotSupported before
  // CUDA 12.8.
  cudaError_t CopyEngineGather(backend::Queue q, const backend::HostRegion& region,
                               absl::Span<const backend::GatherBlock> blocks, int64_t block_bytes,
                               const backend::DeviceBuffer& dst);

  char* arena_ = nullptr;
  int64_t budget_ = 0, arena_bytes_ = 0;
  std::map<int64_t, int64_t> free_;          // offset -> bytes
  std::unordered_map<char*, int64_t> live_;  // address -> bytes taken (rounded)
  std::array<int64_t, static_cast<int>(backend::MemoryTag::kCount)> in_use_{};
  int64_t total_in_use_ = 0;
  std::array<cudaStream_t, kQueues> streams_{};
  std::array<std::deque<Pending>, kQueues> pending_;
  std::array<uint64_t, kQueues> recorded_{}, completed_{};
  std::vector<cudaEvent_t> spare_events_;
  absl::Status error_;  // the first failure (KeyScores may report from several threads)
  std::mutex error_mu_;
  backend::internal::HostRegions regions_;
  std::map<int64_t, std::pair<char*, bool>> region_dev_;  // id -> device address, registered by us
  ArgRing args_;
  std::mutex args_mu_;
  void* linear_scratch_ = nullptr;
  bool copy_engine_prefetch_ = false;  // under args_mu_ (turned off where unsupported)
  int64_t copy_engine_gathers_ = 0;    // under args_mu_
  std::vector<GatherRun> copy_runs_;  // CopyEngineGather's lists (under args_mu_)
  std::vector<void*> copy_dsts_;
  std::vector<const void*> copy_srcs_;
  std::vector<size_t> copy_sizes_;
  SegmentGraphs segments_;
  CudaOps ops_;
};

}  // namespace dd::kernels::cuda
