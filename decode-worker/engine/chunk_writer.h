// The sparse manager's write path: a sparse layer's new rows go onto its device rows, and every
// chunk they complete gets its landmark per KV head (the mean of the chunk's post-RoPE keys,
// Ops::ChunkMeans, computed where the keys are) and goes to the store as one [K | V] block per
// KV head through the write-back (write_back.h), or at once from host rows that start a chunk
// (a restored prefix, random KV).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_rows.h"
#include "decode-worker/engine/write_back.h"
#include "decode-worker/model/attention.h"

namespace dd::engine {

class ChunkWriter {
 public:
  ChunkWriter(const model::ModelConfig& config, const SparseOptions& options, backend::Device& device,
              SparseRows& rows, ChunkStore& chunks)
      : config_(config), options_(options), device_(device), rows_(rows), chunks_(chunks),
        write_back_(config, options.chunk_tokens, device, rows, chunks) {}

  // Appends rows for positions [pos, pos + n) of store sequence `id`'s layer `layer` (k, v: n
  // f32 rows of the forward pass, device memory in src_buf, or host memory when it is empty),
  // stored in the KV type; every chunk they complete gets its landmarks and goes to the store.
  absl::Status Append(LayerRows& st, kvpool::SequenceId id, int64_t layer, const backend::DeviceBuffer& src_buf,
                      const float* k, const float* v, int64_t pos, int64_t n);
  // The same from host rows already in the KV type (a restored prefix, random KV).
  absl::Status AppendHost(LayerRows& st, kvpool::SequenceId id, int64_t layer, const void* k, const void* v,
                          int64_t pos, int64_t n);
  // Completed chunks still on their way, written to the store now (WriteBack::Flush); or dropped
  // (the store is gone).
  absl::Status Flush() { return write_back_.Flush(); }
  void Discard() { write_back_.Discard(); }

 private:
  // Checks that [pos, pos + n) continues the rows and makes room for them.
  absl::Status Prepare(LayerRows& st, int64_t pos, int64_t n);
  // After n rows from pos were stored: the chunks they complete get landmarks and go to the
  // store, written from host_k/host_v (KV-type host rows, or null: read back by the write-back).
  absl::Status Appended(LayerRows& st, kvpool::SequenceId id, int64_t layer, int64_t pos, int64_t n,
                        const void* host_k, const void* host_v);
  const model::ModelConfig& config_;
  const SparseOptions& options_;
  backend::Device& device_;
  SparseRows& rows_;
  ChunkStore& chunks_;
  WriteBack write_back_;
  std::vector<const void*> keys_;  // the completed chunks' key rows, for ChunkMeans
};

}  // namespace dd::engine
