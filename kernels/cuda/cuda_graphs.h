// Static segments on the CUDA device (ops.h, BeginSegment; static_segments.h). While the engine's
// thread has a segment open, the ops that may belong to one (StaticOp) are recorded, not
// launched. When the segment ends — or that thread makes any other call on the device — the
// records go to the compute stream as one graph launch: the graph made from equal records when
// there is one, else a new graph captured on a private stream (so no other thread's work on the
// compute stream is captured with it). Records are captured the second time they are seen (the
// first launches them one by one, loading their kernels). A failed capture turns graphs off
// for the device, says so in the log, and launches the records one by one; the results are the
// same kernels in the same order either way.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "cuda/static_segments.h"

namespace dd::kernels::cuda {

// The kernels of one recorded launch, on stream s (the launch error, cudaSuccess when queued).
cudaError_t LaunchStatic(const StaticCall& c, cudaStream_t s);
const char* StaticOpName(StaticOp op);

class SegmentGraphs {
 public:
  // Graphs kept per key: a layer's half at this many batch sizes before the least recently
  // used is made again.
  static constexpr int kPerKey = 8;

  SegmentGraphs() : cache_(kPerKey) {}
  ~SegmentGraphs();
  SegmentGraphs(const SegmentGraphs&) = delete;
  SegmentGraphs& operator=(const SegmentGraphs&) = delete;

  // enabled false: segments never open and every op launches at once.
  cudaError_t Init(bool enabled);
  bool enabled() const { return enabled_; }
  // True when the calling thread has a segment open (other threads never see one).
  bool OpenHere() const { return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id(); }
  // Opens a segment for the calling thread (the caller has ended the one it had), unless
  // another thread has one open: then this thread's ops launch at once.
  void Begin(int64_t key);
  void Add(const StaticCall& c) { calls_.push_back(c); }
  // Ends the calling thread's segment and launches its records on `compute`.
  cudaError_t End(cudaStream_t compute);

  int64_t graphs_made() const { return cache_.made(); }
  int64_t replays() const { return cache_.hits(); }

 private:
  enum class Made { kMade, kLaunchFailed, kCaptureFailed };
  cudaError_t LaunchEach(cudaStream_t s) const;
  // A graph of the records, captured on capture_ and instantiated into *exec. kLaunchFailed:
  // a launch refused its arguments (error in *err; graphs stay on); kCaptureFailed: the
  // runtime refused the capture or the graph.
  Made Capture(cudaGraphExec_t* exec, cudaError_t* err);

  bool enabled_ = false;
  cudaStream_t capture_ = nullptr;
  std::atomic<std::thread::id> owner_{};
  int64_t key_ = 0;
  std::vector<StaticCall> calls_;
  SegmentCache<cudaGraphExec_t> cache_;
  std::vector<cudaGraphExec_t> dropped_;
  SegmentCache<char> seen_{kPerKey};  // records launched one by one once, captured if seen again
  std::vector<char> seen_dropped_;
};

}  // namespace dd::kernels::cuda
