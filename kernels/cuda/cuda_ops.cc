// The CUDA device's ops (cuda_device.h): each stages the host-side lists it needs in the
// argument ring, then launches its kernels (cuda_kernels.h) on the compute stream. A failed
// launch is kept by the device and returned by the next Synchronize.
#include <algorithm>
#include <mutex>
#include <vector>

#include "cuda/cuda_device.h"
#include "cuda/cuda_kernels.h"
#include "dd/kernels/cpu_ops.h"

namespace dd::kernels::cuda {
namespace {

constexpr int kCompute = static_cast<int>(backend::Queue::kCompute);

DevWeights Dev(const WeightView& w) { return {w.type, w.data, w.rows, w.cols, w.row_bytes}; }

// One launch's staged arguments, under the ring's lock.
class Args {
 public:
  // The caller's static segment is ended first: an op with staged lists is never in one.
  Args(CudaDevice& dev, const char* what, int64_t bytes)
      : dev_(Flushed(dev)), lock_(dev.args_mu()), what_(what), ok_(dev.args().Begin(kCompute, bytes)) {
    if (!ok_) dev_.Report(cudaErrorMemoryAllocation, what_);
  }
  bool ok() const { return ok_; }
  template <typename T>
  T* Put(const T* src, int64_t count) {
    return static_cast<T*>(Stage(src, count * static_cast<int64_t>(sizeof(T))));
  }
  template <typename T>
  T* Scratch(int64_t count) {
    return static_cast<T*>(Stage(nullptr, count * static_cast<int64_t>(sizeof(T))));
  }
  // Copies what was staged; false (reported) on failure.
  bool Flush() {
    if (!ok_) return false;
    const cudaError_t err = dev_.args().Flush();
    dev_.Report(err, what_);
    return err == cudaSuccess;
  }

 private:
  void* Stage(const void* src, int64_t bytes) {
    if (!ok_) return nullptr;
    void* p = dev_.args().Stage(kCompute, src, bytes);
    if (p == nullptr) {
      ok_ = false;
      dev_.Report(cudaErrorMemoryAllocation, what_);
    }
    return p;
  }
  static CudaDevice& Flushed(CudaDevice& dev) {
    dev.FlushSegment();
    return dev;
  }
  CudaDevice& dev_;
  std::lock_guard<std::mutex> lock_;
  const char* what_;
  bool ok_;
};

template <typename T>
int64_t SizeOf(int64_t count) {
  return ArgRing::Size(count * static_cast<int64_t>(sizeof(T)));
}

}  // namespace

void CudaOps::Embed(const WeightView& table, absl::Span<const int32_t> tokens, float scale, float* x) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  Args a(dev_, "Embed", SizeOf<int32_t>(n));
  const int32_t* ids = a.Put(tokens.data(), n);
  if (!a.Flush()) return;
  dev_.Report(cuda::DequantRows(Dev(table), ids, n, scale, x, dev_.stream(backend::Queue::kCompute)), "Embed");
}

void CudaOps::DequantizeRows(const WeightView& w, absl::Span<const int32_t> ids, float* out) {
  const int64_t n = static_cast<int64_t>(ids.size());
  Args a(dev_, "DequantizeRows", SizeOf<int32_t>(n));
  const int32_t* d_ids = a.Put(ids.data(), n);
  if (!a.Flush()) return;
  dev_.Report(cuda::DequantRows(Dev(w), d_ids, n, 1.0f, out, dev_.stream(backend::Queue::kCompute)),
              "DequantizeRows");
}

void CudaOps::RopeAngles(const float* inv_freq, int64_t half, absl::Span<const int64_t> positions, float* cos,
                         float* sin) {
  const int64_t n = static_cast<int64_t>(positions.size());
  Args a(dev_, "RopeAngles", SizeOf<float>(half) + SizeOf<int64_t>(n));
  const float* f = a.Put(inv_freq, half);
  const int64_t* p = a.Put(positions.data(), n);
  if (!a.Flush()) return;
  dev_.Report(cuda::RopeAngles(f, half, p, n, cos, sin, dev_.stream(backend::Queue::kCompute)), "RopeAngles");
}

void CudaOps::BeginSegment(int64_t key) {
  if (!dev_.segments().enabled()) return;
  dev_.FlushSegment();
  dev_.segments().Begin(key);
}

void CudaOps::EndSegment() { dev_.FlushSegment(); }

void CudaOps::Issue(const StaticCall& c) {
  if (dev_.segments().OpenHere()) {
    dev_.segments().Add(c);
    return;
  }
  dev_.Report(LaunchStatic(c, dev_.stream(backend::Queue::kCompute)), StaticOpName(c.op));
}

// The static ops (cuda_graphs.cc, LaunchStatic, reads the same fields).
void CudaOps::RmsNormRows(const float* x, const float* w, float eps, int64_t n_rows, int64_t d, float* y) {
  StaticCall c = MakeStaticCall(StaticOp::kRmsNorm);
  c.p[0] = x, c.p[1] = w, c.p[2] = y;
  c.f[0] = eps;
  c.n[0] = n_rows, c.n[1] = d;
  Issue(c);
}

void CudaOps::RmsNormSelected(const float* x, absl::Span<const int64_t> rows, const float* w, float eps, int64_t d,
                              float* y) {
  const int64_t n = static_cast<int64_t>(rows.size());
  Args a(dev_, "RmsNormSelected", SizeOf<int64_t>(n));
  const int64_t* r = a.Put(rows.data(), n);
  if (!a.Flush()) return;
  dev_.Report(cuda::RmsNormRows(x, r, w, eps, n, d, y, dev_.stream(backend::Queue::kCompute)), "RmsNormSelected");
}

void CudaOps::Linear(const WeightView& w, backend::LinearKind kind, const float* x, int64_t n_rows, int64_t x_stride,
                     const float* bias, float* y, int64_t y_stride) {
  const bool f32 = kind != backend::LinearKind::kInt8 || !MatMulInt8Supports(w.type) || w.cols % 32 != 0;
  StaticCall c = MakeStaticCall(f32 ? StaticOp::kLinearF32 : StaticOp::kLinearInt8);
  c.n[0] = static_cast<int64_t>(w.type), c.n[1] = w.rows, c.n[2] = w.cols, c.n[3] = w.row_bytes;
  c.p[0] = w.data, c.p[2] = bias, c.p[4] = f32 ? nullptr : dev_.linear_scratch();
  c.n[5] = x_stride, c.n[6] = y_stride;
  // Rows are independent, so a call larger than the scratch runs in pieces (in order on the
  // compute stream, which orders the scratch's reuse).
  const int64_t row_bytes = f32 ? 0 : Int8ActsBytes(1, w.cols);
  if (!f32 && (row_bytes <= 0 || row_bytes > CudaDevice::kLinearScratchBytes)) {
    dev_.Report(cudaErrorInvalidValue, "Linear (int8): a row of activations does not fit the scratch");
    return;
  }
  const int64_t piece = f32 ? std::max<int64_t>(n_rows, 1) : CudaDevice::kLinearScratchBytes / row_bytes;
  for (int64_t r0 = 0; r0 < n_rows; r0 += piece) {
    c.p[1] = x + r0 * x_stride, c.p[3] = y + r0 * y_stride;
    c.n[4] = std::min(piece, n_rows - r0);
    Issue(c);
  }
}

void CudaOps::HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                           const float* norm_w, float eps, const float* cos, const float* sin, int64_t half,
                           bool neox) {
  StaticCall c = MakeStaticCall(StaticOp::kHeadNormRope);
  c.p[0] = x, c.p[1] = norm_w, c.p[2] = cos, c.p[3] = sin;
  c.f[0] = eps;
  c.n[0] = n_rows, c.n[1] = row_stride, c.n[2] = n_heads, c.n[3] = head_dim, c.n[4] = half, c.n[5] = neox ? 1 : 0;
  Issue(c);
}

void CudaOps::GatedMul(backend::GatedActivation act, const float* gate, const float* up, float* out, int64_t n_rows,
                       int64_t n) {
  StaticCall c = MakeStaticCall(StaticOp::kGatedMul);
  c.n[0] = act == backend::GatedActivation::kGeluTanh ? 0 : 1, c.n[1] = n_rows * n;
  c.p[0] = gate, c.p[1] = up, c.p[2] = out;
  Issue(c);
}

void CudaOps::Add(float* x, const float* y, int64_t n) {
  StaticCall c = MakeStaticCall(StaticOp::kAdd);
  c.p[0] = x, c.p[1] = y;
  c.n[0] = n;
  Issue(c);
}

void CudaOps::Softcap(float* x, int64_t n, float cap) {
  StaticCall c = MakeStaticCall(StaticOp::kSoftcap);
  c.p[0] = x;
  c.n[0] = n;
  c.f[0] = cap;
  Issue(c);
}

void CudaOps::AttendCausal(const backend::CausalAttention& c) {
  const int64_t n = static_cast<int64_t>(c.positions.size()), n_runs = static_cast<int64_t>(c.runs.size());
  runs_.clear();
  for (const backend::KvRun& run : c.runs) runs_.push_back({run.k, run.v, run.len});
  Args a(dev_, "AttendCausal", SizeOf<int64_t>(n) + SizeOf<DevRun>(n_runs));
  const int64_t* p = a.Put(c.positions.data(), n);
  const DevRun* r = a.Put(runs_.data(), n_runs);
  if (!a.Flush()) return;
  const DevShape shape{static_cast<int32_t>(c.shape.n_head), static_cast<int32_t>(c.shape.n_head_kv),
                       static_cast<int32_t>(c.shape.head_dim), c.shape.kv == KvDtype::kF16 ? 1 : 0};
  dev_.Report(cuda::AttendCausal(shape, c.scale, c.sliding, c.window, c.q, c.out, p, n, c.lo, r,
                                 static_cast<int32_t>(n_runs), dev_.stream(backend::Queue::kCompute)),
              "AttendCausal");
}

void CudaOps::AttendGroups(absl::Span<const backend::AttentionGroup> groups, const backend::AttentionShape& shape,
                           float scale) {
  const DevShape dshape{static_cast<int32_t>(shape.n_head), static_cast<int32_t>(shape.n_head_kv),
                        static_cast<int32_t>(shape.head_dim), shape.kv == KvDtype::kF16 ? 1 : 0};
  const int64_t elem = KvDtypeBytes(shape.kv);
  auto bytes = [&] {
    return SizeOf<DevListRow>(static_cast<int64_t>(rows_.size())) + SizeOf<DevList>(static_cast<int64_t>(lists_.size())) +
           SizeOf<KeySeg>(static_cast<int64_t>(segs_.size()));
  };
  auto launch = [&] {
    if (rows_.empty()) return;
    Args a(dev_, "AttendGroups", bytes());
    const DevListRow* r = a.Put(rows_.data(), static_cast<int64_t>(rows_.size()));
    const DevList* l = a.Put(lists_.data(), static_cast<int64_t>(lists_.size()));
    const KeySeg* p = a.Put(segs_.data(), static_cast<int64_t>(segs_.size()));
    if (a.Flush()) {
      dev_.Report(AttendLists(dshape, scale, r, static_cast<int64_t>(rows_.size()), l, p,
                              dev_.stream(backend::Queue::kCompute)),
                  "AttendGroups");
    }
  };
  rows_.clear();
  lists_.clear();
  segs_.clear();
  // Groups are independent: as many per launch as one part of the ring holds. Each list goes
  // as runs of keys (key_segments.h): about a quarter of the bytes of a pointer per key.
  for (const backend::AttentionGroup& g : groups) {
    group_segs_.clear();
    group_lists_.clear();
    for (const backend::KeyValueList& l : g.lists) {
      const int64_t first = static_cast<int64_t>(group_segs_.size());
      const int64_t n_segs = AppendKeySegments(l.keys, l.values, l.n, elem, &group_segs_);
      group_lists_.push_back({first, n_segs, l.n});
    }
    const int64_t extra = static_cast<int64_t>(g.rows.size() * sizeof(DevListRow) + g.lists.size() * sizeof(DevList) +
                                               group_segs_.size() * sizeof(KeySeg)) + 48;
    if (!rows_.empty() && bytes() + extra > dev_.args().part_bytes()) {
      launch();
      rows_.clear();
      lists_.clear();
      segs_.clear();
    }
    const int64_t first_list = static_cast<int64_t>(lists_.size()), seg_base = static_cast<int64_t>(segs_.size());
    for (DevList l : group_lists_) {
      l.seg_offset += seg_base;
      lists_.push_back(l);
    }
    segs_.insert(segs_.end(), group_segs_.begin(), group_segs_.end());
    for (const backend::ListQuery& r : g.rows) rows_.push_back({r.q, r.out, r.hidden_tail, first_list});
  }
  launch();
}

void CudaOps::KeyScores(const float* q, int64_t nq, int64_t head_dim, const float* const* keys, int64_t nk, float* s,
                        int64_t ld) {
  // A read's landmarks over its window lie at one stride: one run, not nk pointers. The
  // speculative row's shortlist comes in rank order, about a run per key: then the pointers,
  // which are smaller. (Per thread: callers may score from several threads at once.)
  thread_local std::vector<KeySeg> segs;
  segs.clear();
  const int64_t n_segs = AppendKeySegments(keys, static_cast<const float* const*>(nullptr), nk,
                                           static_cast<int64_t>(sizeof(float)), &segs);
  const bool runs = SizeOf<KeySeg>(n_segs) <= SizeOf<const float*>(nk);
  Args a(dev_, "KeyScores", runs ? SizeOf<KeySeg>(n_segs) : SizeOf<const float*>(nk));
  const KeySeg* k = runs ? a.Put(segs.data(), n_segs) : nullptr;
  const float* const* p = runs ? nullptr : a.Put(keys, nk);
  if (!a.Flush()) return;
  dev_.Report(cuda::KeyScores(q, nq, head_dim, k, n_segs, p, nk, s, ld, dev_.stream(backend::Queue::kCompute)),
              "KeyScores");
}

void CudaOps::TopChunks(absl::Span<const backend::ChunkScores> lists, int64_t rows, int64_t /*k*/) {
  // Every list is sorted best to worst, which is what `sorted` asks and a valid order otherwise.
  int64_t batch_bytes = 0, batch_scratch = 0;
  auto launch = [&] {
    if (batch_.empty()) return;
    Args a(dev_, "TopChunks",
           batch_bytes + SizeOf<uint64_t>(batch_scratch) + SizeOf<DevChunkList>(static_cast<int64_t>(batch_.size())));
    // The scratch first: staged after the ids it would split their copy in two.
    uint64_t* scratch = a.Scratch<uint64_t>(batch_scratch);
    chunk_lists_.clear();
    for (const backend::ChunkScores* l : batch_) {
      const int64_t n = static_cast<int64_t>(l->chunks.size());
      const int64_t* chunks = a.Put(l->chunks.data(), n);
      chunk_lists_.push_back({l->scores, chunks, n, l->ids, l->take, scratch});
      if (scratch != nullptr) scratch += std::min(n, l->take);
    }
    const DevChunkList* d = a.Put(chunk_lists_.data(), static_cast<int64_t>(chunk_lists_.size()));
    if (a.Flush()) {
      dev_.Report(cuda::TopChunks(d, static_cast<int64_t>(chunk_lists_.size()), rows,
                                  dev_.stream(backend::Queue::kCompute)),
                  "TopChunks");
    }
  };
  batch_.clear();
  for (const backend::ChunkScores& l : lists) {
    const int64_t n = static_cast<int64_t>(l.chunks.size()), scratch = std::min(n, l.take);
    const int64_t need = batch_bytes + SizeOf<int64_t>(n) + SizeOf<uint64_t>(batch_scratch + scratch) +
                         SizeOf<DevChunkList>(static_cast<int64_t>(batch_.size()) + 1);
    if (!batch_.empty() && need > dev_.args().part_bytes()) {
      launch();
      batch_.clear();
      batch_bytes = batch_scratch = 0;
    }
    batch_.push_back(&l);
    batch_bytes += SizeOf<int64_t>(n);
    batch_scratch += scratch;
  }
  launch();
}

void CudaOps::DotRows(absl::Span<const float* const> rows, const float* x, int64_t d, float* out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  Args a(dev_, "DotRows", SizeOf<const float*>(n));
  const float* const* r = a.Put(rows.data(), n);
  if (!a.Flush()) return;
  dev_.Report(cuda::DotRows(r, n, x, d, out, dev_.stream(backend::Queue::kCompute)), "DotRows");
}

void CudaOps::ChunkMeans(const void* const* rows, KvDtype t, int64_t n, int64_t chunk, int64_t kv_dim, float* out) {
  if (n <= 0 || chunk <= 0) return;
  // As many chunks per launch as one part of the argument ring holds (a restored prefix or a
  // prompt pass may complete thousands).
  const int64_t per_launch =
      std::max<int64_t>(1, dev_.args().part_bytes() / (chunk * static_cast<int64_t>(sizeof(const void*))) - 1);
  for (int64_t c0 = 0; c0 < n; c0 += per_launch) {
    const int64_t m = std::min(per_launch, n - c0);
    Args a(dev_, "ChunkMeans", SizeOf<const void*>(m * chunk));
    const void* const* r = a.Put(rows + c0 * chunk, m * chunk);
    if (!a.Flush()) return;
    dev_.Report(cuda::ChunkMeans(r, t == KvDtype::kF16, m, chunk, kv_dim, out + c0 * kv_dim,
                                 dev_.stream(backend::Queue::kCompute)),
                "ChunkMeans");
  }
}

namespace {
// The shape with the staged frequencies.
cuda::LowRankShape ShapeOf(const backend::LowRankKeys& f, const float* inv_freq) {
  return {f.basis, inv_freq, f.rank, f.n_head_kv, f.head_dim, f.half, f.neox, f.kv == KvDtype::kF16};
}
}  // namespace

void CudaOps::ProjectKeys(const backend::LowRankKeys& f, const void* const* rows, absl::Span<const int64_t> positions,
                          float* out) {
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t per_row = static_cast<int64_t>(sizeof(const void*) + sizeof(int64_t));
  const int64_t per_launch = std::max<int64_t>(1, (dev_.args().part_bytes() - SizeOf<float>(f.half)) / per_row - 1);
  for (int64_t i0 = 0; i0 < n; i0 += per_launch) {
    const int64_t m = std::min(per_launch, n - i0);
    Args a(dev_, "ProjectKeys", SizeOf<const void*>(m) + SizeOf<int64_t>(m) + SizeOf<float>(f.half));
    const void* const* r = a.Put(rows + i0, m);
    const int64_t* p = a.Put(positions.data() + i0, m);
    const float* freq = a.Put(f.inv_freq, f.half);
    if (!a.Flush()) return;
    dev_.Report(cuda::ProjectKeys(ShapeOf(f, freq), r, p, m, out + i0 * f.rank, dev_.stream(backend::Queue::kCompute)),
                "ProjectKeys");
  }
}

void CudaOps::ReconstructKeys(const backend::LowRankKeys& f, const float* const* coeffs, absl::Span<const int64_t> first,
                              absl::Span<const int32_t> heads, int64_t chunk, void* const* out) {
  const int64_t n = static_cast<int64_t>(first.size());
  const int64_t per_item = static_cast<int64_t>(sizeof(const float*) + sizeof(int64_t) + sizeof(int32_t) + sizeof(void*));
  const int64_t per_launch = std::max<int64_t>(1, (dev_.args().part_bytes() - SizeOf<float>(f.half)) / per_item - 4);
  for (int64_t i0 = 0; i0 < n; i0 += per_launch) {
    const int64_t m = std::min(per_launch, n - i0);
    Args a(dev_, "ReconstructKeys",
           SizeOf<const float*>(m) + SizeOf<int64_t>(m) + SizeOf<int32_t>(m) + SizeOf<void*>(m) + SizeOf<float>(f.half));
    const float* const* co = a.Put(coeffs + i0, m);
    const int64_t* fi = a.Put(first.data() + i0, m);
    const int32_t* hs = a.Put(heads.data() + i0, m);
    void* const* o = a.Put(out + i0, m);
    const float* freq = a.Put(f.inv_freq, f.half);
    if (!a.Flush()) return;
    dev_.Report(cuda::ReconstructKeys(ShapeOf(f, freq), co, fi, hs, m, chunk, o, dev_.stream(backend::Queue::kCompute)),
                "ReconstructKeys");
  }
}

CudaOps::~CudaOps() {
  if (saturated_ != nullptr) cudaFreeHost(saturated_);
}

void CudaOps::StoreKv(const float* x, int64_t n, KvDtype t, void* out) {
  dev_.FlushSegment();
  const cudaStream_t s = dev_.stream(backend::Queue::kCompute);
  if (t == KvDtype::kF32) {
    if (out != x) {
      dev_.Report(cudaMemcpyAsync(out, x, n * sizeof(float), cudaMemcpyDeviceToDevice, s), "StoreKv");
    }
    return;
  }
  if (saturated_ == nullptr) {
    void* host = nullptr;
    void* dev = nullptr;
    cudaError_t e = cudaHostAlloc(&host, sizeof(unsigned long long), cudaHostAllocMapped);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&dev, host, 0);
    if (e != cudaSuccess) {
      if (host != nullptr) cudaFreeHost(host);
      dev_.Report(e, "StoreKv");
      return;
    }
    saturated_ = static_cast<unsigned long long*>(host);
    *saturated_ = 0;
    saturated_dev_ = static_cast<unsigned long long*>(dev);
  }
  dev_.Report(cuda::StoreF16(x, n, static_cast<uint16_t*>(out), saturated_dev_, s), "StoreKv");
}

int64_t CudaOps::KvOverflows() {
  if (saturated_ == nullptr) return 0;
  return static_cast<int64_t>(*static_cast<volatile unsigned long long*>(saturated_));
}

void CudaOps::ScoreRows(const WeightView& w, absl::Span<const int32_t> ids, const float* x, float* out) {
  const int64_t n = static_cast<int64_t>(ids.size());
  Args a(dev_, "ScoreRows", SizeOf<int32_t>(n));
  const int32_t* d_ids = a.Put(ids.data(), n);
  if (!a.Flush()) return;
  dev_.Report(cuda::ScoreRows(Dev(w), d_ids, n, x, out, dev_.stream(backend::Queue::kCompute)), "ScoreRows");
}

void CudaOps::ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) {
  dev_.FlushSegment();
  dev_.Report(cuda::ArgmaxRows(x, rows, n, out, dev_.stream(backend::Queue::kCompute)), "ArgmaxRows");
}

}  // namespace dd::kernels::cuda
