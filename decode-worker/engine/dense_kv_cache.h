// Dense KV cache: every position of every layer kept in (device) memory; attention over all
// of them. The `full` decode mode, and the reference the sparse modes are checked against.
//
// Memory is f32, per sequence slot and layer, grown geometrically; device_bytes() counts the
// rows in use. Sliding-window layers keep only a ring of the last window + step rows,
// so their memory does not grow with the context. Not thread-safe; used from the engine's
// compute thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "dd/backend/ops.h"
#include "decode-worker/engine/kv_cache.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

class DenseKvCache : public KvCache {
 public:
  // `ops` (the engine's device's) must outlive the cache.
  DenseKvCache(const model::ModelConfig& config, backend::Ops& ops);

  // Slots are created on demand.
  void Reset(int32_t seq) override;
  absl::Status Copy(int32_t src, int32_t dst) override;
  // The longest of the layers' lengths (all equal after a complete forward).
  int64_t Length(int32_t seq) const override;
  int64_t device_bytes() const override;

  absl::Status Attend(const model::AttentionCall& call) override;
  // Keeps, in layers [0, layers), the KV the last speculative row of slot `seq` wrote (a
  // speculative row's KV is otherwise dropped): for the dual-token step's carry, when the
  // next real row has that row's token and position, so its KV bits are the same.
  // FailedPrecondition (and nothing kept) unless every such layer's last write was a
  // speculative row right at the end of the stored positions.
  absl::Status KeepSpeculative(int32_t seq, int64_t layers);

  // K and V rows (n_head_kv × head_dim) of a stored position still held (a sliding layer
  // holds the last window positions only); nullptr otherwise.
  const float* KRow(int32_t seq, int64_t layer, int64_t pos) const;
  const float* VRow(int32_t seq, int64_t layer, int64_t pos) const;
  // Makes `layer` of slot `seq` hold `length` positions, of which the rows of positions
  // [length - n, length) are given (k and v: n × n_head_kv × head_dim): the state after a
  // prefill of `length` tokens, for a sliding layer when n >= min(length, window).
  void LoadRows(int32_t seq, int64_t layer, int64_t length, const float* k, const float* v, int64_t n);

 private:
  struct Slot {
    std::vector<int64_t> length;           // per layer: positions stored
    std::vector<std::vector<float>> k, v;  // per layer: positions × n_head_kv × head_dim
    std::vector<int64_t> ring;             // per layer: ring size in positions (0 = linear)
    std::vector<int64_t> spec_pos;         // per layer: the last write's speculative row (-1: none)
  };
  // Makes room for positions [p0, p1] of `layer`; returns the storage row of position p
  // through RowOf().
  void Reserve(Slot& slot, int64_t layer, bool sliding, int64_t window, int64_t p0, int64_t p1);
  static int64_t RowOf(const Slot& slot, int64_t layer, int64_t pos) {
    const int64_t r = slot.ring[layer];
    return r > 0 ? pos % r : pos;
  }
  Slot& GetSlot(int32_t seq);
  void AttendGroup(const model::AttentionCall& call, Slot& slot, int64_t r0, int64_t r1);

  const model::ModelConfig& config_;
  backend::Ops& ops_;
  std::vector<Slot> slots_;
  std::vector<int64_t> positions_;  // AttendGroup's rows' positions
};

}  // namespace dd::engine
