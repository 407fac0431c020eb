// Prefix reuse for the layers the DenseKvCache holds (every layer in `full` mode; the sliding
// and kept-dense layers in the sparse modes): as prefill completes chunks, their blocks go to the
// slot's store sequence (Offload), so its prompt can be committed with every layer; a committed
// prefix is restored into an empty slot (Restore). KvCache says whose store sequence a slot
// writes (its own in `full` mode, the sparse manager's otherwise). Blocks move through
// ChunkStore, as the sparse manager's do, so the engine does no store I/O itself.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/model/model_config.h"
#include "kv-pool/client/kv_store.h"

namespace dd::engine {

class DensePrefixStore {
 public:
  // `store`, `device`, `dense` and `layers` (the KvCache's) must outlive it. `layers`: one flag
  // per model layer, set for the layers `dense` holds.
  DensePrefixStore(const model::ModelConfig& config, int64_t chunk_tokens, kvpool::KvStore* store,
                   backend::Device& device, DenseKvCache& dense, const std::vector<bool>& layers)
      : config_(config), chunk_(chunk_tokens), dense_(dense), layers_(layers),
        chunks_(config, chunk_tokens, store, device, /*device_gathers=*/false, dense.kv_dtype()) {}

  // The store's side, for the slots' own sequences in `full` mode.
  ChunkStore& chunks() { return chunks_; }
  // Loads `tokens` positions (a multiple of the chunk) of store sequence `handle` into the
  // layers of empty slot `seq`: every position of a global layer, the last window + 1 of a
  // sliding one. A slot store sequence `own` (not 0) gets every block too, so its prompt can be
  // committed whole; with `own` 0 only the blocks the slot keeps are read (Copy gives them to
  // the slot's sequence later, if it commits more).
  absl::Status Restore(int32_t seq, kvpool::SequenceId handle, kvpool::SequenceId own, int64_t tokens);
  // Copies the blocks of the first `tokens` positions of the layers from `handle` to `own`.
  absl::Status Copy(kvpool::SequenceId handle, kvpool::SequenceId own, int64_t tokens);
  // Writes the chunks completed between lengths `from` and `to` of the layers to `own`.
  absl::Status Offload(int32_t seq, kvpool::SequenceId own, int64_t from, int64_t to);

 private:
  const model::ModelConfig& config_;
  const int64_t chunk_;
  DenseKvCache& dense_;
  const std::vector<bool>& layers_;
  ChunkStore chunks_;
};

}  // namespace dd::engine
