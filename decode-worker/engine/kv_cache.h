// The engine's KV: one coordinator over the KV managers of the decode mode, the KV store and
// prefix reuse (docs/architecture.md, "KV caches, landmarks and selection"). The engine asks it
// to reserve, prefill, restore, commit and release a slot and runs attention through it; the
// engine itself does no store I/O.
//   `full`:  a DenseKvCache for every layer, and with prefix reuse a DensePrefixStore that
//            offloads completed chunks to the store and restores committed prefixes;
//   sparse modes: a SparseKvCache (its global layers sparse, the others dense) over the store.
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
  int64_t prefix_block_tokens = 0;  // 0: no prefix reuse
  int64_t prefix_cache_bytes = int64_t{1} << 30;
  int64_t prefix_cache_tenant_bytes = -1;
  uint64_t model_fingerprint = 0;   // ModelFingerprint: prefixes are keyed per model
};

class KvCache : public model::AttentionBackend {
 public:
  // `config` and `device` (the engine's) must outlive the cache. In sparse modes, and in `full`
  // with prefix reuse, opens the store (options.kv_store). Prefix reuse in a sparse mode needs
  // SparseOptions::offload_sliding, which Engine::Normalized sets.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const model::ModelConfig& config, KvCacheOptions options,
                                                         backend::Device& device);

  absl::Status Attend(const model::AttentionCall& call) override { return manager().Attend(call); }

  // Slots. Reserve: device memory for a request (KvManager::Reserve). Open: starts the slot's
  // store sequence now (sparse modes), so a full pool fails this request alone at admission.
  absl::Status Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows) {
    return manager().Reserve(seq, prompt_tokens, total_tokens, pass_rows);
  }
  absl::Status Open(int32_t seq) { return sparse_ != nullptr ? sparse_->Open(seq) : absl::OkStatus(); }
  absl::Status FinishPrefill(int32_t seq) { return manager().FinishPrefill(seq); }
  // Frees the slot's KV and its store sequence (a committed prefix stays with the store).
  void Release(int32_t seq);
  absl::Status Copy(int32_t src, int32_t dst) { return manager().Copy(src, dst); }
  int64_t Length(int32_t seq) const { return manager().Length(seq); }
  int64_t device_bytes() const { return manager().device_bytes(); }
  absl::Status FillRandom(int32_t seq, int64_t tokens, uint64_t seed) { return manager().FillRandom(seq, tokens, seed); }

  // Prefix reuse (prefix_block_tokens > 0): `salt` scopes a slot's prefixes to its tenant
  // (kvpool::TenantSalt; 0: none) from SetPrefixSalt until Release.
  bool prefix_reuse() const { return options_.prefix_block_tokens > 0 && store_ != nullptr; }
  void SetPrefixSalt(int32_t seq, uint64_t salt);
  // Restores the longest committed prefix of tokens[0, limit) into empty slot `seq`; returns the
  // number of tokens restored (0 when none, or on a store error, which is logged: the caller
  // prefills them instead).
  int64_t RestorePrefix(int32_t seq, absl::Span<const int32_t> tokens, int64_t limit);
  // After a prefill pass wrote positions [from, to) of slot `seq`: `full` mode offloads the
  // chunks it completed (the sparse cache offloads as it attends).
  absl::Status AfterPrefill(int32_t seq, int64_t from, int64_t to) {
    return dense_prefix_ != nullptr ? dense_prefix_->Offload(seq, from, to) : absl::OkStatus();
  }
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

  // The sparse manager, for its statistics and the dual-token step; null in `full` mode.
  const SparseKvCache* sparse() const { return sparse_.get(); }
  SparseKvCache* sparse() { return sparse_.get(); }
  int64_t fetched_chunks() const { return sparse_ != nullptr ? sparse_->fetched_chunks() : 0; }
  int64_t device_gathered_chunks() const { return sparse_ != nullptr ? sparse_->device_gathered_chunks() : 0; }

 private:
  KvCache(const model::ModelConfig& config, KvCacheOptions options)
      : config_(config), options_(std::move(options)) {}
  // The manager of the mode: exactly one of dense_ and sparse_ is set.
  KvManager& manager() { return sparse_ != nullptr ? static_cast<KvManager&>(*sparse_) : *dense_; }
  const KvManager& manager() const {
    return sparse_ != nullptr ? static_cast<const KvManager&>(*sparse_) : *dense_;
  }
  kvpool::PrefixNamespace NamespaceOf(int32_t seq) const;

  const model::ModelConfig& config_;
  KvCacheOptions options_;
  std::unique_ptr<kvpool::KvStore> store_;
  std::unique_ptr<DenseKvCache> dense_;
  std::unique_ptr<SparseKvCache> sparse_;
  // `full` with prefix reuse: the slots' blocks in the store (the sparse cache keeps its own).
  std::unique_ptr<DensePrefixStore> dense_prefix_;
  std::vector<uint64_t> prefix_salt_;  // per slot, 0 = none
  int64_t prefix_reused_tokens_ = 0;
};

}  // namespace dd::engine
