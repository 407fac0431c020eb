#include "decode-worker/engine/kv_cache.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "kv-pool/client/pool_kv_store.h"

namespace dd::engine {

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const model::ModelConfig& config, KvCacheOptions options,
                                                         backend::Device& device) {
  const int64_t B = options.prefix_block_tokens, C = options.sparse.chunk_tokens;
  if (B != 0) {
    if (options.mode != DecodeMode::kFull && options.sparse.sparse_layers.any()) {
      // Layers kept dense are not offloaded: a committed prefix would lack their KV.
      return absl::InvalidArgumentError("prefix reuse needs every global layer sparse (no --sparse_layers)");
    }
    if (B < 0 || C <= 0 || B % C != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix_block_tokens must be a positive multiple of the chunk (", C, "), got ", B));
    }
    if (options.mode != DecodeMode::kFull && !options.sparse.offload_sliding) {
      return absl::InvalidArgumentError("prefix reuse in a sparse mode needs offload_sliding (Engine::Normalized)");
    }
  }
  std::unique_ptr<KvCache> kv(new KvCache(config, std::move(options)));
  const KvCacheOptions& o = kv->options_;
  if (o.mode != DecodeMode::kFull || B > 0) {
    ASSIGN_OR_RETURN(kv->store_, kvpool::OpenKvStore(o.kv_store, o.kv_store_token, o.link, o.prefix_cache_bytes,
                                                     std::max<int64_t>(0, o.prefix_cache_tenant_bytes)));
  }
  if (o.mode == DecodeMode::kFull) {
    kv->dense_ = std::make_unique<DenseKvCache>(config, device);
    if (kv->prefix_reuse()) {
      kv->dense_prefix_ = std::make_unique<DensePrefixStore>(config, C, kv->store_.get(), device, *kv->dense_);
    }
  } else {
    ASSIGN_OR_RETURN(kv->sparse_, SparseKvCache::Create(config, o.sparse, kv->store_.get(), device));
  }
  return kv;
}

void KvCache::Release(int32_t seq) {
  manager().Reset(seq);
  if (dense_prefix_ != nullptr) dense_prefix_->Release(seq);
  if (seq >= 0 && seq < static_cast<int32_t>(prefix_salt_.size())) prefix_salt_[seq] = 0;
}

void KvCache::SetPrefixSalt(int32_t seq, uint64_t salt) {
  if (seq < 0) return;
  if (static_cast<int32_t>(prefix_salt_.size()) <= seq) prefix_salt_.resize(seq + 1, 0);
  prefix_salt_[seq] = salt;
}

kvpool::PrefixNamespace KvCache::NamespaceOf(int32_t seq) const {
  kvpool::PrefixNamespace ns{.model_fingerprint = options_.model_fingerprint,
                             .layout = {config_.n_layer, config_.n_head_kv, config_.head_dim,
                                        options_.sparse.chunk_tokens},
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
  absl::Status st = sparse_ != nullptr ? sparse_->RestorePrefix(seq, match->seq, restored)
                                       : dense_prefix_->Restore(seq, match->seq, restored);
  (void)store_->Release(match->seq);
  if (!st.ok()) {
    LOG(WARNING) << "prefix restore failed, prefilling the whole prompt: " << st;
    manager().Reset(seq);
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
  absl::Status st = sparse_ != nullptr ? sparse_->CommitPrefix(seq, keys, ns.tenant_salt)
                                       : dense_prefix_->Commit(seq, keys, ns.tenant_salt);
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
