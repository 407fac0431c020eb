// The sparse manager's write-back: a completed chunk's rows are copied from the device rows to
// host staging on the write-back queue, after the compute queue's writes of them, and written to
// the store as blocks by Flush. The compute queue never waits for the host, and the host waits
// for a copy only when it flushes: SparseKvCache flushes at the start of each forward pass (the
// copies long done) and before anything reads or commits the sequence's blocks (a fork's copy,
// a prefix commit, a release). Chunks in the decode window are never selected, so no landing
// needs a block that is still on its way (SparseKvCache flushes sooner for a window shorter
// than a chunk). Not thread-safe (the engine's thread).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/sparse_rows.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

class WriteBack {
 public:
  // `device`, `rows` and `chunks` outlive this.
  WriteBack(const model::ModelConfig& config, int64_t chunk_tokens, backend::Device& device, SparseRows& rows,
            ChunkStore& chunks)
      : config_(config), chunk_(chunk_tokens), device_(device), rows_(rows), chunks_(chunks) {}
  ~WriteBack() { Discard(); }
  WriteBack(const WriteBack&) = delete;
  WriteBack& operator=(const WriteBack&) = delete;

  // Starts chunks [c0, c1) of `st` (layer `layer` of store sequence `id`) on their way: their
  // rows' copies enqueued on the write-back queue.
  absl::Status Start(const LayerRows& st, kvpool::SequenceId id, int64_t layer, int64_t c0, int64_t c1);
  // Writes every started chunk to the store (after waiting for the copies); the first error.
  // Every entry is done with either way.
  absl::Status Flush();
  // Drops what is on its way, after its copies (the store is gone: pool loss).
  void Discard();
  bool pending() const { return !entries_.empty(); }
  // The last copy started: rows it reads may be rewritten only after it.
  backend::Event last_copy() const { return staging_.last_read; }

 private:
  struct Entry {
    kvpool::SequenceId id = 0;
    int64_t layer = 0, c0 = 0, c1 = 0;
    int64_t offset = 0;  // bytes into the staging: K rows, then V rows
  };
  int64_t Bytes(const Entry& e) const {
    return (e.c1 - e.c0) * chunk_ * config_.n_head_kv * config_.head_dim * KvDtypeBytes(rows_.kv_dtype());
  }

  const model::ModelConfig& config_;
  const int64_t chunk_;
  backend::Device& device_;
  SparseRows& rows_;
  ChunkStore& chunks_;
  // One registered host region for every entry on its way; its last_read is the last copy into
  // it (the device writes it).
  ChunkStore::HostStaging staging_;
  int64_t used_ = 0;  // bytes of staging_ in use
  std::vector<Entry> entries_;
};

}  // namespace dd::engine
