#include "dd/backend/cpu_device.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/attention_rows.h"
#include "dd/backend/device_checks.h"
#include "dd/kernels/cpu_ops.h"
#include "dd/kernels/low_rank_keys.h"
#include "glog/logging.h"

namespace dd::backend {

absl::string_view MemoryTagName(MemoryTag tag) {
  switch (tag) {
    case MemoryTag::kWeights: return "weights";
    case MemoryTag::kWorkspace: return "workspace";
    case MemoryTag::kKv: return "kv";
    case MemoryTag::kLandmarks: return "landmarks";
    case MemoryTag::kResidentSlots: return "resident_slots";
    case MemoryTag::kLowRankKeys: return "low_rank_keys";
    case MemoryTag::kCount: break;
  }
  return "unknown";
}

absl::string_view QueueName(Queue q) {
  switch (q) {
    case Queue::kUrgent: return "urgent";
    case Queue::kCompute: return "compute";
    case Queue::kPrefetch: return "prefetch";
    case Queue::kWriteBack: return "write_back";
    case Queue::kCount: break;
  }
  return "unknown";
}

// ---- ops: the exact kernel calls and row splits the forward pass made before the seam ----

CpuOps::CpuOps(ThreadPool& pool) : pool_(pool), scratch_(std::make_unique<cpu::AttentionScratch>()) {}
CpuOps::~CpuOps() = default;

void CpuOps::Embed(const kernels::WeightView& table, absl::Span<const int32_t> tokens, float scale, float* x) {
  const int64_t d = table.cols;
  pool_.ParallelFor(static_cast<int64_t>(tokens.size()), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* xi = x + i * d;
      kernels::DequantizeRow(table.type, table.data + tokens[i] * table.row_bytes, xi, d);
      if (scale != 1.0f) {
        for (int64_t j = 0; j < d; ++j) xi[j] *= scale;
      }
    }
  });
}

void CpuOps::RopeAngles(const float* inv_freq, int64_t half, absl::Span<const int64_t> positions, float* cos,
                        float* sin) {
  pool_.ParallelFor(static_cast<int64_t>(positions.size()), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) kernels::RopeAngles(inv_freq, half, positions[i], cos + i * half, sin + i * half);
  });
}

void CpuOps::RmsNormRows(const float* x, const float* w, float eps, int64_t n_rows, int64_t d, float* y) {
  pool_.ParallelFor(n_rows, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) kernels::RmsNorm(x + r * d, w, eps, d, y + r * d);
  });
}

void CpuOps::RmsNormSelected(const float* x, absl::Span<const int64_t> rows, const float* w, float eps, int64_t d,
                             float* y) {
  for (size_t j = 0; j < rows.size(); ++j) kernels::RmsNorm(x + rows[j] * d, w, eps, d, y + j * d);
}

void CpuOps::Linear(const kernels::WeightView& w, LinearKind kind, const float* x, int64_t n_rows, int64_t x_stride,
                    const float* bias, float* y, int64_t y_stride) {
  if (kind == LinearKind::kInt8) {
    kernels::MatMulInt8(w, x, n_rows, x_stride, bias, y, y_stride, pool_);
  } else {
    kernels::MatMul(w, x, n_rows, x_stride, bias, y, y_stride, pool_);
  }
}

void CpuOps::HeadNormRope(float* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t head_dim,
                          const float* norm_w, float eps, const float* cos, const float* sin, int64_t half,
                          bool neox) {
  pool_.ParallelFor(n_rows, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      for (int64_t h = 0; h < n_heads; ++h) {
        float* xh = x + i * row_stride + h * head_dim;
        if (norm_w != nullptr) kernels::RmsNorm(xh, norm_w, eps, head_dim, xh);
        kernels::ApplyRope(xh, half, cos + i * half, sin + i * half, neox);
      }
    }
  });
}

void CpuOps::GatedMul(GatedActivation act, const float* gate, const float* up, float* out, int64_t n_rows,
                      int64_t n) {
  // Whole rows per thread: the vectorized activation's tail handling sees the same ranges
  // whatever the thread count.
  pool_.ParallelFor(n_rows, [&](int64_t b, int64_t e) {
    if (act == GatedActivation::kGeluTanh) {
      kernels::GeluTanhMul(gate + b * n, up + b * n, out + b * n, (e - b) * n);
    } else {
      kernels::SiluMul(gate + b * n, up + b * n, out + b * n, (e - b) * n);
    }
  });
}

void CpuOps::Add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void CpuOps::Softcap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

void CpuOps::AttendCausal(const CausalAttention& a) { cpu::AttendCausal(a, pool_, scratch_.get()); }

void CpuOps::AttendGroups(absl::Span<const AttentionGroup> groups, const AttentionShape& shape, float scale) {
  cpu::AttendGroups(groups, shape, scale, pool_, scratch_.get());
}

void CpuOps::TopChunks(absl::Span<const ChunkScores> lists, int64_t rows, int64_t k) {
  // One integer key per chunk, smaller = better: the score's bits mapped to an unsigned order
  // (−0 counted as +0, so they tie as floats do), inverted, above the chunk id (below 2^32).
  // nth_element on these is several times faster than on (score, chunk) pairs.
  const auto key_of = [](float score, int64_t chunk) {
    uint32_t u;
    const float canonical = score + 0.0f;  // −0 → +0
    std::memcpy(&u, &canonical, sizeof(u));
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with the float
    return (static_cast<uint64_t>(~u) << 32) | static_cast<uint32_t>(chunk);
  };
  thread_local std::vector<uint64_t> keys;
  for (const ChunkScores& l : lists) {
    const int64_t n = static_cast<int64_t>(l.chunks.size());
    keys.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      float best = -INFINITY;
      for (int64_t h = 0; h < rows; ++h) best = std::max(best, l.scores[h * n + i]);
      keys[i] = key_of(best, l.chunks[i]);
    }
    const int64_t take = std::min(n, l.take), best_k = std::min(take, k);
    if (take < n) std::nth_element(keys.begin(), keys.begin() + take, keys.end());
    if (best_k < take) std::nth_element(keys.begin(), keys.begin() + best_k, keys.begin() + take);
    if (l.sorted) std::sort(keys.begin(), keys.begin() + best_k);
    for (int64_t i = 0; i < take; ++i) l.ids[i] = static_cast<int64_t>(keys[i] & 0xffffffffu);
  }
}

void CpuOps::KeyScores(const float* q, int64_t nq, int64_t head_dim, const float* const* keys, int64_t nk, float* s,
                       int64_t ld) {
  kernels::AttentionScores(q, nq, head_dim, keys, nk, s, ld);
}

void CpuOps::ChunkMeans(const void* const* rows, KvDtype t, int64_t n, int64_t chunk, int64_t kv_dim, float* out) {
  thread_local std::vector<double> sum;
  for (int64_t c = 0; c < n; ++c) {
    sum.assign(kv_dim, 0.0);
    for (int64_t i = 0; i < chunk; ++i) {
      const void* r = rows[c * chunk + i];
      if (t == KvDtype::kF16) {
        const auto* h = static_cast<const uint16_t*>(r);
        for (int64_t j = 0; j < kv_dim; ++j) sum[j] += kernels::F16ToF32(h[j]);
      } else {
        const auto* f = static_cast<const float*>(r);
        for (int64_t j = 0; j < kv_dim; ++j) sum[j] += f[j];
      }
    }
    for (int64_t j = 0; j < kv_dim; ++j) out[c * kv_dim + j] = static_cast<float>(sum[j] / static_cast<double>(chunk));
  }
}

void CpuOps::StoreKv(const float* x, int64_t n, KvDtype t, void* out) {
  if (t == KvDtype::kF32) {
    if (out != x) std::memcpy(out, x, n * sizeof(float));
    return;
  }
  const int64_t saturated = kernels::F32ToF16Saturating(x, n, static_cast<uint16_t*>(out));
  if (saturated > 0) kv_overflows_.fetch_add(saturated, std::memory_order_relaxed);
}

void CpuOps::ProjectKeys(const LowRankKeys& f, const void* const* rows, absl::Span<const int64_t> positions,
                         float* out) {
  const int64_t n = static_cast<int64_t>(positions.size());
  auto run = [&](int64_t b, int64_t e) { kernels::ProjectKeyRows(f, rows, positions.data(), b, e, out); };
  if (pool_.active() > 1 && n >= 64) {  // a prefill's chunks; a decode step's one chunk inline
    pool_.ParallelFor(n, run);
  } else {
    run(0, n);
  }
}

void CpuOps::ReconstructKeys(const LowRankKeys& f, const float* const* coeffs, absl::Span<const int64_t> first,
                             absl::Span<const int32_t> heads, int64_t chunk, void* const* out) {
  const int64_t n = static_cast<int64_t>(first.size());
  auto run = [&](int64_t b, int64_t e) {
    kernels::ReconstructKeyChunks(f, coeffs, first.data(), heads.data(), chunk, b, e, out);
  };
  if (pool_.active() > 1 && n >= 4) {
    pool_.ParallelFor(n, run);
  } else {
    run(0, n);
  }
}

void CpuOps::DequantizeRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, float* out) {
  const int64_t n = static_cast<int64_t>(ids.size()), d = w.cols;
  auto fill = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) kernels::DequantizeRow(w.type, w.data + ids[i] * w.row_bytes, out + i * d, d);
  };
  // After a prefill thousands of rows are new at once; a few are not worth the wake-ups.
  if (pool_.active() > 1 && n >= 1024) {
    pool_.ParallelFor(n, fill);
  } else {
    fill(0, n);
  }
}

void CpuOps::DotRows(absl::Span<const float* const> rows, const float* x, int64_t d, float* out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  auto run = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = kernels::Dot(rows[i], x, d);
  };
  // ~0.1 µs a row: split only when it pays for the wake-ups.
  if (pool_.active() > 1 && n >= 2048) {
    pool_.ParallelFor(n, run);
  } else {
    run(0, n);
  }
}

void CpuOps::ArgmaxRows(const float* x, int64_t rows, int64_t n, int32_t* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = kernels::ArgmaxFirst(x + r * n, n);
}

void CpuOps::ScoreRows(const kernels::WeightView& w, absl::Span<const int32_t> ids, const float* x, float* out) {
  const int64_t n = static_cast<int64_t>(ids.size()), d = w.cols;
  auto run = [&](int64_t b, int64_t e) {
    std::vector<float> row(d);  // one dequantized row at a time per thread
    for (int64_t i = b; i < e; ++i) {
      kernels::DequantizeRow(w.type, w.data + ids[i] * w.row_bytes, row.data(), d);
      out[i] = kernels::Dot(row.data(), x, d);
    }
  };
  // ~1 µs a row: split only when it pays for the wake-ups.
  if (pool_.active() > 1 && n >= 2048) {
    pool_.ParallelFor(n, run);
  } else {
    run(0, n);
  }
}

// ---- device ----

CpuDevice::~CpuDevice() {
  CHECK_EQ(live_buffers_, 0) << "cpu device destroyed with " << total_in_use_ << " bytes still allocated";
}

absl::StatusOr<DeviceBuffer> CpuDevice::Allocate(MemoryTag tag, int64_t bytes) {
  if (absl::Status s = internal::CheckAllocation(tag, bytes, total_in_use_, budget_); !s.ok()) return s;
  constexpr int64_t kAlign = 64;
  const int64_t rounded = (std::max<int64_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, static_cast<size_t>(rounded));
  if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("host allocation of ", bytes, " bytes failed"));
  in_use_[static_cast<int>(tag)] += bytes;
  total_in_use_ += bytes;
  ++live_buffers_;
  return DeviceBuffer{p, bytes, tag};
}

absl::StatusOr<DeviceBuffer> CpuDevice::Upload(MemoryTag tag, const void* src, int64_t bytes) {
  if (absl::Status s = internal::CheckAllocation(tag, bytes, total_in_use_, budget_); !s.ok()) return s;
  if (src == nullptr || bytes == 0) return absl::InvalidArgumentError("upload of no bytes");
  in_place_.insert(src);
  in_use_[static_cast<int>(tag)] += bytes;
  total_in_use_ += bytes;
  ++live_buffers_;
  return DeviceBuffer{const_cast<void*>(src), bytes, tag};
}

void CpuDevice::Free(DeviceBuffer& buf) {
  if (buf.data == nullptr) return;
  if (in_place_.erase(buf.data) == 0) std::free(buf.data);
  in_use_[static_cast<int>(buf.tag)] -= buf.bytes;
  total_in_use_ -= buf.bytes;
  --live_buffers_;
  buf = DeviceBuffer{};
}

Event CpuDevice::Record(Queue q) { return Event{q, ++recorded_[static_cast<int>(q)]}; }

using internal::CheckRange;

absl::Status CpuDevice::CopyToDevice(Queue, const void* src, const DeviceBuffer& dst, int64_t dst_offset,
                                     int64_t bytes) {
  if (absl::Status s = CheckRange("copy to device", dst_offset, bytes, dst.bytes); !s.ok()) return s;
  if (bytes > 0) std::memcpy(static_cast<char*>(dst.data) + dst_offset, src, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status CpuDevice::CopyToHost(Queue, const DeviceBuffer& src, int64_t src_offset, void* dst, int64_t bytes) {
  if (absl::Status s = CheckRange("copy to host", src_offset, bytes, src.bytes); !s.ok()) return s;
  if (bytes > 0) std::memcpy(dst, static_cast<const char*>(src.data) + src_offset, static_cast<size_t>(bytes));
  return absl::OkStatus();
}

absl::Status CpuDevice::Copy(Queue, const DeviceBuffer& src, int64_t src_offset, const DeviceBuffer& dst,
                             int64_t dst_offset, int64_t bytes) {
  if (absl::Status s = internal::CheckCopy(src, src_offset, dst, dst_offset, bytes); !s.ok()) return s;
  if (bytes > 0) {
    std::memcpy(static_cast<char*>(dst.data) + dst_offset, static_cast<const char*>(src.data) + src_offset,
                static_cast<size_t>(bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<HostRegion> CpuDevice::RegisterHostRegion(const void* base, int64_t bytes) {
  return regions_.Register(base, bytes);
}

void CpuDevice::UnregisterHostRegion(const HostRegion& region) { regions_.Unregister(region); }

absl::Status CpuDevice::Gather(Queue, const HostRegion& region, absl::Span<const GatherBlock> blocks,
                               int64_t block_bytes, const DeviceBuffer& dst) {
  auto r = regions_.CheckGather(region, blocks, block_bytes, dst);
  if (!r.ok()) return r.status();
  for (const GatherBlock& b : blocks) {
    std::memcpy(static_cast<char*>(dst.data) + b.dst, static_cast<const char*>(r->base) + b.src,
                static_cast<size_t>(block_bytes));
  }
  return absl::OkStatus();
}

}  // namespace dd::backend
