// Static segments on the CUDA device as graphs (cuda_graphs.h).
#include "cuda/cuda_graphs.h"

#include "cuda/cuda_kernels.h"
#include "glog/logging.h"

namespace dd::kernels::cuda {
namespace {

float* F(const void* p) { return static_cast<float*>(const_cast<void*>(p)); }

}  // namespace

const char* StaticOpName(StaticOp op) {
  switch (op) {
    case StaticOp::kRmsNorm: return "RmsNormRows";
    case StaticOp::kLinearInt8: return "Linear (int8)";
    case StaticOp::kLinearF32: return "Linear (f32)";
    case StaticOp::kHeadNormRope: return "HeadNormRope";
    case StaticOp::kGatedMul: return "GatedMul";
    case StaticOp::kAdd: return "Add";
    case StaticOp::kSoftcap: return "Softcap";
  }
  return "static op";
}

// The field layout of each op is the one cuda_ops.cc writes (CudaOps::Issue's callers).
cudaError_t LaunchStatic(const StaticCall& c, cudaStream_t s) {
  const int64_t* n = c.n;
  const void* const* p = c.p;
  switch (c.op) {
    case StaticOp::kRmsNorm:
      return RmsNormRows(F(p[0]), nullptr, F(p[1]), c.f[0], n[0], n[1], F(p[2]), s);
    case StaticOp::kLinearInt8:
    case StaticOp::kLinearF32: {
      const DevWeights w{static_cast<DType>(n[0]), static_cast<const uint8_t*>(p[0]), n[1], n[2], n[3]};
      if (c.op == StaticOp::kLinearF32) return LinearF32(w, F(p[1]), n[4], n[5], F(p[2]), F(p[3]), n[6], s);
      return LinearInt8(w, F(p[1]), n[4], n[5], F(p[2]), F(p[3]), n[6], const_cast<void*>(p[4]), s);
    }
    case StaticOp::kHeadNormRope:
      return HeadNormRope(F(p[0]), n[0], n[1], n[2], n[3], F(p[1]), c.f[0], F(p[2]), F(p[3]), n[4], n[5] != 0, s);
    case StaticOp::kGatedMul:
      return GatedMul(static_cast<int>(n[0]), F(p[0]), F(p[1]), F(p[2]), n[1], s);
    case StaticOp::kAdd:
      return Add(F(p[0]), F(p[1]), n[0], s);
    case StaticOp::kSoftcap:
      return Softcap(F(p[0]), n[0], c.f[0], s);
  }
  return cudaErrorInvalidValue;
}

SegmentGraphs::~SegmentGraphs() {
  for (cudaGraphExec_t e : cache_.Clear()) (void)cudaGraphExecDestroy(e);
  if (capture_ != nullptr) (void)cudaStreamDestroy(capture_);
}

cudaError_t SegmentGraphs::Init(bool enabled) {
  enabled_ = enabled;
  if (!enabled) return cudaSuccess;
  calls_.reserve(64);
  return cudaStreamCreateWithFlags(&capture_, cudaStreamNonBlocking);
}

void SegmentGraphs::Begin(int64_t key) {
  if (!enabled_) return;
  // One segment at a time: while another thread has one open, this thread's ops launch at once.
  std::thread::id none;
  if (!owner_.compare_exchange_strong(none, std::this_thread::get_id(), std::memory_order_acquire)) return;
  key_ = key;
  calls_.clear();
}

cudaError_t SegmentGraphs::LaunchEach(cudaStream_t s) const {
  for (const StaticCall& c : calls_) {
    if (cudaError_t err = LaunchStatic(c, s); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

SegmentGraphs::Made SegmentGraphs::Capture(cudaGraphExec_t* exec, cudaError_t* err) {
  // Thread-local mode: only this thread's calls are checked for what capture forbids; the
  // private stream keeps other threads' launches out of the graph.
  *err = cudaStreamBeginCapture(capture_, cudaStreamCaptureModeThreadLocal);
  if (*err != cudaSuccess) return Made::kCaptureFailed;
  const cudaError_t launch = LaunchEach(capture_);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(capture_, &graph);  // ends capture even after a failure
  if (launch != cudaSuccess && end == cudaSuccess) {  // a launch refused its arguments, not the capture
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    *err = launch;
    return Made::kLaunchFailed;
  }
  *err = launch != cudaSuccess ? launch : end;
  if (*err == cudaSuccess) *err = cudaGraphInstantiate(exec, graph, 0);
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  return *err == cudaSuccess ? Made::kMade : Made::kCaptureFailed;
}

cudaError_t SegmentGraphs::End(cudaStream_t compute) {
  owner_.store(std::thread::id(), std::memory_order_release);
  if (calls_.empty()) return cudaSuccess;
  if (!enabled_) return LaunchEach(compute);
  if (const cudaGraphExec_t* exec = cache_.Find(key_, calls_)) return cudaGraphLaunch(*exec, compute);
  // Records seen for the first time launch one by one (which also loads their kernels, so no
  // capture is the first launch of one); the second time they are captured.
  if (seen_.Find(key_, calls_) == nullptr) {
    seen_.Insert(key_, calls_, 1, &seen_dropped_);
    seen_dropped_.clear();
    return LaunchEach(compute);
  }
  cudaGraphExec_t exec = nullptr;
  cudaError_t err = cudaSuccess;
  switch (Capture(&exec, &err)) {
    case Made::kMade:
      break;
    case Made::kLaunchFailed:  // the same launch fails again one by one, and is reported
      (void)cudaGetLastError();
      return LaunchEach(compute);
    case Made::kCaptureFailed:
      (void)cudaGetLastError();
      LOG(WARNING) << "cuda: static segments launch one by one from now on: making a graph of "
                   << StaticOpName(calls_.front().op) << " and " << calls_.size() - 1
                   << " more launches failed: " << cudaGetErrorString(err);
      enabled_ = false;
      return LaunchEach(compute);
  }
  cache_.Insert(key_, calls_, exec, &dropped_);
  // An executable dropped may still be running: the runtime frees it when it completes.
  for (cudaGraphExec_t e : dropped_) (void)cudaGraphExecDestroy(e);
  dropped_.clear();
  return cudaGraphLaunch(exec, compute);
}

}  // namespace dd::kernels::cuda
