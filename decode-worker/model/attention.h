// How the forward pass gets attention computed: the seam between the model (which produces
// q/k/v rows) and the KV cache (which stores KV and decides what each query attends to).
//
// The dense cache (engine/dense_kv_cache.h) attends to every position; the sparse and
// dual-token modes (docs/decisions/0006-decode-modes.md) implement the same interface over chunked,
// offloaded KV, so they change how attention gets its KV without touching the model code.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"

namespace dd::model {

// One token row of a forward batch. Rows of the same sequence are contiguous and in
// ascending position order; a sequence's rows continue its cache (pos == cached length, ...).
struct BatchRow {
  int32_t seq = 0;          // slot of the sequence in the attention backend
  int64_t pos = 0;          // absolute position of the token
  int32_t token = 0;
  bool want_logits = false; // the forward pass returns this row's logits
  // Speculative row (dual-token step, docs/decisions/0008-dual-token-step.md): it attends like any
  // row (it sees the rows before it) but its KV is not counted as the sequence's — no real row sees
  // it, and the next row at its position overwrites it, unless the engine keeps it for the carry
  // (DenseKvCache::KeepSpeculative). At most one per sequence per forward, after the
  // sequence's real rows.
  bool speculative = false;
  // A prompt row (prefill, restore, rebuild): it attends densely over its whole prefix even
  // when it is the only row of its sequence in the pass. Rows without it count as decode rows
  // when they are alone; a backend treats several real rows of one sequence as prompt rows.
  bool prefill = false;
  // A real decode row resuming from a carried residual (Transformer::Carry): it skips the
  // embedding and the first carry.layers layers, entering the next with this state
  // (n_embd floats). Its KV in those layers must already be kept (the speculative row's).
  const float* resume = nullptr;
};

struct AttentionCall {
  int64_t layer = 0;
  bool sliding = false;     // sliding-window layer: row at pos sees (pos - window, pos]
  int64_t window = 0;
  float scale = 1.0f;       // softmax scale applied to q·k
  absl::Span<const BatchRow> rows;
  // The device buffer q, k, v and out lie in (the forward pass's workspace), for copies out
  // of it; empty when they are host memory (tests on the cpu device).
  backend::DeviceBuffer buffer;
  const float* q = nullptr;  // rows × n_head × head_dim, RoPE applied
  const float* k = nullptr;  // rows × n_head_kv × head_dim, RoPE applied
  const float* v = nullptr;  // rows × n_head_kv × head_dim
  float* out = nullptr;      // rows × n_head × head_dim
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // Stores the rows' K/V in their sequences' caches, then writes each row's causal attention
  // output (over its sequence's positions <= pos) into call.out. Called once per layer per
  // forward, layers in order, from the engine's compute thread.
  virtual absl::Status Attend(const AttentionCall& call) = 0;
};

}  // namespace dd::model
