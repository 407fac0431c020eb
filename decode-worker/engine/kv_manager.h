// A KV manager: one layer type's KV for every sequence slot, as an AttentionBackend.
// Implementations: DenseKvCache (every position on the device: `full` mode, and the sliding and
// kept-dense layers of the sparse modes) and SparseKvCache (the sparse modes' global layers:
// docs/architecture.md, "KV caches, landmarks and selection"). The engine reaches them through
// KvCache (kv_cache.h), which also owns the store and prefix reuse.
// Not thread-safe; used from the engine's compute thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "decode-worker/model/attention.h"

namespace dd::engine {

class KvManager : public model::AttentionBackend {
 public:
  // Device memory for empty slot `seq` for a request of `prompt_tokens` growing to
  // `total_tokens`, prefilled `pass_rows` rows per pass at most (MemoryPlan's figures).
  // RESOURCE_EXHAUSTED (nothing kept) when the device cannot hold it. A slot used without
  // Reserve allocates as it goes (tests).
  virtual absl::Status Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows) = 0;
  // The prompt is in: buffers sized for prefill passes shrink to what decoding needs.
  virtual absl::Status FinishPrefill(int32_t seq) = 0;
  // Empties a slot and frees what it holds.
  virtual void Reset(int32_t seq) = 0;
  // Makes slot `dst` a copy of `src` (shared prefix, independent continuation).
  virtual absl::Status Copy(int32_t src, int32_t dst) = 0;
  // Positions stored for the sequence.
  virtual int64_t Length(int32_t seq) const = 0;
  // Bytes in use on the (CPU-emulated) device: what an allocator sized from MemoryPlan holds.
  // Vector growth slack is not counted.
  virtual int64_t device_bytes() const = 0;
  // Benchmarks (Engine::PrefillSynthetic): empty slot `seq` holds positions [0, tokens) of
  // random KV (RandomKv with `seed`) as a prefill of that many tokens would have left them.
  virtual absl::Status FillRandom(int32_t seq, int64_t tokens, uint64_t seed) = 0;
};

}  // namespace dd::engine
