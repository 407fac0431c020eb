// How a sparse layer's selected chunks reach the device: a FetchPolicy per strategy
// (SparseOptions::fetch), chosen once by MakeFetchPolicy (docs/architecture.md, "How to add a
// fetch strategy"):
//   on demand (fetch_on_demand.cc)  every read gathers its whole selection on the urgent path
//                                   into the sequence's urgent blocks (`sparse`);
//   resident  (fetch_resident.cc)   a ResidentSet per (sequence, sparse layer) keeps the chunks
//                                   earlier steps attended; a real row fetches only
//                                   S \ resident on the urgent path, and the speculative row's
//                                   prediction P' \ resident goes into resident slots in the
//                                   background (`sparse-cached`, `dualdecoder`;
//                                   docs/decisions/0012-resident-set.md).
// Which chunks are attended, and in which order, is the selector's: every strategy gives
// bit-identical results. A read's transfers are started for the whole batch before any is
// waited (Start, then Finish), and a prefetch is issued only after attention has read what it
// may overwrite. Not thread-safe (the compute thread); the store's transfer thread writes only
// into buffers handed to it until the matching wait.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_stats.h"
#include "decode-worker/model/model_config.h"

namespace dd::engine {

// What every strategy works with (the sparse manager's, outliving the policy).
struct FetchContext {
  const model::ModelConfig& config;
  const SparseOptions& options;
  backend::Device& device;
  ChunkStore& chunks;
  SparseStats& stats;
  int64_t budget_blocks() const { return options.k_sel() * config.n_head_kv; }  // one selection's blocks
};

// The sequence a call is for.
struct FetchSeq {
  int32_t slot = 0;
  kvpool::SequenceId store_id = 0;
  SeqKvCounts* counts = nullptr;  // the request's statistics
  // The layer rebuilds this sequence's keys at this step (docs/decisions/0052-low-rank-key-
  // reconstruction.md): only V halves move, and the caller writes the K half of every selected
  // block Finish marks in ReadFetch::rebuild. Otherwise every block read holds its stored keys.
  bool values_only = false;
  kvpool::BlockPart part() const { return values_only ? kvpool::BlockPart::kValues : kvpool::BlockPart::kWhole; }
};

class FetchPolicy {
 public:
  virtual ~FetchPolicy() = default;
  // Device memory of slot `slot` for a whole request whose sparse layers are `layers`, so that
  // a decode step allocates nothing (MemoryPlan counts the same; tested). Without it buffers
  // are allocated at first use.
  virtual absl::Status Reserve(int32_t slot, absl::Span<const int64_t> layers) = 0;
  // Starts every transfer read r needs for its selection of model layer `layer`, none waited.
  // `real`: a real row's read (its prediction's outcome and its transfers are counted); else a
  // speculative row alone (pre-decoding).
  virtual absl::Status Start(const FetchSeq& s, int64_t layer, bool real, DecodeRead& r) = 0;
  // Waits for what the read reads and points r.fetch.blocks at each selected chunk's [K | V]
  // block, heads in order, chunks ascending.
  virtual absl::Status Finish(const FetchSeq& s, int64_t layer, bool real, DecodeRead& r) = 0;
  // After the layer's attention: the speculative row's prediction P' for the next step
  // (`seeded`: from pre-decoding).
  virtual absl::Status Prefetch(const FetchSeq& s, int64_t layer, Selection predicted, bool seeded) = 0;
  // No transfer writes the slot's buffers after this.
  virtual void WaitAll(int32_t slot) = 0;
  // Frees the slot's buffers (after WaitAll and a sync of the compute queue).
  virtual void Release(int32_t slot) = 0;
  // Slot `dst` (released) gets copies of `src`'s buffers and state (after WaitAll(src)).
  virtual absl::Status Copy(int32_t src, int32_t dst) = 0;
  virtual int64_t device_bytes() const = 0;
};

// The one place a strategy is chosen.
std::unique_ptr<FetchPolicy> MakeFetchPolicy(const FetchContext& ctx);
std::unique_ptr<FetchPolicy> NewOnDemandFetch(const FetchContext& ctx);
std::unique_ptr<FetchPolicy> NewResidentFetch(const FetchContext& ctx);

}  // namespace dd::engine
