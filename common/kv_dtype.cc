#include "common/kv_dtype.h"

#include "absl/strings/str_cat.h"

namespace dd {

absl::string_view KvDtypeName(KvDtype t) { return t == KvDtype::kF16 ? "f16" : "f32"; }

absl::StatusOr<KvDtype> ParseKvDtype(absl::string_view text, absl::string_view flag) {
  if (text == "f32") return KvDtype::kF32;
  if (text == "f16") return KvDtype::kF16;
  return absl::InvalidArgumentError(absl::StrCat("--", flag, " = '", text, "': the KV type must be f32 or f16"));
}

absl::StatusOr<KvDtype> KvDtypeFromWire(int64_t value) {
  if (value == 0) return KvDtype::kF32;
  if (value == 1) return KvDtype::kF16;
  return absl::InvalidArgumentError(absl::StrCat("KV dtype ", value, " is unknown (0 = f32, 1 = f16)"));
}

}  // namespace dd
