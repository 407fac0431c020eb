// Prefix reuse glue between the engine and the pool (docs/prefix-keys.md): the model's
// fingerprint and the key namespace the engine uses for its prompts.
#pragma once

#include <cstdint>

#include "decode-worker/model/weights.h"
#include "kv-pool/client/prefix_key.h"

namespace dd::engine {

// HashWords over the architecture's shape and, per weight matrix, type, shape and the first 64
// bytes of its data: equal for the same weights, different for any other checkpoint in practice.
uint64_t ModelFingerprint(const model::LoadedModel& model);

}  // namespace dd::engine
