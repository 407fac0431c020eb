// `full` mode with prefix reuse: each slot's KV blocks go to a store sequence of its own as
// prefill completes chunks (Offload), so its prompt can be committed (Commit), and a committed
// prefix is restored into an empty slot (Restore). Blocks move through ChunkStore, as the sparse
// cache's do (SparseKvCache::RestorePrefix), so the engine does no store I/O itself.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/model/model_config.h"
#include "kv-pool/client/kv_store.h"

namespace dd::engine {

class DensePrefixStore {
 public:
  // `store`, `device` and `dense` (the engine's) must outlive it.
  DensePrefixStore(const model::ModelConfig& config, int64_t chunk_tokens, kvpool::KvStore* store,
                   backend::Device& device, DenseKvCache& dense)
      : config_(config), chunk_(chunk_tokens), dense_(dense), chunks_(config, chunk_tokens, store, device) {}

  // Loads `tokens` positions (a multiple of the chunk) of store sequence `handle` into empty
  // slot `seq`: every position of a global layer, the last window + 1 of a sliding one; the
  // slot's own store sequence gets every block too, so its prompt can be committed whole.
  absl::Status Restore(int32_t seq, kvpool::SequenceId handle, int64_t tokens);
  // Writes the chunks completed between lengths `from` and `to` of every layer.
  absl::Status Offload(int32_t seq, int64_t from, int64_t to);
  // Commits the slot's first keys.size() blocks under their keys, for `owner`; nothing when the
  // slot has written no blocks.
  absl::Status Commit(int32_t seq, absl::Span<const uint64_t> keys, uint64_t owner);
  // Releases the slot's store sequence (its committed prefix stays with the store).
  void Release(int32_t seq);

 private:
  absl::StatusOr<kvpool::SequenceId> SeqOf(int32_t seq);

  const model::ModelConfig& config_;
  const int64_t chunk_;
  DenseKvCache& dense_;
  ChunkStore chunks_;
  std::vector<kvpool::SequenceId> seqs_;  // per slot, 0 = none yet
};

}  // namespace dd::engine
