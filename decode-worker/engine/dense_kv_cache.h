// Dense KV cache: every position of every layer kept in (device) memory; attention over all
// of them. The `full` decode mode, and the reference the sparse modes are checked against.
//
// Memory is f32, per sequence slot and layer, grown geometrically up to the slot's capacity
// and counted in bytes_reserved(). Not thread-safe; used from the engine's compute thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "decode-worker/model/attention.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

class DenseKvCache : public model::AttentionBackend {
 public:
  DenseKvCache(const model::ModelConfig& config, ThreadPool& pool);

  // Slots are created on demand; Reset empties one (its memory is released).
  void Reset(int32_t seq);
  // Makes slot `dst` a copy of slot `src` (a shared prefix; both continue independently).
  void Copy(int32_t src, int32_t dst);
  int64_t Length(int32_t seq) const;
  int64_t bytes_reserved() const;

  absl::Status Attend(const model::AttentionCall& call) override;

 private:
  struct Slot {
    int64_t length = 0;                   // positions stored (same for every layer after a forward)
    std::vector<std::vector<float>> k, v;  // per layer: positions × n_head_kv × head_dim
  };
  Slot& GetSlot(int32_t seq);
  void AttendGroup(const model::AttentionCall& call, Slot& slot, int64_t r0, int64_t r1);

  const model::ModelConfig& config_;
  ThreadPool& pool_;
  std::vector<Slot> slots_;
  std::vector<float> qbuf_, scores_;
};

}  // namespace dd::engine
