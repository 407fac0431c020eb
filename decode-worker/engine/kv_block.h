// One KV head's chunk as the KV store keeps it (kv-pool/client/kv_store.h): a block of
// [K (C × head_dim) | V (C × head_dim)] elements of the KV type for C consecutive positions.
// The caches hold rows of n_head_kv × head_dim elements per position instead; these convert one
// head's part (`head_bytes`: head_dim elements).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/kv_dtype.h"
#include "dd/kernels/dtype.h"

namespace dd::engine {

// Host rows in a KV type, as bytes.
using KvRows = std::vector<uint8_t>;

// n floats as host rows of type t (f16: rounded to nearest even, finite values beyond ±65504
// saturated, as Ops::StoreKv does).
inline KvRows NarrowRows(const float* x, int64_t n, KvDtype t) {
  KvRows out(static_cast<size_t>(n * KvDtypeBytes(t)));
  if (t == KvDtype::kF32) {
    std::memcpy(out.data(), x, out.size());
  } else {
    kernels::F32ToF16Saturating(x, n, reinterpret_cast<uint16_t*>(out.data()));
  }
  return out;
}

// block ← head g of the C rows k(t), v(t) (t = 0..C-1: byte pointers to whole rows).
template <typename KRow, typename VRow>
void PackKvBlock(int64_t C, int64_t head_bytes, int64_t g, KRow k, VRow v, uint8_t* block) {
  const size_t bytes = static_cast<size_t>(head_bytes);
  for (int64_t t = 0; t < C; ++t) {
    std::memcpy(block + t * head_bytes, k(t) + g * head_bytes, bytes);
    std::memcpy(block + (C + t) * head_bytes, v(t) + g * head_bytes, bytes);
  }
}

// Head g of the C rows k(t), v(t) ← block.
template <typename KRow, typename VRow>
void UnpackKvBlock(int64_t C, int64_t head_bytes, int64_t g, const uint8_t* block, KRow k, VRow v) {
  const size_t bytes = static_cast<size_t>(head_bytes);
  for (int64_t t = 0; t < C; ++t) {
    std::memcpy(k(t) + g * head_bytes, block + t * head_bytes, bytes);
    std::memcpy(v(t) + g * head_bytes, block + (C + t) * head_bytes, bytes);
  }
}

}  // namespace dd::engine
