// The engine's KV cache interface: an AttentionBackend that also manages sequence slots.
// Implementations: DenseKvCache (`full` mode), SparseKvCache (`sparse` mode;
// docs/architecture.md, "KV caches, landmarks and selection").
// Not thread-safe; used from the engine's compute thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "decode-worker/model/attention.h"

namespace dd::engine {

class KvCache : public model::AttentionBackend {
 public:
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
