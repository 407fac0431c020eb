// The CUDA device (cuda_device.h): memory, streams, events, copies, host regions, gathers.
#include "cuda/cuda_device.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_entry.h"
#include "cuda/cuda_kernels.h"
#include "cuda/gather_runs.h"
#include "glog/logging.h"

namespace dd::kernels::cuda {

using backend::DeviceBuffer;
using backend::Event;
using backend::MemoryTag;
using backend::Queue;

namespace {

constexpr int64_t kAlign = 256;
constexpr int64_t kArgRingBytes = int64_t{128} << 20;

int64_t RoundUp(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// The error as a Status, cleared from the runtime's last error so that the next launch's
// check does not pick it up again.
absl::Status Error(cudaError_t err, absl::string_view what) {
  (void)cudaGetLastError();
  return absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorString(err)));
}

}  // namespace

// ---- argument ring ----

ArgRing::~ArgRing() {
  for (int p = 0; p < kParts; ++p) {
    for (int q = 0; q < kQueues; ++q) {
      if (done_[p][q] != nullptr) {
        if (armed_[p][q]) (void)cudaEventSynchronize(done_[p][q]);
        (void)cudaEventDestroy(done_[p][q]);
      }
    }
  }
  if (host_ != nullptr) (void)cudaFreeHost(host_);
  if (dev_ != nullptr) (void)cudaFree(dev_);
}

cudaError_t ArgRing::Init(int64_t bytes, const std::array<cudaStream_t, kQueues>& streams) {
  streams_ = streams;
  part_ = bytes / kParts / kAlign * kAlign;
  cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&host_), part_ * kParts, cudaHostAllocDefault);
  if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&dev_), part_ * kParts);
  for (int p = 0; p < kParts && err == cudaSuccess; ++p) {
    for (int q = 0; q < kQueues && err == cudaSuccess; ++q) {
      err = cudaEventCreateWithFlags(&done_[p][q], cudaEventDisableTiming);
    }
  }
  return err;
}

bool ArgRing::Begin(int q, int64_t bytes) {
  if (bytes > part_) return false;
  if (pending_q_ >= 0 && pending_q_ != q && Flush() != cudaSuccess) return false;
  if (head_ + bytes > part_ && Advance() != cudaSuccess) return false;
  return true;
}

void* ArgRing::Stage(int q, const void* src, int64_t bytes) {
  const int64_t size = Size(bytes);
  if (head_ + size > part_) return nullptr;  // more than Begin was told
  if (pending_q_ >= 0 && pending_q_ != q && Flush() != cudaSuccess) return nullptr;
  if (src == nullptr && Flush() != cudaSuccess) return nullptr;
  const int64_t off = static_cast<int64_t>(cur_) * part_ + head_;
  head_ += size;
  used_[cur_][q] = true;
  if (src != nullptr) {
    if (bytes > 0) std::memcpy(host_ + off, src, static_cast<size_t>(bytes));
    pending_q_ = q;
  } else {
    flushed_ = head_;  // scratch: nothing to copy
  }
  return dev_ + off;
}

cudaError_t ArgRing::Flush() {
  cudaError_t err = cudaSuccess;
  if (pending_q_ >= 0 && head_ > flushed_) {
    const int64_t off = static_cast<int64_t>(cur_) * part_ + flushed_;
    err = cudaMemcpyAsync(dev_ + off, host_ + off, static_cast<size_t>(head_ - flushed_), cudaMemcpyHostToDevice,
                          streams_[pending_q_]);
  }
  flushed_ = head_;
  pending_q_ = -1;
  return err;
}

cudaError_t ArgRing::Advance() {
  cudaError_t err = Flush();
  for (int q = 0; q < kQueues; ++q) {
    if (!used_[cur_][q]) continue;
    used_[cur_][q] = false;
    if (err == cudaSuccess) err = cudaEventRecord(done_[cur_][q], streams_[q]);
    armed_[cur_][q] = err == cudaSuccess;
    // Without its event, the part is left only after the queue's work is done.
    if (!armed_[cur_][q]) (void)cudaStreamSynchronize(streams_[q]);
  }
  cur_ = (cur_ + 1) % kParts;
  for (int q = 0; q < kQueues && err == cudaSuccess; ++q) {
    if (!armed_[cur_][q]) continue;
    err = cudaEventSynchronize(done_[cur_][q]);  // the last lap's readers are done
    armed_[cur_][q] = false;
  }
  head_ = flushed_ = 0;
  return err;
}

// ---- device ----

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(int64_t budget_bytes, bool graphs,
                                                               bool copy_engine_prefetch) {
  if (budget_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("negative device memory budget ", budget_bytes));
  std::string detail;
  if (!ProbeDevice(&detail)) return absl::UnavailableError(absl::StrCat("--device cuda: no usable CUDA device (", detail, ")"));
  std::unique_ptr<CudaDevice> d(new CudaDevice());
  d->copy_engine_prefetch_ = copy_engine_prefetch;
  if (absl::Status s = d->Init(budget_bytes, graphs); !s.ok()) return s;
  return d;
}

absl::Status CudaDevice::Init(int64_t budget_bytes, bool graphs) {
  if (cudaError_t err = cudaSetDevice(0); err != cudaSuccess) return Error(err, "cudaSetDevice(0)");
  int least = 0, greatest = 0;
  if (cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest); err != cudaSuccess) {
    return Error(err, "stream priorities");
  }
  // Numerically lower is higher priority: urgent gathers, then compute, then the background.
  const int compute = std::min(greatest + 1, least);
  const int prio[kQueues] = {greatest, compute, least, least};
  for (int q = 0; q < kQueues; ++q) {
    if (cudaError_t err = cudaStreamCreateWithPriority(&streams_[q], cudaStreamNonBlocking, prio[q]);
        err != cudaSuccess) {
      return Error(err, "cudaStreamCreateWithPriority");
    }
  }
  if (budget_bytes == 0) {
    size_t free_bytes = 0, total = 0;
    if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total); err != cudaSuccess) return Error(err, "cudaMemGetInfo");
    budget_bytes = static_cast<int64_t>(static_cast<double>(free_bytes) * 0.9) / (2 << 20) * (2 << 20);
  }
  // The budget counts requested bytes; the arena also holds each buffer's rounding to kAlign
  // (1/64 of the budget, at least 1 MiB, covers it for buffers of 16 KiB and up).
  budget_ = budget_bytes;
  arena_bytes_ = RoundUp(budget_bytes + std::max<int64_t>(int64_t{1} << 20, budget_bytes / 64), kAlign);
  if (cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&arena_), static_cast<size_t>(arena_bytes_));
      err != cudaSuccess) {
    (void)cudaGetLastError();
    arena_ = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat("--device cuda: cannot allocate the device memory budget of ",
                                                     budget_bytes, " bytes: ", cudaGetErrorString(err)));
  }
  free_[0] = arena_bytes_;
  if (cudaError_t err = args_.Init(kArgRingBytes, streams_); err != cudaSuccess) return Error(err, "argument ring");
  if (cudaError_t err = cudaMalloc(&linear_scratch_, static_cast<size_t>(kLinearScratchBytes)); err != cudaSuccess) {
    linear_scratch_ = nullptr;
    return Error(err, "linear scratch");
  }
  if (cudaError_t err = segments_.Init(graphs); err != cudaSuccess) return Error(err, "graph capture stream");
  return absl::OkStatus();
}

CudaDevice::~CudaDevice() {
  FlushSegment();
  (void)cudaDeviceSynchronize();
  LOG_IF(ERROR, !live_.empty()) << "cuda device destroyed with " << total_in_use_ << " bytes still allocated";
  for (auto& queue : pending_) {
    for (const Pending& p : queue) (void)cudaEventDestroy(p.event);
  }
  for (cudaEvent_t e : spare_events_) (void)cudaEventDestroy(e);
  if (arena_ != nullptr) (void)cudaFree(arena_);
  if (linear_scratch_ != nullptr) (void)cudaFree(linear_scratch_);
  for (cudaStream_t s : streams_) {
    if (s != nullptr) (void)cudaStreamDestroy(s);
  }
}

void CudaDevice::Report(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::lock_guard<std::mutex> lock(error_mu_);
  if (!error_.ok()) return;
  error_ = Error(err, what);
  LOG(ERROR) << error_;
}

absl::StatusOr<DeviceBuffer> CudaDevice::Allocate(MemoryTag tag, int64_t bytes) {
  FlushSegment();
  if (absl::Status s = backend::internal::CheckAllocation(tag, bytes, total_in_use_, budget_); !s.ok()) return s;
  const int64_t size = RoundUp(std::max<int64_t>(bytes, 1), kAlign);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const int64_t off = it->first, left = it->second - size;
    free_.erase(it);
    if (left > 0) free_[off + size] = left;
    char* p = arena_ + off;
    live_[p] = size;
    in_use_[static_cast<int>(tag)] += bytes;
    total_in_use_ += bytes;
    return DeviceBuffer{p, bytes, tag};
  }
  return absl::ResourceExhaustedError(absl::StrCat("device memory: ", bytes, " bytes of ", backend::MemoryTagName(tag),
                                                   " fit the budget but no free range holds them (fragmented: ",
                                                   total_in_use_, " of ", budget_, " bytes in use)"));
}

void CudaDevice::Free(DeviceBuffer& buf) {
  FlushSegment();
  if (buf.data == nullptr) return;
  const auto it = live_.find(static_cast<char*>(buf.data));
  CHECK(it != live_.end()) << "cuda device: Free of a buffer it did not allocate";
  int64_t off = it->first - arena_, size = it->second;
  live_.erase(it);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + size) {  // merge with the range after
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // and the one before
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      off = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_[off] = size;
  in_use_[static_cast<int>(buf.tag)] -= buf.bytes;
  total_in_use_ -= buf.bytes;
  buf = DeviceBuffer{};
}

absl::StatusOr<DeviceBuffer> CudaDevice::Upload(MemoryTag tag, const void* src, int64_t bytes) {
  if (src == nullptr || bytes == 0) return absl::InvalidArgumentError("upload of no bytes");
  absl::StatusOr<DeviceBuffer> buf = Allocate(tag, bytes);
  if (!buf.ok()) return buf.status();
  if (cudaError_t err = cudaMemcpy(buf->data, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice);
      err != cudaSuccess) {
    Free(*buf);
    return Error(err, "upload");
  }
  return buf;
}

void CudaDevice::Retire(int q, uint64_t upto) {
  while (!pending_[q].empty() && pending_[q].front().seq <= upto) {
    spare_events_.push_back(pending_[q].front().event);
    pending_[q].pop_front();
  }
  completed_[q] = std::max(completed_[q], upto);
}

Event CudaDevice::Record(Queue q) {
  FlushSegment();
  const int qi = static_cast<int>(q);
  cudaEvent_t ev = nullptr;
  if (!spare_events_.empty()) {
    ev = spare_events_.back();
    spare_events_.pop_back();
  } else if (cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); err != cudaSuccess) {
    Report(err, "cudaEventCreate");
    return Event{q, 0};
  }
  if (cudaError_t err = cudaEventRecord(ev, streams_[qi]); err != cudaSuccess) {
    Report(err, "cudaEventRecord");
    spare_events_.push_back(ev);
    return Event{q, 0};
  }
  pending_[qi].push_back({++recorded_[qi], ev});
  // Recycle what has completed (in order on a stream), so the list stays short.
  while (pending_[qi].size() > 64) {
    if (cudaEventQuery(pending_[qi].front().event) != cudaSuccess) {
      (void)cudaGetLastError();  // "not ready" is kept as the last error: not a failure
      break;
    }
    Retire(qi, pending_[qi].front().seq);
  }
  return Event{q, recorded_[qi]};
}

void CudaDevice::Wait(Queue q, const Event& e) {
  FlushSegment();
  const int eq = static_cast<int>(e.queue);
  if (e.seq == 0 || e.seq <= completed_[eq] || e.queue == q) return;  // done, or ordered by the stream
  const auto& list = pending_[eq];
  const auto it = std::lower_bound(list.begin(), list.end(), e.seq,
                                   [](const Pending& p, uint64_t s) { return p.seq < s; });
  if (it == list.end() || it->seq != e.seq) {
    Report(cudaErrorInvalidResourceHandle, "Wait on an event that was never recorded");
    return;
  }
  Report(cudaStreamWaitEvent(streams_[static_cast<int>(q)], it->event, 0), "cudaStreamWaitEvent");
}

absl::Status CudaDevice::Synchronize(const Event& e) {
  FlushSegment();
  const int eq = static_cast<int>(e.queue);
  if (e.seq > completed_[eq]) {
    const auto& list = pending_[eq];
    const auto it = std::lower_bound(list.begin(), list.end(), e.seq,
                                     [](const Pending& p, uint64_t s) { return p.seq < s; });
    if (it != list.end() && it->seq == e.seq) {
      Report(cudaEventSynchronize(it->event), "work before a synchronized event");
      Retire(eq, e.seq);
    }
  }
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_;
}

absl::Status CudaDevice::CopyToDevice(Queue q, const void* src, const DeviceBuffer& dst, int64_t dst_offset,
                                      int64_t bytes) {
  FlushSegment();
  if (absl::Status s = backend::internal::CheckRange("copy to device", dst_offset, bytes, dst.bytes); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  const cudaError_t err = cudaMemcpyAsync(static_cast<char*>(dst.data) + dst_offset, src, static_cast<size_t>(bytes),
                                          cudaMemcpyHostToDevice, streams_[static_cast<int>(q)]);
  return err == cudaSuccess ? absl::OkStatus() : Error(err, "copy to device");
}

absl::Status CudaDevice::CopyToHost(Queue q, const DeviceBuffer& src, int64_t src_offset, void* dst, int64_t bytes) {
  FlushSegment();
  if (absl::Status s = backend::internal::CheckRange("copy to host", src_offset, bytes, src.bytes); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  const cudaError_t err = cudaMemcpyAsync(dst, static_cast<const char*>(src.data) + src_offset,
                                          static_cast<size_t>(bytes), cudaMemcpyDeviceToHost,
                                          streams_[static_cast<int>(q)]);
  return err == cudaSuccess ? absl::OkStatus() : Error(err, "copy to host");
}

absl::Status CudaDevice::Copy(Queue q, const DeviceBuffer& src, int64_t src_offset, const DeviceBuffer& dst,
                              int64_t dst_offset, int64_t bytes) {
  FlushSegment();
  if (absl::Status s = backend::internal::CheckCopy(src, src_offset, dst, dst_offset, bytes); !s.ok()) return s;
  if (bytes == 0) return absl::OkStatus();
  const cudaError_t err =
      cudaMemcpyAsync(static_cast<char*>(dst.data) + dst_offset, static_cast<const char*>(src.data) + src_offset,
                      static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, streams_[static_cast<int>(q)]);
  return err == cudaSuccess ? absl::OkStatus() : Error(err, "device copy");
}

absl::StatusOr<backend::HostRegion> CudaDevice::RegisterHostRegion(const void* base, int64_t bytes) {
  FlushSegment();
  absl::StatusOr<backend::HostRegion> r = regions_.Register(base, bytes);
  if (!r.ok()) return r.status();
  void* p = const_cast<void*>(base);
  cudaError_t err = cudaHostRegister(p, static_cast<size_t>(bytes), cudaHostRegisterMapped | cudaHostRegisterPortable);
  bool ours = err == cudaSuccess;
  if (err == cudaErrorHostMemoryAlreadyRegistered) {  // pinned already (e.g. cudaHostAlloc)
    (void)cudaGetLastError();
    err = cudaSuccess;
  }
  void* dev = nullptr;
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(&dev, p, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    if (ours) (void)cudaHostUnregister(p);
    regions_.Unregister(*r);
    return Error(err, absl::StrCat("registering a host region of ", bytes, " bytes"));
  }
  region_dev_[r->id] = {static_cast<char*>(dev), ours};
  return r;
}

void CudaDevice::UnregisterHostRegion(const backend::HostRegion& region) {
  FlushSegment();
  const auto it = region_dev_.find(region.id);
  if (it == region_dev_.end()) return;
  if (it->second.second) (void)cudaHostUnregister(const_cast<void*>(region.base));
  region_dev_.erase(it);
  regions_.Unregister(region);
}

absl::Status CudaDevice::Gather(Queue q, const backend::HostRegion& region, absl::Span<const backend::GatherBlock> blocks,
                                int64_t block_bytes, const DeviceBuffer& dst) {
  FlushSegment();
  absl::StatusOr<backend::HostRegion> r = regions_.CheckGather(region, blocks, block_bytes, dst);
  if (!r.ok()) return r.status();
  static_assert(sizeof(backend::GatherBlock) == 2 * sizeof(int64_t), "pairs of int64");
  const char* src = region_dev_.at(region.id).first;
  const int qi = static_cast<int>(q);
  std::lock_guard<std::mutex> lock(args_mu_);
  if (copy_engine_prefetch_ && q != Queue::kUrgent) {
    const cudaError_t err = CopyEngineGather(q, region, blocks, block_bytes, dst);
    if (err == cudaSuccess) {
      ++copy_engine_gathers_;
      return absl::OkStatus();
    }
    if (err != cudaErrorNotSupported && err != cudaErrorCallRequiresNewerDriver) return Error(err, "copy-engine gather");
    (void)cudaGetLastError();
    LOG(WARNING) << "cuda: cudaMemcpyBatchAsync is not available (" << cudaGetErrorString(err)
                 << "; it needs CUDA 12.8 and a driver for it): prefetches use the gather kernel";
    copy_engine_prefetch_ = false;
  }
  const int64_t per_launch = args_.part_bytes() / static_cast<int64_t>(sizeof(backend::GatherBlock));
  for (size_t b0 = 0; b0 < blocks.size(); b0 += static_cast<size_t>(per_launch)) {
    const int64_t n = std::min<int64_t>(per_launch, static_cast<int64_t>(blocks.size() - b0));
    const int64_t bytes = n * static_cast<int64_t>(sizeof(backend::GatherBlock));
    if (!args_.Begin(qi, ArgRing::Size(bytes))) return Error(cudaErrorMemoryAllocation, "gather argument ring");
    const void* pairs = args_.Stage(qi, blocks.data() + b0, bytes);
    if (cudaError_t err = args_.Flush(); err != cudaSuccess) return Error(err, "gather arguments");
    if (cudaError_t err = GatherPairs(reinterpret_cast<const uint8_t*>(src), static_cast<const int64_t*>(pairs), n,
                                      block_bytes, static_cast<uint8_t*>(dst.data), streams_[qi]);
        err != cudaSuccess) {
      return Error(err, "gather");
    }
  }
  return absl::OkStatus();
}

// The blocks as runs merged where adjacent on both sides (gather_runs.h), in one batch for the
// copy engines, which leave the SMs to compute; the source is the region's host address.
cudaError_t CudaDevice::CopyEngineGather(Queue q, const backend::HostRegion& region,
                                         absl::Span<const backend::GatherBlock> blocks, int64_t block_bytes,
                                         const DeviceBuffer& dst) {
  MergeGatherRuns(blocks, block_bytes, &copy_runs_);
  copy_dsts_.clear();
  copy_srcs_.clear();
  copy_sizes_.clear();
  for (const GatherRun& r : copy_runs_) {
    copy_dsts_.push_back(static_cast<char*>(dst.data) + r.dst);
    copy_srcs_.push_back(static_cast<const char*>(region.base) + r.src);
    copy_sizes_.push_back(static_cast<size_t>(r.bytes));
  }
  if (copy_sizes_.empty()) return cudaSuccess;
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeHost;
  attr.dstLocHint.type = cudaMemLocationTypeDevice;
  if (cudaError_t e = cudaGetDevice(&attr.dstLocHint.id); e != cudaSuccess) return e;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_index = 0;
  cudaStream_t s = streams_[static_cast<int>(q)];
#endif
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(copy_dsts_.data(), copy_srcs_.data(), copy_sizes_.data(), copy_sizes_.size(), &attr,
                              &attr_index, 1, s);
#elif CUDART_VERSION >= 12080
  size_t fail_index = 0;
  return cudaMemcpyBatchAsync(copy_dsts_.data(), const_cast<void**>(copy_srcs_.data()), copy_sizes_.data(),
                              copy_sizes_.size(), &attr, &attr_index, 1, &fail_index, s);
#else
  return cudaErrorNotSupported;
#endif
}

absl::StatusOr<std::unique_ptr<backend::Device>> CreateCudaDevice(int64_t budget_bytes, bool graphs,
                                                                  bool copy_engine_prefetch) {
  absl::StatusOr<std::unique_ptr<CudaDevice>> d = CudaDevice::Create(budget_bytes, graphs, copy_engine_prefetch);
  if (!d.ok()) return d.status();
  return std::unique_ptr<backend::Device>(std::move(*d));
}

}  // namespace dd::kernels::cuda
