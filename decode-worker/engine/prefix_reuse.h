// Prefix reuse glue between the engine and the pool (docs/prefix-keys.md): the model's
// fingerprint and the key namespace the engine uses for its prompts.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "decode-worker/model/weights.h"
#include "kv-pool/client/kv_store.h"
#include "kv-pool/client/prefix_key.h"

namespace dd::engine {

// HashWords over the architecture's shape and, per weight matrix, type, shape and the first 64
// bytes of its data: equal for the same weights, different for any other checkpoint in practice.
uint64_t ModelFingerprint(const model::LoadedModel& model);

// Gathers chunks [c0, c1) of `layer`, every one of its n_kv KV heads, from stored sequence
// `handle` into `blocks` (chunk-major, then head: one [K | V] block of block_bytes each),
// urgently, and waits for them. Restores read a committed prefix this way.
absl::Status GatherLayerChunks(kvpool::KvStore& store, kvpool::SequenceId handle, int32_t layer, int64_t c0,
                               int64_t c1, int32_t n_kv, int64_t block_bytes, std::vector<uint8_t>* blocks);

}  // namespace dd::engine
