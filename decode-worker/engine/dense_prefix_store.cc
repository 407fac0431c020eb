#include "decode-worker/engine/dense_prefix_store.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/kv_block.h"

namespace dd::engine {

absl::Status DensePrefixStore::Restore(int32_t seq, kvpool::SequenceId handle, kvpool::SequenceId own,
                                       int64_t tokens) {
  const int64_t C = chunk_, row = config_.n_head_kv * config_.head_dim * KvDtypeBytes(dense_.kv_dtype());
  if (tokens <= 0 || tokens % C != 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix of ", tokens, " tokens is not a positive multiple of ", C));
  }
  if (dense_.Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  constexpr int64_t kBatch = 64;  // chunks per gather
  KvRows k, v, krows, vrows;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (!layers_[l]) continue;
    // A sliding layer needs only the rows its decode-time ring keeps.
    const int64_t keep_from = config_.layer_is_swa[l] ? std::max<int64_t>(0, tokens - config_.sliding_window - 1) : 0;
    const int64_t first = keep_from / C * C, chunks = tokens / C;
    krows.resize((tokens - first) * row);
    vrows.resize(krows.size());
    for (int64_t c0 = own != 0 ? 0 : first / C; c0 < chunks; c0 += kBatch) {
      const int64_t c1 = std::min(chunks, c0 + kBatch);
      RETURN_IF_ERROR(chunks_.ReadRows(handle, l, c0, c1, &k, &v));
      if (own != 0) RETURN_IF_ERROR(chunks_.WriteChunks(own, l, c0, c1, k.data(), v.data()));
      const int64_t from = std::max(first, c0 * C), to = c1 * C;
      if (from < to) {
        std::memcpy(&krows[(from - first) * row], &k[(from - c0 * C) * row], (to - from) * row);
        std::memcpy(&vrows[(from - first) * row], &v[(from - c0 * C) * row], (to - from) * row);
      }
    }
    RETURN_IF_ERROR(dense_.LoadRows(seq, l, tokens, krows.data(), vrows.data(), tokens - first));
  }
  return absl::OkStatus();
}

absl::Status DensePrefixStore::Copy(kvpool::SequenceId handle, kvpool::SequenceId own, int64_t tokens) {
  constexpr int64_t kBatch = 64;  // chunks per gather
  const int64_t chunks = tokens / chunk_;
  KvRows k, v;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (!layers_[l]) continue;
    for (int64_t c0 = 0; c0 < chunks; c0 += kBatch) {
      const int64_t c1 = std::min(chunks, c0 + kBatch);
      RETURN_IF_ERROR(chunks_.ReadRows(handle, l, c0, c1, &k, &v));
      RETURN_IF_ERROR(chunks_.WriteChunks(own, l, c0, c1, k.data(), v.data()));
    }
  }
  return absl::OkStatus();
}

absl::Status DensePrefixStore::Offload(int32_t seq, kvpool::SequenceId own, int64_t from, int64_t to) {
  const int64_t C = chunk_, row = config_.n_head_kv * config_.head_dim * KvDtypeBytes(dense_.kv_dtype());
  const int64_t c0 = from / C, c1 = to / C;  // the chunks this pass completed
  if (c1 <= c0) return absl::OkStatus();
  KvRows k((c1 - c0) * C * row), v(k.size());
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (!layers_[l]) continue;
    RETURN_IF_ERROR(dense_.ReadRows(seq, l, c0 * C, c1 * C, k.data(), v.data()));
    RETURN_IF_ERROR(chunks_.WriteChunks(own, l, c0, c1, k.data(), v.data()));
  }
  return absl::OkStatus();
}

}  // namespace dd::engine
