#include "decode-worker/engine/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/random_kv.h"
#include "glog/logging.h"
#include "kv-pool/client/pool_kv_store.h"

namespace dd::engine {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const model::ModelConfig& config, KvCacheOptions options,
                                                         backend::Device& device) {
  const int64_t B = options.prefix_block_tokens, C = options.sparse.chunk_tokens;
  if (B != 0) {
    if (B < 0 || C <= 0 || B % C != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix_block_tokens must be a positive multiple of the chunk (", C, "), got ", B));
    }
  }
  std::unique_ptr<KvCache> kv(new KvCache(config, std::move(options)));
  const KvCacheOptions& o = kv->options_;
  if (o.mode != DecodeMode::kFull || B > 0) {
    ASSIGN_OR_RETURN(kv->store_, kvpool::OpenKvStore(o.kv_store, o.kv_store_token, o.link, o.prefix_cache_bytes,
                                                     std::max<int64_t>(0, o.prefix_cache_tenant_bytes), o.kv_store_locate));
  }
  if (o.mode != DecodeMode::kFull) {
    ASSIGN_OR_RETURN(kv->sparse_, SparseKvCache::Create(config, o.sparse, o.kv_dtype, kv->store_.get(), device));
  }
  kv->dense_ = std::make_unique<DenseKvCache>(config, device, o.kv_dtype);
  kv->dense_layers_.resize(config.n_layer);
  for (int64_t l = 0; l < config.n_layer; ++l) kv->dense_layers_[l] = kv->sparse_ == nullptr || !kv->sparse_->Holds(l);
  if (kv->prefix_reuse()) {
    kv->dense_prefix_ =
        std::make_unique<DensePrefixStore>(config, C, kv->store_.get(), device, *kv->dense_, kv->dense_layers_);
  }
  return kv;
}

absl::Status KvCache::Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows) {
  if (sparse_ == nullptr) return dense_->Reserve(seq, prompt_tokens, total_tokens, pass_rows);
  RETURN_IF_ERROR(dense_->ReserveLayers(seq, prompt_tokens, total_tokens, pass_rows, &dense_layers_));
  absl::Status st = sparse_->Reserve(seq, prompt_tokens, total_tokens, pass_rows);
  if (!st.ok()) dense_->Reset(seq);
  return st;
}

absl::Status KvCache::FinishPrefill(int32_t seq) {
  RETURN_IF_ERROR(dense_->FinishPrefill(seq));
  return sparse_ != nullptr ? sparse_->FinishPrefill(seq) : absl::OkStatus();
}

absl::Status KvCache::Copy(int32_t src, int32_t dst) {
  RETURN_IF_ERROR(dense_->Copy(src, dst));
  if (sparse_ == nullptr) return absl::OkStatus();
  absl::Status st = sparse_->Copy(src, dst);
  if (!st.ok()) dense_->Reset(dst);
  return st;
}

int64_t KvCache::Length(int32_t seq) const {
  return std::max(dense_->Length(seq), sparse_ != nullptr ? sparse_->Length(seq) : int64_t{0});
}

absl::Status KvCache::FillRandom(int32_t seq, int64_t tokens, uint64_t seed) {
  if (sparse_ == nullptr) return dense_->FillRandom(seq, tokens, seed);
  if (tokens <= 0) return absl::InvalidArgumentError(absl::StrCat("random KV of ", tokens, " tokens"));
  if (Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  RETURN_IF_ERROR(sparse_->FillRandom(seq, tokens, seed));
  const RandomKv rows(seed, config_.n_head_kv * config_.head_dim);
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (dense_layers_[l]) RETURN_IF_ERROR(dense_->FillRandomLayer(seq, l, tokens, rows));
  }
  return absl::OkStatus();
}

absl::Status KvCache::KeepSpeculative(int32_t seq, int64_t layers) {
  if (layers > carry_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("keep speculative KV in ", layers, " layers: only the first ",
                                                   carry_layers(), " attend densely"));
  }
  return dense_->KeepSpeculative(seq, layers);
}

const std::vector<KvLayerStats>& KvCache::layer_stats() const {
  static const std::vector<KvLayerStats>* const kNone = new std::vector<KvLayerStats>();
  return sparse_ != nullptr ? sparse_->layer_stats() : *kNone;
}

absl::StatusOr<kvpool::SequenceId> KvCache::StoreSequence(int32_t seq) {
  if (sparse_ != nullptr) return sparse_->StoreSequence(seq);
  if (seq < 0) return absl::InvalidArgumentError(absl::StrCat("negative sequence slot ", seq));
  if (seq >= static_cast<int32_t>(own_seq_.size())) own_seq_.resize(seq + 1, 0);
  if (own_seq_[seq] == 0) {
    ASSIGN_OR_RETURN(own_seq_[seq], dense_prefix_->chunks().Open());
  }
  return own_seq_[seq];
}

absl::Status KvCache::AfterPrefill(int32_t seq, int64_t from, int64_t to) {
  if (dense_prefix_ == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(const kvpool::SequenceId own, StoreSequence(seq));
  return dense_prefix_->Offload(seq, own, from, to);
}

void KvCache::Release(int32_t seq) {
  ResetManagers(seq);
  if (seq >= 0 && seq < static_cast<int32_t>(own_seq_.size()) && own_seq_[seq] != 0) {
    dense_prefix_->chunks().Release(own_seq_[seq]);
    own_seq_[seq] = 0;
  }
  if (seq >= 0 && seq < static_cast<int32_t>(prefix_salt_.size())) prefix_salt_[seq] = 0;
}

void KvCache::DropDeferred(int32_t seq) {
  if (seq < 0 || seq >= static_cast<int32_t>(deferred_.size()) || deferred_[seq].handle == 0) return;
  (void)store_->Release(deferred_[seq].handle);
  deferred_[seq] = {};
}

void KvCache::SetPrefixSalt(int32_t seq, uint64_t salt) {
  if (seq < 0) return;
  if (static_cast<int32_t>(prefix_salt_.size()) <= seq) prefix_salt_.resize(seq + 1, 0);
  prefix_salt_[seq] = salt;
}

kvpool::PrefixNamespace KvCache::NamespaceOf(int32_t seq) const {
  kvpool::PrefixNamespace ns{.model_fingerprint = options_.model_fingerprint,
                             .layout = {config_.n_layer, config_.n_head_kv, config_.head_dim,
                                        options_.sparse.chunk_tokens, options_.kv_dtype},
                             .block_tokens = options_.prefix_block_tokens};
  if (seq >= 0 && seq < static_cast<int32_t>(prefix_salt_.size())) ns.tenant_salt = prefix_salt_[seq];
  return ns;
}

int64_t KvCache::RestorePrefix(int32_t seq, absl::Span<const int32_t> tokens, int64_t limit) {
  if (!prefix_reuse()) return 0;
  const kvpool::PrefixNamespace ns = NamespaceOf(seq);
  const std::vector<uint64_t> keys = kvpool::PrefixKeys(ns, tokens.first(limit));
  if (keys.empty()) return 0;
  const int64_t B = options_.prefix_block_tokens;
  auto match = store_->LookupPrefix(keys, ns.layout, B / options_.sparse.chunk_tokens);
  if (!match.ok()) {
    LOG(WARNING) << "prefix lookup failed, prefilling the whole prompt: " << match.status();
    return 0;
  }
  if (match->blocks == 0) return 0;
  const int64_t restored = match->blocks * B;
  absl::Status st;
  if (sparse_ != nullptr) {
    st = sparse_->RestorePrefix(seq, match->seq, restored);
    if (st.ok()) {
      auto own = StoreSequence(seq);
      st = own.ok() ? dense_prefix_->Restore(seq, match->seq, *own, restored) : own.status();
    }
    (void)store_->Release(match->seq);
  } else {  // `full`: the slot's sequence gets the prefix at the commit, if ever (Deferred)
    st = dense_prefix_->Restore(seq, match->seq, /*own=*/0, restored);
    if (st.ok()) {
      if (static_cast<int32_t>(deferred_.size()) <= seq) deferred_.resize(seq + 1);
      deferred_[seq] = {match->seq, restored};
    } else {
      (void)store_->Release(match->seq);
    }
  }
  if (!st.ok()) {
    LOG(WARNING) << "prefix restore failed, prefilling the whole prompt: " << st;
    ResetManagers(seq);
    return 0;
  }
  prefix_reused_tokens_ += restored;
  return restored;
}

void KvCache::CommitPrefix(int32_t seq, absl::Span<const int32_t> tokens) {
  if (!prefix_reuse()) return;
  const kvpool::PrefixNamespace ns = NamespaceOf(seq);
  const std::vector<uint64_t> keys = kvpool::PrefixKeys(ns, tokens);
  if (keys.empty()) return;
  const Deferred deferred = seq >= 0 && seq < static_cast<int32_t>(deferred_.size()) ? deferred_[seq] : Deferred{};
  if (deferred.handle != 0) {
    // `full` mode after a restore: nothing to commit beyond the restored prefix (a repeated
    // prompt), or the slot's sequence takes the prefix now and commits it whole.
    const bool more = static_cast<int64_t>(keys.size()) * options_.prefix_block_tokens > deferred.tokens;
    absl::Status st = absl::OkStatus();
    if (more) {
      auto own = StoreSequence(seq);
      st = own.ok() ? dense_prefix_->Copy(deferred.handle, *own, deferred.tokens) : own.status();
    }
    DropDeferred(seq);
    if (!st.ok()) {
      LOG(WARNING) << "prefix commit failed (the request goes on): " << st;
      return;
    }
    if (!more) return;
  }
  if (sparse_ == nullptr && (seq < 0 || seq >= static_cast<int32_t>(own_seq_.size()) || own_seq_[seq] == 0)) {
    return;  // `full` mode: the slot has written no blocks
  }
  absl::Status st = sparse_ != nullptr ? sparse_->Flush() : absl::OkStatus();  // every block written
  auto own = StoreSequence(seq);
  if (st.ok()) st = own.ok() ? store_->CommitPrefix(*own, keys, ns.tenant_salt) : own.status();
  if (!st.ok()) LOG(WARNING) << "prefix commit failed (the request goes on): " << st;
}

int64_t KvCache::StoreBytes(int64_t chunks) const {
  if (chunks < 0 || store_ == nullptr) return 0;
  return store_->ReservedBytes({config_.n_layer, config_.n_head_kv, config_.head_dim, options_.sparse.chunk_tokens},
                               chunks);
}

absl::Status KvCache::RecoverStore() {
  if (store_ == nullptr) return absl::OkStatus();
  if (sparse_ != nullptr) sparse_->ForgetStoreMappings();
  return store_->Recover();
}

}  // namespace dd::engine
