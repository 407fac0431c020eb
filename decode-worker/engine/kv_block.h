// One KV head's chunk as the KV store keeps it (kv-pool/client/kv_store.h): a block of
// [K (C × head_dim) | V (C × head_dim)] floats for C consecutive positions. The caches hold rows
// of n_head_kv × head_dim floats per position instead; these convert one head's part.
#pragma once

#include <cstdint>
#include <cstring>

namespace dd::engine {

// block ← head g of the C rows k(t), v(t) (t = 0..C-1: pointers to whole rows).
template <typename KRow, typename VRow>
void PackKvBlock(int64_t C, int64_t head_dim, int64_t g, KRow k, VRow v, float* block) {
  const size_t bytes = static_cast<size_t>(head_dim) * sizeof(float);
  for (int64_t t = 0; t < C; ++t) {
    std::memcpy(block + t * head_dim, k(t) + g * head_dim, bytes);
    std::memcpy(block + (C + t) * head_dim, v(t) + g * head_dim, bytes);
  }
}

// Head g of the C rows k(t), v(t) ← block.
template <typename KRow, typename VRow>
void UnpackKvBlock(int64_t C, int64_t head_dim, int64_t g, const float* block, KRow k, VRow v) {
  const size_t bytes = static_cast<size_t>(head_dim) * sizeof(float);
  for (int64_t t = 0; t < C; ++t) {
    std::memcpy(k(t) + g * head_dim, block + t * head_dim, bytes);
    std::memcpy(v(t) + g * head_dim, block + (C + t) * head_dim, bytes);
  }
}

}  // namespace dd::engine
