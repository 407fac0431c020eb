// A sparse layer's device rows for one sequence: the attention sinks (positions [0, sinks)), the
// rows past them — the whole prompt while it is prefilled, then a ring of the decode window's
// rows — and one landmark per full chunk per KV head (the mean of the chunk's post-RoPE keys).
// Sized at admission (Reserve) or grown geometrically on an unreserved slot (tests). The host
// reaches them only through the device's copies, so they work on devices the host cannot
// touch (sim, cuda).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kv_dtype.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

// A buffer of `bytes` (an empty one for 0).
absl::StatusOr<backend::DeviceBuffer> AllocateOrEmpty(backend::Device& device, backend::MemoryTag tag, int64_t bytes);
// *dst: a buffer like `src` (empty if src is), holding its bytes when `contents`.
absl::Status DuplicateBuffer(backend::Device& device, const backend::DeviceBuffer& src, bool contents,
                             backend::DeviceBuffer* dst);

struct LayerRows {
  int64_t length = 0;  // positions written
  // Device rows (n_kv × hd elements of the KV type each): positions [0, sinks) in sink_k/v at row = position;
  // positions from `sinks` on in k/v at row (pos - sinks), or (pos - sinks) % ring once the
  // prompt is in (ring > 0: the decode window).
  backend::DeviceBuffer sink_k, sink_v, k, v;
  int64_t sink_cap = 0, cap = 0, ring = 0;  // rows
  backend::DeviceBuffer landmarks;          // per full chunk, n_kv × hd floats (f32 in every KV type)
  int64_t landmark_cap = 0;                 // chunks
  bool decoded = false;                     // a decode row has run (no more dense prefill)
};

class SparseRows {
 public:
  SparseRows(const model::ModelConfig& config, const SparseOptions& options, backend::Device& device, KvDtype kv)
      : config_(config), options_(options), device_(device), kv_(kv) {}
  KvDtype kv_dtype() const { return kv_; }
  // Bytes of one position's K row (or V row) in the KV type.
  int64_t RowBytes() const { return config_.n_head_kv * config_.head_dim * KvDtypeBytes(kv_); }

  // Every buffer of a request of `prompt_tokens` growing to `total_tokens`.
  absl::Status Reserve(LayerRows& st, int64_t prompt_tokens, int64_t total_tokens);
  // Room for positions up to `end` / `chunks` landmarks.
  absl::Status Ensure(LayerRows& st, int64_t end);
  absl::Status EnsureLandmarks(LayerRows& st, int64_t chunks);
  // Stores positions [p0, p1) of the forward pass's f32 rows k, v (in `src_buf`, device memory,
  // or host memory when it is empty) into the device rows, in the KV type (complete when the
  // caller synchronizes).
  absl::Status Store(LayerRows& st, int64_t p0, int64_t p1, const backend::DeviceBuffer& src_buf, const float* k,
                     const float* v);
  // The same from host rows already in the KV type (a restored prefix, random KV).
  absl::Status StoreHost(LayerRows& st, int64_t p0, int64_t p1, const void* k, const void* v);
  // Enqueues on `q` copies of positions [p0, p1) into host rows k and v (KV type; complete
  // after an event recorded on `q` after them).
  absl::Status ToHost(backend::Queue q, const LayerRows& st, int64_t p0, int64_t p1, void* k, void* v);
  // The first decode row: the prompt's linear rows become the window's ring (for a sequence
  // that may reach `total` positions; 0: unknown).
  absl::Status StartDecoding(LayerRows& st, int64_t total);
  absl::Status Duplicate(const LayerRows& from, LayerRows& to);
  void Free(LayerRows& st);
  int64_t bytes(const LayerRows& st) const;

  // Device addresses of position `pos`'s K and V rows (held: a sink, or in the rows), and of
  // chunk `chunk`'s landmark for KV head g.
  const void* K(const LayerRows& st, int64_t pos) const;
  const void* V(const LayerRows& st, int64_t pos) const;
  const float* Landmark(const LayerRows& st, int64_t chunk, int64_t g) const {
    return static_cast<const float*>(st.landmarks.data) + (chunk * config_.n_head_kv + g) * config_.head_dim;
  }

 private:
  // Waits until no queue reads the rows any more (the compute queue's work, and the
  // write-back's copies), so that buffers may be freed or replaced.
  absl::Status Idle();
  int64_t LandmarkBytes() const { return config_.n_head_kv * config_.head_dim * static_cast<int64_t>(sizeof(float)); }
  int64_t RingRows(int64_t total) const;
  int64_t RowOf(const LayerRows& st, int64_t pos) const {
    const int64_t i = pos - options_.sink_tokens;
    return st.ring > 0 ? i % st.ring : i;
  }
  // K and V buffers of `rows` rows each; nothing kept on failure.
  absl::Status AllocateRows(int64_t rows, backend::DeviceBuffer* k, backend::DeviceBuffer* v);
  // Gives `st` k/v of `cap` rows (a ring when `ring`), keeping the positions that fit.
  absl::Status Resize(LayerRows& st, int64_t cap, bool ring);
  // Positions [p0, p1) as runs contiguous in one buffer pair: `sink` runs in sink_k/v, the
  // others in k/v, from row `row` on. At most three (sinks, then a ring's wrap).
  struct RowRun {
    int64_t pos = 0, len = 0, row = 0;
    bool sink = false;
  };
  int RunsOf(const LayerRows& st, int64_t p0, int64_t p1, RowRun out[3]) const;
  // f(sink, byte offset in the run's buffer, byte offset in host rows from p0, bytes) for each
  // run of [p0, p1); the first error stops.
  template <typename F>
  absl::Status EachRun(const LayerRows& st, int64_t p0, int64_t p1, F f) const {
    const int64_t row = RowBytes();
    RowRun runs[3];
    const int n = RunsOf(st, p0, p1, runs);
    for (int i = 0; i < n; ++i) {
      const RowRun& r = runs[i];
      if (absl::Status s = f(r.sink, r.row * row, (r.pos - p0) * row, r.len * row); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  const model::ModelConfig& config_;
  const SparseOptions& options_;
  backend::Device& device_;
  const KvDtype kv_;
};

}  // namespace dd::engine
