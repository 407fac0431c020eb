// The sparse KV manager (`sparse`, `sparse-cached` and `dualdecoder` modes; docs/architecture.md,
// "KV caches, landmarks and selection" and "A decode step in each mode"). It coordinates parts
// of one responsibility each:
//   SparseRows     (sparse_rows.h)     a sparse layer's device rows: sinks, the window, landmarks;
//   ChunkSelector  (chunk_selector.h)  which chunks a decode row attends and which the next step
//                                      will need (landmark scores, ranking, predictors);
//   FetchPolicy    (fetch_policy.h)    how those chunks reach the device (on demand, resident);
//   ChunkWriter    (chunk_writer.h)    new rows to the device, completed chunks to the store;
//   ChunkStore     (chunk_store.h)     the store's side: offloads, landmarks, landings, copies;
//   AttentionPlan  (attention_plan.h)  one attention call per layer for the whole batch;
//   SparseStats    (sparse_stats.h)    per-layer and per-request counts;
//   LowRankKeyCache (low_rank_key_cache.h) and KeyReconstructionPolicy (key_reconstruction.h):
//                  keys rebuilt on the device instead of fetched, per layer, when chosen
//                  (docs/decisions/0052-low-rank-key-reconstruction.md).
// It holds the sparse layers only (Holds): KvCache (kv_cache.h) runs the sliding and kept-dense
// layers' DenseKvCache beside it and routes each layer's attention call to its manager.
//
// For each sparse layer (global-attention layers; sliding-window layers stay dense) and each
// sequence, the device keeps the attention sinks, the local window and one landmark per full
// chunk per KV head; full chunks go to the KvStore as they fill. A decode row's query scores the
// selectable chunks (neither sinks nor window) per KV head, takes the top budget/chunk, and
// attends exactly over sinks ∪ selected ∪ window in ascending position order; when every
// selectable chunk fits the budget, the result is bit-identical to the dense cache. Prefill rows
// attend densely (the whole prefix stays on the device while a sequence is prefilling).
//
// `dualdecoder` (docs/decisions/0008-dual-token-step.md) adds speculative rows: a speculative
// row after a real row attends over the real row's keys plus its own KV (not kept), and its query
// predicts the chunks P' the next step will need; the fetch policy prefetches them in the
// background. The next real row selects S exactly and fetches the misses urgently, so its result
// is bit-identical to `sparse`. A speculative row alone (pre-decoding, after prefill) selects,
// fetches and attends for itself and seeds P' with its selection.
//
// A layer's decode rows are batch-wide: every sequence's selection and transfers first, then
// the waits, one attention call for the whole batch, and only then the prefetches that may
// overwrite what attention read. Not thread-safe (one compute thread).
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/attention_plan.h"
#include "decode-worker/engine/chunk_selector.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/chunk_writer.h"
#include "decode-worker/engine/fetch_policy.h"
#include "decode-worker/engine/key_reconstruction.h"
#include "decode-worker/engine/kv_manager.h"
#include "decode-worker/engine/low_rank_key_cache.h"
#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_rows.h"
#include "decode-worker/engine/sparse_stats.h"
#include "kv-pool/client/kv_store.h"

namespace dd::engine {

class SparseKvCache : public KvManager {
 public:
  // `store` and `device` (the engine's) must outlive the cache. KV rows, blocks and resident
  // slots are kept in `kv`; landmarks in f32.
  static absl::StatusOr<std::unique_ptr<SparseKvCache>> Create(const model::ModelConfig& config,
                                                               const SparseOptions& options, KvDtype kv,
                                                               kvpool::KvStore* store, backend::Device& device);
  // Fault injection for the tests that show a missing wait is caught (on the sim device):
  // every cache of the process leaves out that wait from now on.
  enum class SkipWait {
    kNone,
    kComputeWaitsForLanding,  // attention does not wait for the blocks copied to the device
  };
  static void SkipWaitForTesting(SkipWait skip);

  ~SparseKvCache() override;  // waits for transfers still writing into its buffers
  // Opens the slot's sequence in the store now rather than at its first row, so that a full
  // pool fails this request alone (at admission) instead of a whole forward pass.
  absl::Status Open(int32_t seq) { return GetSeq(seq).status(); }
  // The slot's sequence in the store (opened if need be): where KvCache offloads the blocks of
  // the layers this manager does not hold, so that a committed prefix has every layer. Flush
  // before committing it: completed chunks still on their way are written then.
  absl::StatusOr<kvpool::SequenceId> StoreSequence(int32_t seq);
  absl::Status Flush() { return writer_.Flush(); }
  // Whether model layer `layer` is one of its sparse layers; Attend refuses the others.
  bool Holds(int64_t layer) const { return layer >= 0 && layer < config_.n_layer && map_.index[layer] >= 0; }
  // The layers before the first sparse one (0 when there is none): they attend densely and
  // exactly, so the dual-token step may carry a speculative row's state through them
  // (KvCache::carry_layers).
  int64_t carry_layers() const { return map_.layers.empty() ? 0 : map_.layers.front(); }
  void Reset(int32_t seq) override;
  absl::Status Copy(int32_t src, int32_t dst) override;
  int64_t Length(int32_t seq) const override;
  int64_t device_bytes() const override;
  absl::Status Attend(const model::AttentionCall& call) override;

  // Prefix reuse. RestorePrefix makes empty slot `seq` hold, in its sparse layers, the state a
  // prefill of the first `tokens` positions (a multiple of the chunk) would have left, reading
  // their blocks from `handle` (a store sequence, e.g. from LookupPrefix) and copying them into
  // the slot's own store sequence (KvCache restores the other layers).
  absl::Status RestorePrefix(int32_t seq, kvpool::SequenceId handle, int64_t tokens);
  // Its sparse layers only (KvCache fills the others).
  absl::Status FillRandom(int32_t seq, int64_t tokens, uint64_t seed) override;
  kvpool::KvLayout store_layout() const { return chunks_.layout(); }

  using LayerStats = KvLayerStats;
  const std::vector<LayerStats>& layer_stats() const { return stats_.layers(); }
  LayerStats total_stats() const { return stats_.total(); }
  // The slot's own hit rate |P' ∩ S| / |S| since it was opened, first decode step excluded;
  // 0 when it has had no prediction yet (or the slot is unknown).
  double SeqHitRate(int32_t seq) const;
  // KV bytes one sequence moved so far (prefetched, urgent, wasted = prefetched but unused).
  struct SeqKvBytes {
    int64_t prefetched = 0, urgent = 0, wasted = 0;
  };
  SeqKvBytes SeqTransfers(int32_t seq) const;
  // Device bytes a sequence keeps beside its KV rows to select and rebuild chunks: landmarks,
  // and low-rank key caches (0 without key reconstruction).
  struct SeqAuxBytes {
    int64_t landmarks = 0, low_rank_keys = 0;
  };
  SeqAuxBytes SeqAuxiliary(int32_t seq) const;
  const SeqKvCounts* SeqCounts(int32_t seq) const {
    return seq >= 0 && seq < static_cast<int32_t>(seqs_.size()) ? &seqs_[seq].counts : nullptr;
  }
  // Key reconstruction: the policy (per-layer choices) and the low-rank caches' rank and
  // basis builds.
  const KeyReconstructionPolicy& key_reconstruction() const { return recon_; }
  const LowRankKeyCache& low_rank_keys() const { return low_rank_; }
  int64_t block_bytes() const { return chunks_.block_bytes(); }
  int64_t fetched_chunks() const { return chunks_.fetched_chunks(); }
  // Of those, the ones whose V half alone moved (keys rebuilt).
  int64_t values_only_chunks() const { return chunks_.values_only_chunks(); }
  // Of those, the ones the device gathered itself from the store's mapped memory (a shm://
  // pool on a device the host cannot write: ChunkStore).
  int64_t device_gathered_chunks() const { return chunks_.device_gathered_chunks(); }
  // Of the others, on such a device, those moved by one device gather per buffer from the
  // landing's registered host staging (the in-process store, ucx://).
  int64_t staged_gathered_chunks() const { return chunks_.staged_gathered_chunks(); }
  int64_t direct_chunks() const { return chunks_.direct_chunks(); }
  // Before the store's Recover: what is on its way to the lost store is dropped, and the device
  // unregisters the store's mapped memory (after the gathers from it), to register the new
  // mapping at the next landing.
  void ForgetStoreMappings() {
    writer_.Discard();
    chunks_.ForgetMappings();
  }
  // Benchmarks: the selection model from the next step on (SparseOptions::selection_model).
  void SetSelectionModel(const SelectionModel& m) { selector_.set_model(m); }

  // Device memory for slot `seq` (empty) for a request of `prompt_tokens` growing to
  // `total_tokens`, prefilled `pass_rows` rows per pass at most: every buffer the sparse
  // layers will use, so that a decode step allocates nothing and the allocator's totals
  // are MemoryPlan's (tested). RESOURCE_EXHAUSTED (nothing kept) when the device cannot hold
  // it. A slot used without Reserve allocates as it goes (tests).
  absl::Status Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows) override;
  // The prompt is in: the prefill's linear rows become the decode window's ring.
  absl::Status FinishPrefill(int32_t seq) override;

 private:
  struct Seq {
    kvpool::SequenceId store_id = 0;
    bool open = false;
    bool reserved = false;          // Reserve sized its buffers for the whole request
    int64_t total = 0;              // reserved: the positions it may reach
    std::vector<LayerRows> layers;  // indexed by model layer; unused for dense layers
    std::vector<LowRankLayer> low_rank;  // indexed by model layer; with key reconstruction only
    std::vector<ModelDraw> draws;   // the selection model's, per model layer
    SeqScores scores;               // the selection buffer
    SeqKvCounts counts;
    // A narrow KV type only: the speculative row's K and V rows in it (its own key, which its
    // attention reads with the others'), rewritten at each sparse layer.
    backend::DeviceBuffer own;
  };
  struct LayerMap {
    std::vector<int64_t> index;   // per model layer: its index among the sparse layers (-1: dense)
    std::vector<int64_t> layers;  // the sparse layers' model indices, in order
  };
  struct Reads {  // the layer call's decode reads: [0, n) in use
    std::vector<DecodeRead> all;
    size_t n = 0;
    absl::Span<DecodeRead> used() { return absl::MakeSpan(all).first(n); }
  };
  SparseKvCache(const model::ModelConfig& config, const SparseOptions& options, KvDtype kv, kvpool::KvStore* store,
                backend::Device& device);
  // Seq::own, allocated once (at Reserve, or at the first speculative row of an unreserved slot).
  absl::Status EnsureOwnRows(Seq& s);

  absl::StatusOr<Seq*> GetSeq(int32_t seq);
  // The sequence for a call on `layer` at this step (values_only: the layer rebuilds its keys
  // this step and the sequence has a low-rank key cache).
  FetchSeq FetchOf(int32_t seq, int64_t layer) {
    Seq& s = seqs_[seq];
    const bool values_only = step_rebuilds_keys_ && !s.low_rank.empty() && s.low_rank[layer].ready;
    return {seq, s.store_id, &s.counts, values_only};
  }
  // The low-rank key cache of each sparse layer built from the prompt's keys, before the
  // rows become the window's ring (key reconstruction only).
  absl::Status BuildLowRank(Seq& s, int64_t layer);
  // After the layer's reads landed: the keys of every read that rebuilds them.
  void RebuildKeys(int64_t layer, const DecodeRead& r);
  void FreeSeq(int32_t seq);  // every device buffer of the slot (after the waits and a sync)
  // Every decode read of the call: per sequence, KV appended, prompt rows attended, the
  // read's own selection scored.
  absl::Status StartReads(const model::AttentionCall& call);
  DecodeRead& AddRead(int32_t seq);
  void AttendPrefillRows(Seq& s, const model::AttentionCall& call, int64_t r0, int64_t r1);
  // Every read's selection chosen and its transfers started, then the speculative rows'
  // predictions.
  absl::Status SelectAndStart(const model::AttentionCall& call);
  // Every read's waits, one attention call for all of them, then the prefetches.
  absl::Status AttendDecodeReads(const model::AttentionCall& call);
  void PlanAttention(const model::AttentionCall& call);
  // On an error: waits for the reads' urgent transfers still in flight and drops the reads.
  void AbandonReads();

  const model::ModelConfig& config_;
  SparseOptions options_;
  backend::Device& device_;
  ChunkStore chunks_;  // the store's side: offloads, landmarks, landings, fork copies
  SparseStats stats_;
  SparseRows rows_;
  ChunkSelector selector_;
  ChunkWriter writer_;  // new rows to the device, completed chunks to the store
  std::unique_ptr<FetchPolicy> fetch_;
  KeyReconstructionPolicy recon_;
  LowRankKeyCache low_rank_;
  bool step_rebuilds_keys_ = false;  // the current layer call's choice (recon_)
  std::vector<int64_t> rebuild_chunks_;
  std::vector<int32_t> rebuild_heads_;
  std::vector<void*> rebuild_dst_;
  LayerMap map_;
  std::deque<Seq> seqs_;  // a deque: growing it keeps references to open slots valid
  Reads reads_;
  AttentionPlan plan_;
  std::vector<int64_t> prefill_positions_;  // AttendPrefillRows' rows' positions
};

}  // namespace dd::engine
