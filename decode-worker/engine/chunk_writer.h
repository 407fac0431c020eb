// The sparse manager's write path: a sparse layer's new rows go onto its device rows, and every
// chunk they complete goes to the store as one [K | V] block per KV head, its landmarks (the mean
// of the chunk's post-RoPE keys per KV head) computed by ChunkStore::WriteChunks and copied to the
// layer's landmark buffer. With prefix reuse, sliding layers' completed chunks are written too.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_rows.h"
#include "decode-worker/model/attention.h"

namespace dd::engine {

class ChunkWriter {
 public:
  ChunkWriter(const model::ModelConfig& config, const SparseOptions& options, backend::Device& device,
              SparseRows& rows, ChunkStore& chunks)
      : config_(config), options_(options), device_(device), rows_(rows), chunks_(chunks) {}

  // Appends rows for positions [pos, pos + n) of store sequence `id`'s layer `layer` (k, v: n
  // rows, device memory in src_buf, or host memory when it is empty); every chunk they
  // complete gets its landmarks and goes to the store.
  absl::Status Append(LayerRows& st, kvpool::SequenceId id, int64_t layer, const backend::DeviceBuffer& src_buf,
                      const float* k, const float* v, int64_t pos, int64_t n);
  // A sliding layer's call: writes the chunks its real rows completed, read back from `dense`,
  // into each row's store sequence (`store_of`).
  absl::Status OffloadSliding(DenseKvCache& dense, const model::AttentionCall& call,
                              absl::FunctionRef<absl::StatusOr<kvpool::SequenceId>(int32_t)> store_of);

 private:
  const model::ModelConfig& config_;
  const SparseOptions& options_;
  backend::Device& device_;
  SparseRows& rows_;
  ChunkStore& chunks_;
  std::vector<float> k_, v_;       // the completed chunks' rows, on the host
  std::vector<float> landmarks_;   // their landmarks, until the next sync of the compute queue
};

}  // namespace dd::engine
