// The element type KV rows and blocks are kept in, wherever KV lives: the caches' device
// memory, the KV store's blocks (kvpool::KvLayout), the wire and the prefix cache
// (docs/decisions/0049-kv-storage-type.md). Kernels widen it to f32 in registers and
// accumulate in f32; queries, scores, landmarks and outputs stay f32.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd {

// Values are the wire's (kvpool.proto's KvLayout.dtype): never renumber.
enum class KvDtype : uint8_t {
  kF32 = 0,  // the bits of the forward pass's K and V
  kF16 = 1,  // IEEE binary16, rounded to nearest even; finite values beyond ±65504 saturate
};

inline int64_t KvDtypeBytes(KvDtype t) { return t == KvDtype::kF16 ? 2 : 4; }
absl::string_view KvDtypeName(KvDtype t);  // "f32", "f16"
// "f32" or "f16"; InvalidArgument naming `flag` and the accepted values otherwise.
absl::StatusOr<KvDtype> ParseKvDtype(absl::string_view text, absl::string_view flag);
// A wire value (0, 1); InvalidArgument for any other.
absl::StatusOr<KvDtype> KvDtypeFromWire(int64_t value);

}  // namespace dd
