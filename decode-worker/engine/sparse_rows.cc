#include "decode-worker/engine/sparse_rows.h"

#include <algorithm>

#include "common/status_macros.h"
#include "dd/backend/ops.h"

namespace dd::engine {

using backend::DeviceBuffer;
using backend::MemoryTag;
using backend::Queue;

absl::StatusOr<DeviceBuffer> AllocateOrEmpty(backend::Device& device, MemoryTag tag, int64_t bytes) {
  if (bytes <= 0) return DeviceBuffer{};
  return device.Allocate(tag, bytes);
}

absl::Status DuplicateBuffer(backend::Device& device, const DeviceBuffer& src, bool contents, DeviceBuffer* dst) {
  *dst = DeviceBuffer{};
  if (!src) return absl::OkStatus();
  ASSIGN_OR_RETURN(*dst, AllocateOrEmpty(device, src.tag, src.bytes));
  return contents ? device.Copy(Queue::kCompute, src, 0, *dst, 0, src.bytes) : absl::OkStatus();
}

int64_t SparseRows::RingRows(int64_t total) const {
  // A decode row at n positions reads [dense_from, n) with dense_from >= n - window - chunk + 1
  // (WindowFor), and a chunk is offloaded from its last C positions: window + chunk rows past
  // the sinks hold both.
  const int64_t rows = options_.window_tokens + options_.chunk_tokens;
  if (total <= 0) return rows;
  return std::clamp<int64_t>(total - options_.sink_tokens, 0, rows);
}

absl::Status SparseRows::AllocateRows(int64_t rows, DeviceBuffer* k, DeviceBuffer* v) {
  ASSIGN_OR_RETURN(*k, AllocateOrEmpty(device_, MemoryTag::kKv, rows * RowBytes()));
  auto vb = AllocateOrEmpty(device_, MemoryTag::kKv, rows * RowBytes());
  if (!vb.ok()) {
    device_.Free(*k);
    return vb.status();
  }
  *v = *vb;
  return absl::OkStatus();
}

absl::Status SparseRows::Reserve(LayerRows& st, int64_t prompt_tokens, int64_t total_tokens) {
  const int64_t S = options_.sink_tokens;
  st.sink_cap = std::min(total_tokens, S);
  RETURN_IF_ERROR(AllocateRows(st.sink_cap, &st.sink_k, &st.sink_v));
  // The prompt's rows while it is prefilled; the ring's once it is in.
  st.cap = std::max(prompt_tokens - S, RingRows(total_tokens));
  RETURN_IF_ERROR(AllocateRows(st.cap, &st.k, &st.v));
  st.landmark_cap = total_tokens / options_.chunk_tokens;
  ASSIGN_OR_RETURN(st.landmarks, AllocateOrEmpty(device_, MemoryTag::kLandmarks, st.landmark_cap * LandmarkBytes()));
  return absl::OkStatus();
}

absl::Status SparseRows::Idle() {
  device_.Wait(Queue::kCompute, device_.Record(Queue::kWriteBack));
  return device_.Synchronize(device_.Record(Queue::kCompute));
}

void SparseRows::Free(LayerRows& st) {
  for (DeviceBuffer* b : {&st.sink_k, &st.sink_v, &st.k, &st.v, &st.landmarks}) device_.Free(*b);
  st.sink_cap = st.cap = st.ring = st.landmark_cap = 0;
}

int64_t SparseRows::bytes(const LayerRows& st) const {
  return st.sink_k.bytes + st.sink_v.bytes + st.k.bytes + st.v.bytes + st.landmarks.bytes;
}

int SparseRows::RunsOf(const LayerRows& st, int64_t p0, int64_t p1, RowRun out[3]) const {
  const int64_t S = options_.sink_tokens;
  int n = 0;
  for (int64_t a = p0; a < p1;) {
    RowRun& r = out[n++];
    r.pos = a;
    if (a < S) {
      r.sink = true;
      r.row = a;
      r.len = std::min(p1, S) - a;
    } else {
      r.sink = false;
      r.row = RowOf(st, a);
      r.len = p1 - a;
      if (st.ring > 0) r.len = std::min(r.len, st.ring - r.row);
    }
    a += r.len;
  }
  return n;
}

const void* SparseRows::K(const LayerRows& st, int64_t pos) const {
  return pos < options_.sink_tokens ? static_cast<const char*>(st.sink_k.data) + pos * RowBytes()
                                    : static_cast<const char*>(st.k.data) + RowOf(st, pos) * RowBytes();
}

const void* SparseRows::V(const LayerRows& st, int64_t pos) const {
  return pos < options_.sink_tokens ? static_cast<const char*>(st.sink_v.data) + pos * RowBytes()
                                    : static_cast<const char*>(st.v.data) + RowOf(st, pos) * RowBytes();
}

absl::Status SparseRows::Resize(LayerRows& st, int64_t cap, bool ring) {
  const int64_t row = RowBytes(), S = options_.sink_tokens;
  LayerRows n;  // the new k/v only
  n.cap = cap;
  n.ring = ring ? cap : 0;
  RETURN_IF_ERROR(AllocateRows(cap, &n.k, &n.v));
  // The positions past the sinks that both hold.
  int64_t from = S;
  if (st.ring > 0) from = std::max(from, st.length - st.ring);
  if (n.ring > 0) from = std::max(from, st.length - n.ring);
  absl::Status status;
  for (int64_t a = from; a < st.length && st.cap > 0 && status.ok();) {
    int64_t len = st.length - a;
    if (st.ring > 0) len = std::min(len, st.ring - RowOf(st, a));
    const int64_t to = n.ring > 0 ? (a - S) % n.ring : a - S;
    if (n.ring > 0) len = std::min(len, n.ring - to);
    status.Update(device_.Copy(Queue::kCompute, st.k, RowOf(st, a) * row, n.k, to * row, len * row));
    status.Update(device_.Copy(Queue::kCompute, st.v, RowOf(st, a) * row, n.v, to * row, len * row));
    a += len;
  }
  if (status.ok() && st.cap > 0) status = Idle();
  if (!status.ok()) {
    (void)Idle();
    device_.Free(n.k);
    device_.Free(n.v);
    return status;
  }
  device_.Free(st.k);
  device_.Free(st.v);
  st.k = n.k;
  st.v = n.v;
  st.cap = n.cap;
  st.ring = n.ring;
  return absl::OkStatus();
}

absl::Status SparseRows::Ensure(LayerRows& st, int64_t end) {
  const int64_t S = options_.sink_tokens, row = RowBytes();
  if (st.sink_cap < std::min(end, S)) {  // an unreserved slot: every sink row at once
    DeviceBuffer k, v;
    RETURN_IF_ERROR(AllocateRows(S, &k, &v));
    absl::Status status;
    if (st.sink_cap > 0) {
      status.Update(device_.Copy(Queue::kCompute, st.sink_k, 0, k, 0, st.sink_cap * row));
      status.Update(device_.Copy(Queue::kCompute, st.sink_v, 0, v, 0, st.sink_cap * row));
      status.Update(Idle());
    }
    device_.Free(st.sink_k);
    device_.Free(st.sink_v);
    st.sink_k = k;
    st.sink_v = v;
    st.sink_cap = S;
    RETURN_IF_ERROR(status);
  }
  if (st.ring > 0 || end <= S + st.cap) return absl::OkStatus();
  return Resize(st, std::max({end - S, 2 * st.cap, int64_t{64}}), /*ring=*/false);
}

absl::Status SparseRows::EnsureLandmarks(LayerRows& st, int64_t chunks) {
  if (chunks <= st.landmark_cap) return absl::OkStatus();
  const int64_t per_chunk = LandmarkBytes();
  const int64_t cap = std::max({chunks, 2 * st.landmark_cap, int64_t{16}});
  ASSIGN_OR_RETURN(DeviceBuffer n, AllocateOrEmpty(device_, MemoryTag::kLandmarks, cap * per_chunk));
  if (st.landmark_cap > 0) {
    absl::Status status = device_.Copy(Queue::kCompute, st.landmarks, 0, n, 0, st.landmark_cap * per_chunk);
    status.Update(Idle());
    if (!status.ok()) {
      device_.Free(n);
      return status;
    }
  }
  device_.Free(st.landmarks);
  st.landmarks = n;
  st.landmark_cap = cap;
  return absl::OkStatus();
}

absl::Status SparseRows::Store(LayerRows& st, int64_t p0, int64_t p1, const DeviceBuffer& src_buf, const float* k,
                               const float* v) {
  const int64_t row = RowBytes(), kv_dim = config_.n_head_kv * config_.head_dim;
  RowRun runs[3];
  const int n = RunsOf(st, p0, p1, runs);
  for (int i = 0; i < n; ++i) {
    const RowRun& r = runs[i];
    const DeviceBuffer& dk = r.sink ? st.sink_k : st.k;
    const DeviceBuffer& dv = r.sink ? st.sink_v : st.v;
    const int64_t j = (r.pos - p0) * kv_dim;
    if (kv_ != KvDtype::kF32) {  // narrowed on the compute queue, straight into the rows
      device_.ops().StoreKv(k + j, r.len * kv_dim, kv_, static_cast<char*>(dk.data) + r.row * row);
      device_.ops().StoreKv(v + j, r.len * kv_dim, kv_, static_cast<char*>(dv.data) + r.row * row);
    } else if (src_buf) {
      const auto offset = [&](const float* p) {
        return static_cast<int64_t>(reinterpret_cast<const char*>(p) - static_cast<const char*>(src_buf.data));
      };
      RETURN_IF_ERROR(device_.Copy(Queue::kCompute, src_buf, offset(k + j), dk, r.row * row, r.len * row));
      RETURN_IF_ERROR(device_.Copy(Queue::kCompute, src_buf, offset(v + j), dv, r.row * row, r.len * row));
    } else {
      RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, k + j, dk, r.row * row, r.len * row));
      RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, v + j, dv, r.row * row, r.len * row));
    }
  }
  return absl::OkStatus();
}

absl::Status SparseRows::StoreHost(LayerRows& st, int64_t p0, int64_t p1, const void* k, const void* v) {
  return EachRun(st, p0, p1, [&](bool sink, int64_t at, int64_t host, int64_t bytes) {
    RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, static_cast<const char*>(k) + host, sink ? st.sink_k : st.k,
                                         at, bytes));
    return device_.CopyToDevice(Queue::kCompute, static_cast<const char*>(v) + host, sink ? st.sink_v : st.v, at,
                                bytes);
  });
}

absl::Status SparseRows::ToHost(Queue q, const LayerRows& st, int64_t p0, int64_t p1, void* k, void* v) {
  return EachRun(st, p0, p1, [&](bool sink, int64_t at, int64_t host, int64_t bytes) {
    RETURN_IF_ERROR(device_.CopyToHost(q, sink ? st.sink_k : st.k, at, static_cast<char*>(k) + host, bytes));
    return device_.CopyToHost(q, sink ? st.sink_v : st.v, at, static_cast<char*>(v) + host, bytes);
  });
}

absl::Status SparseRows::Duplicate(const LayerRows& from, LayerRows& to) {
  const std::pair<const DeviceBuffer*, DeviceBuffer*> pairs[] = {{&from.sink_k, &to.sink_k},
                                                                 {&from.sink_v, &to.sink_v},
                                                                 {&from.k, &to.k},
                                                                 {&from.v, &to.v},
                                                                 {&from.landmarks, &to.landmarks}};
  for (const auto& [src, dst] : pairs) RETURN_IF_ERROR(DuplicateBuffer(device_, *src, /*contents=*/true, dst));
  return absl::OkStatus();
}

absl::Status SparseRows::StartDecoding(LayerRows& st, int64_t total) {
  if (st.decoded) return absl::OkStatus();
  st.decoded = true;
  const int64_t rows = RingRows(total);
  if (st.ring > 0 || rows == 0) return absl::OkStatus();
  if (st.cap == rows) {  // already the ring's size: rows (pos - sinks) are ring rows
    st.ring = rows;
    return absl::OkStatus();
  }
  return Resize(st, rows, /*ring=*/true);
}

}  // namespace dd::engine
