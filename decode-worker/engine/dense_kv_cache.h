// Dense KV cache: every position of every layer kept in device memory; attention over all of
// them. The `full` decode mode, and the reference the sparse modes are checked against.
//
// Memory is f32 K and V device buffers (MemoryTag::kKv) per sequence slot and layer. Reserve
// sizes a slot at admission for its whole request — global layers for every position it may
// reach, sliding-window layers a ring of window - 1 + one pass's rows — and FinishPrefill
// shrinks the rings to window + 1 rows once the prompt is in, so device_bytes() is what
// MemoryPlan projects for the request. A slot used without Reserve grows geometrically
// instead (tests; the sparse cache's sliding layers). Not thread-safe; used from the engine's
// compute thread; copies run on the compute queue, in order with attention.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/attention_plan.h"
#include "decode-worker/engine/kv_manager.h"
#include "decode-worker/engine/random_kv.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

class DenseKvCache : public KvManager {
 public:
  // `device` (the engine's) must outlive the cache.
  // KV rows are kept in `kv` (docs/decisions/0049-kv-storage-type.md).
  DenseKvCache(const model::ModelConfig& config, backend::Device& device, KvDtype kv = KvDtype::kF32);
  ~DenseKvCache() override;

  // Allocates empty slot `seq` for a request of `prompt_tokens` growing to `total_tokens`,
  // prefilled `pass_rows` rows per pass at most. RESOURCE_EXHAUSTED (nothing kept) when the
  // device cannot hold it; FAILED_PRECONDITION when the slot is in use.
  absl::Status Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows) override {
    return ReserveLayers(seq, prompt_tokens, total_tokens, pass_rows, nullptr);
  }
  // Reserve for just the layers flagged in `only` (one flag per layer; all when null): the
  // sparse cache's dense ones.
  absl::Status ReserveLayers(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows,
                             const std::vector<bool>* only);
  // The prompt is in: sliding-window rings shrink to the window + 1 rows decoding needs.
  absl::Status FinishPrefill(int32_t seq) override;
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

  // K and V rows (n_head_kv × head_dim, device memory) of a stored position still held (a
  // sliding layer holds the last window positions only); nullptr otherwise.
  const void* KRow(int32_t seq, int64_t layer, int64_t pos) const;
  const void* VRow(int32_t seq, int64_t layer, int64_t pos) const;
  // Makes `layer` of slot `seq` hold `length` positions, of which the rows of positions
  // [length - n, length) are given in host memory (k and v: n × n_head_kv × head_dim elements
  // of the cache's KV type): the state after a prefill of `length` tokens, for a sliding layer
  // when n >= min(length, window). Complete when it returns.
  absl::Status LoadRows(int32_t seq, int64_t layer, int64_t length, const void* k, const void* v, int64_t n);
  // Copies the K and V rows of positions [p0, p1) of `layer` to host memory (k and v: (p1 - p0)
  // × n_head_kv × head_dim elements of the KV type); complete when it returns. OUT_OF_RANGE
  // unless all are held.
  absl::Status ReadRows(int32_t seq, int64_t layer, int64_t p0, int64_t p1, void* k, void* v);
  KvDtype kv_dtype() const { return kv_; }
  absl::Status FillRandom(int32_t seq, int64_t tokens, uint64_t seed) override;
  // One layer of FillRandom (SparseKvCache fills its dense layers with it).
  absl::Status FillRandomLayer(int32_t seq, int64_t layer, int64_t tokens, const RandomKv& rows);

 private:
  struct Layer {
    backend::DeviceBuffer k, v;  // cap rows of n_head_kv × head_dim elements of the KV type each
    int64_t cap = 0;
    int64_t ring = 0;      // sliding layers: ring size in positions (== cap); 0 = linear
    int64_t length = 0;    // positions stored
    int64_t spec_pos = -1; // the last write's speculative row (-1: none)
  };
  struct Slot {
    std::vector<Layer> layers;
  };
  int64_t RowBytes() const { return config_.n_head_kv * config_.head_dim * KvDtypeBytes(kv_); }
  static int64_t RowOf(const Layer& L, int64_t pos) { return L.ring > 0 ? pos % L.ring : pos; }
  Slot& GetSlot(int32_t seq);
  // Gives `L` new buffers of `cap` rows (a ring of `cap` positions when `ring`), keeping the
  // stored positions [keep_from, L.length) that fit.
  absl::Status Resize(Layer& L, int64_t cap, bool ring, int64_t keep_from);
  // Makes room for positions [p0, p1] of layer `layer` (geometric growth; the lazy ring shrink
  // of a slot without FinishPrefill).
  absl::Status MakeRoom(Layer& L, bool sliding, int64_t window, int64_t p0, int64_t p1);
  // Stores positions [p0, p1) from the forward pass's f32 rows k, v (row i = position p0 + i;
  // in `src_buf`, or host memory when it is empty) into L, in the KV type.
  absl::Status StoreRows(Layer& L, int64_t p0, int64_t p1, const backend::DeviceBuffer& src_buf, const float* k,
                         const float* v);
  // Copies positions [p0, p1) from host rows already in the KV type into L.
  absl::Status CopyRowsIn(Layer& L, int64_t p0, int64_t p1, const void* k, const void* v);
  void FreeLayer(Layer& L);
  // Prompt rows [r0, r1) of one sequence: stored, then attended causally (one Ops call).
  absl::Status AttendGroup(const model::AttentionCall& call, Slot& slot, int64_t r0, int64_t r1);
  // Decode rows [r0, r1) of one sequence (a real row, a speculative row, or both): stored now,
  // attended by AttendDecodeRows with every other sequence's in one Ops::AttendGroups call.
  struct DecodeRows {
    int32_t seq;
    int64_t r0, r1;
  };
  // The call's decode rows, batch-wide: one group per sequence, each KV head's keys in position
  // order (the real row does not see the speculative row's key).
  void AttendDecodeRows(const model::AttentionCall& call);

  const model::ModelConfig& config_;
  backend::Device& device_;
  const KvDtype kv_;
  std::vector<Slot> slots_;
  std::vector<int64_t> positions_;  // AttendGroup's rows' positions
  std::vector<DecodeRows> decode_;  // the call's decode rows, stored, not yet attended
  AttentionPlan plan_;
};

}  // namespace dd::engine
