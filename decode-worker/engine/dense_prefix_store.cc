#include "decode-worker/engine/dense_prefix_store.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/kv_block.h"

namespace dd::engine {

absl::Status DensePrefixStore::Restore(int32_t seq, kvpool::SequenceId handle, kvpool::SequenceId own,
                                       int64_t tokens) {
  const int64_t C = chunk_, kv_dim = config_.n_head_kv * config_.head_dim;
  if (tokens <= 0 || tokens % C != 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix of ", tokens, " tokens is not a positive multiple of ", C));
  }
  if (dense_.Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  constexpr int64_t kBatch = 64;  // chunks per gather
  std::vector<float> k, v, krows, vrows;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (!layers_[l]) continue;
    // A sliding layer needs only the rows its decode-time ring keeps.
    const int64_t keep_from = config_.layer_is_swa[l] ? std::max<int64_t>(0, tokens - config_.sliding_window - 1) : 0;
    const int64_t first = keep_from / C * C, chunks = tokens / C;
    krows.assign((tokens - first) * kv_dim, 0.0f);
    vrows.assign(krows.size(), 0.0f);
    for (int64_t c0 = 0; c0 < chunks; c0 += kBatch) {
      const int64_t c1 = std::min(chunks, c0 + kBatch);
      RETURN_IF_ERROR(chunks_.ReadRows(handle, l, c0, c1, &k, &v));
      RETURN_IF_ERROR(chunks_.WriteChunks(own, l, c0, c1, k.data(), v.data()));
      for (int64_t pos = std::max(first, c0 * C); pos < c1 * C; ++pos) {
        std::memcpy(&krows[(pos - first) * kv_dim], &k[(pos - c0 * C) * kv_dim], kv_dim * sizeof(float));
        std::memcpy(&vrows[(pos - first) * kv_dim], &v[(pos - c0 * C) * kv_dim], kv_dim * sizeof(float));
      }
    }
    // Blocks hold f32 (the store's type): the dense layers' own type is exact for what it wrote.
    const int64_t n = (tokens - first) * kv_dim;
    const KvDtype t = dense_.kv_dtype();
    const KvRows kr = NarrowRows(krows.data(), n, t), vr = NarrowRows(vrows.data(), n, t);
    RETURN_IF_ERROR(dense_.LoadRows(seq, l, tokens, kr.data(), vr.data(), tokens - first));
  }
  return absl::OkStatus();
}

absl::Status DensePrefixStore::Offload(int32_t seq, kvpool::SequenceId own, int64_t from, int64_t to) {
  const int64_t C = chunk_, kv_dim = config_.n_head_kv * config_.head_dim;
  const int64_t c0 = from / C, c1 = to / C;  // the chunks this pass completed
  if (c1 <= c0) return absl::OkStatus();
  const int64_t n = (c1 - c0) * C * kv_dim;
  const KvDtype t = dense_.kv_dtype();
  std::vector<float> k(n), v(n);
  KvRows kr(n * KvDtypeBytes(t)), vr(kr.size());
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (!layers_[l]) continue;
    RETURN_IF_ERROR(dense_.ReadRows(seq, l, c0 * C, c1 * C, kr.data(), vr.data()));
    WidenRows(kr.data(), n, t, k.data());
    WidenRows(vr.data(), n, t, v.data());
    RETURN_IF_ERROR(chunks_.WriteChunks(own, l, c0, c1, k.data(), v.data()));
  }
  return absl::OkStatus();
}

}  // namespace dd::engine
