// The engine's KV: one coordinator over the KV managers of the decode mode, the KV store and
// prefix reuse (docs/architecture.md, "KV caches, landmarks and selection"). The engine asks it
// to reserve, prefill, restore, commit and release a slot and runs attention through it; the
// engine itself does no store I/O. Two managers side by side, each holding some layers:
//   DenseKvCache:  every layer in `full` mode; the sliding and kept-dense layers in the others;
//   SparseKvCache: the sparse modes' sparse layers (global layers), over the store.
// Each layer's attention call goes to the manager that holds the layer. With prefix reuse a
// DensePrefixStore offloads the dense manager's completed chunks to the slot's store sequence
// (the sparse manager's, in the sparse modes, which offloads its own as it attends) and restores
// them from a committed prefix.
// Created by Create, which refuses what cannot work (the store cannot be opened, options that
// contradict) with the reason. Not thread-safe; used from the engine's compute thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/engine/dense_prefix_store.h"
#include "decode-worker/engine/kv_manager.h"
#include "decode-worker/engine/memory_plan.h"
#include "decode-worker/engine/sparse_kv_cache.h"
#include "kv-pool/client/kv_store.h"
#include "kv-pool/client/prefix_key.h"

namespace dd::engine {

// What KvCache needs of the engine's options (EngineOptions, engine.h, documents each).
struct KvCacheOptions {
  DecodeMode mode = DecodeMode::kFull;
  SparseOptions sparse{};
  kvpool::LinkModel link{};
  std::string kv_store = "inproc://";
  std::string kv_store_token{};
  kvpool::PoolLocate kv_store_locate{};  // EngineOptions::kv_store_locate
  int64_t prefix_block_tokens = 0;  // 0: no prefix reuse
  int64_t prefix_cache_bytes = int64_t{1} << 30;
  int64_t prefix_cache_tenant_bytes = -1;
  uint64_t model_fingerprint = 0;   // ModelFingerprint: prefixes are keyed per model
  // The type KV is kept in, by both managers and the store (docs/decisions/0049-kv-storage-type.md).
  KvDtype kv_dtype = KvDtype::kF32;
};

class KvCache : public model::AttentionBackend {
 public:
  // `config` and `device` (the engine's) must outlive the cache. In sparse modes, and in `full`
  // with prefix reuse, opens the store (options.kv_store).
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const model::ModelConfig& config, KvCacheOptions options,
                                                         backend::Device& device);

  // To the manager that holds the call's layer.
  absl::Status Attend(const model::AttentionCall& call) override {
    return sparse_ != nullptr && sparse_->Holds(call.layer) ? sparse_->Attend(call) : dense_->Attend(call);
  }

  // Slots. Reserve: device memory for a request (KvManager::Reserve), in both managers or in
  // neither. Open: starts the slot's store sequence now (sparse modes), so a full pool fails
  // this request alone at admission.
  absl::Status Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows);
  absl::Status Open(int32_t seq) { return sparse_ != nullptr ? sparse_->Open(seq) : absl::OkStatus(); }
  absl::Status FinishPrefill(int32_t seq);
  // Frees the slot's KV and its store sequence (a committed prefix stays with the store).
  void Release(int32_t seq);
  absl::Status Copy(int32_t src, int32_t dst);
  int64_t Length(int32_t seq) const;
  int64_t device_bytes() const {
    return dense_->device_bytes() + (sparse_ != nullptr ? sparse_->device_bytes() : 0);
  }
  absl::Status FillRandom(int32_t seq, int64_t tokens, uint64_t seed);

  // The dual-token step's carry: layers [0, carry_layers()) attend densely and exactly (sliding
  // windows, global layers kept dense) up to the first sparse layer, so a speculative row's
  // state through them is the next real row's when the tokens match. 0 in `full` mode.
  int64_t carry_layers() const { return sparse_ != nullptr ? sparse_->carry_layers() : 0; }
  // Keeps slot `seq`'s last speculative KV in layers [0, layers) (DenseKvCache::KeepSpeculative).
  absl::Status KeepSpeculative(int32_t seq, int64_t layers);

  // Prefix reuse (prefix_block_tokens > 0): `salt` scopes a slot's prefixes to its tenant
  // (kvpool::TenantSalt; 0: none) from SetPrefixSalt until Release.
  bool prefix_reuse() const { return options_.prefix_block_tokens > 0 && store_ != nullptr; }
  void SetPrefixSalt(int32_t seq, uint64_t salt);
  // Restores the longest committed prefix of tokens[0, limit) into empty slot `seq`; returns the
  // number of tokens restored (0 when none, or on a store error, which is logged: the caller
  // prefills them instead).
  int64_t RestorePrefix(int32_t seq, absl::Span<const int32_t> tokens, int64_t limit);
  // After a prefill pass wrote positions [from, to) of slot `seq`, with prefix reuse: the
  // dense manager's chunks it completed go to the slot's store sequence (the sparse manager
  // offloads its own as it attends).
  absl::Status AfterPrefill(int32_t seq, int64_t from, int64_t to);
  // Commits the slot's prompt blocks of `tokens` (its prompt but the last token) for reuse; a
  // store error is logged (the request goes on).
  void CommitPrefix(int32_t seq, absl::Span<const int32_t> tokens);
  // Prompt tokens restored instead of prefilled, since creation.
  int64_t prefix_reused_tokens() const { return prefix_reused_tokens_; }

  // The store (none in `full` without prefix reuse). StoreBytes: what the store may charge a
  // request of `chunks` chunks (0 without a store); capacity: its bound for this worker (0: none).
  bool has_store() const { return store_ != nullptr; }
  int64_t StoreBytes(int64_t chunks) const;
  int64_t store_capacity_bytes() const { return store_ != nullptr ? store_->capacity_bytes() : 0; }
  int64_t transfer_wait_ns() const { return store_ != nullptr ? store_->wait_ns() : 0; }
  void SetLink(const kvpool::LinkModel& link) {
    if (store_ != nullptr) store_->SetLink(link);
  }
  // After a step failed with UNAVAILABLE because the pool was lost (every slot released): the
  // device forgets the store's mapped memory, then the store reconnects (KvStore::Recover).
  absl::Status RecoverStore();

  // Statistics of the sparse manager's selection and transfers; none (zeros) in `full` mode.
  bool selects_chunks() const { return sparse_ != nullptr; }
  const std::vector<KvLayerStats>& layer_stats() const;  // per model layer (empty in `full`)
  KvLayerStats total_stats() const { return sparse_ != nullptr ? sparse_->total_stats() : KvLayerStats(); }
  // Slot `seq`'s own hit rate and bytes moved (SparseKvCache::SeqHitRate, SeqTransfers).
  double SeqHitRate(int32_t seq) const { return sparse_ != nullptr ? sparse_->SeqHitRate(seq) : 0.0; }
  SparseKvCache::SeqKvBytes SeqTransfers(int32_t seq) const {
    return sparse_ != nullptr ? sparse_->SeqTransfers(seq) : SparseKvCache::SeqKvBytes();
  }
  int64_t block_bytes() const { return sparse_ != nullptr ? sparse_->block_bytes() : 0; }
  // Blocks landed on the device, and how (ChunkStore).
  int64_t fetched_chunks() const { return sparse_ != nullptr ? sparse_->fetched_chunks() : 0; }
  int64_t values_only_chunks() const { return sparse_ != nullptr ? sparse_->values_only_chunks() : 0; }
  // Key reconstruction: the per-layer choices, the low-rank caches (none in `full`), and a
  // slot's auxiliary device bytes (landmarks, low-rank caches).
  const KeyReconstructionPolicy* key_reconstruction() const {
    return sparse_ != nullptr ? &sparse_->key_reconstruction() : nullptr;
  }
  const LowRankKeyCache* low_rank_keys() const { return sparse_ != nullptr ? &sparse_->low_rank_keys() : nullptr; }
  SparseKvCache::SeqAuxBytes SeqAuxiliary(int32_t seq) const {
    return sparse_ != nullptr ? sparse_->SeqAuxiliary(seq) : SparseKvCache::SeqAuxBytes();
  }
  const SeqKvCounts* SeqCounts(int32_t seq) const { return sparse_ != nullptr ? sparse_->SeqCounts(seq) : nullptr; }
  int64_t device_gathered_chunks() const { return sparse_ != nullptr ? sparse_->device_gathered_chunks() : 0; }
  int64_t staged_gathered_chunks() const { return sparse_ != nullptr ? sparse_->staged_gathered_chunks() : 0; }
  int64_t direct_chunks() const { return sparse_ != nullptr ? sparse_->direct_chunks() : 0; }
  // Benchmarks: the selection model from the next step on (no effect in `full` mode).
  void SetSelectionModel(const SelectionModel& m) {
    if (sparse_ != nullptr) sparse_->SetSelectionModel(m);
  }

 private:
  KvCache(const model::ModelConfig& config, KvCacheOptions options)
      : config_(config), options_(std::move(options)) {}
  kvpool::PrefixNamespace NamespaceOf(int32_t seq) const;
  // The slot's store sequence for prefix reuse: the sparse manager's, or in `full` mode its own
  // (opened on first use).
  absl::StatusOr<kvpool::SequenceId> StoreSequence(int32_t seq);
  // Empties slot `seq` in both managers.
  void ResetManagers(int32_t seq) {
    dense_->Reset(seq);
    if (sparse_ != nullptr) sparse_->Reset(seq);
    DropDeferred(seq);
  }
  void DropDeferred(int32_t seq);  // releases the slot's Deferred handle

  const model::ModelConfig& config_;
  KvCacheOptions options_;
  std::unique_ptr<kvpool::KvStore> store_;
  std::unique_ptr<DenseKvCache> dense_;    // always
  std::unique_ptr<SparseKvCache> sparse_;  // sparse modes
  std::vector<bool> dense_layers_;          // per model layer: held by dense_ (every one in `full`)
  // With prefix reuse: the dense manager's blocks in the store.
  std::unique_ptr<DensePrefixStore> dense_prefix_;
  // Per slot: the prefix salt (0 = none), and in `full` mode its store sequence (0 = none yet).
  std::vector<uint64_t> prefix_salt_;
  std::vector<kvpool::SequenceId> own_seq_;
  // `full` mode, per slot: a restored prefix its own sequence does not hold yet (`handle` kept
  // leased). The commit copies it there only when the prompt has blocks to commit beyond it: a
  // repeated prompt restores without copying its prefix twice.
  struct Deferred {
    kvpool::SequenceId handle = 0;
    int64_t tokens = 0;
  };
  std::vector<Deferred> deferred_;
  int64_t prefix_reused_tokens_ = 0;
};

}  // namespace dd::engine
