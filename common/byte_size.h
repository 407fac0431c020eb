// Byte sizes for flags and config files: "512MiB", "2GiB", "1.5G", "4096" (bytes).
// K, M and G are binary (1024-based) with or without "iB".
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd {

// InvalidArgument naming `flag` ("--flag = 'x': ...") for anything else, negatives included.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text, absl::string_view flag);
std::string MiB(int64_t bytes);  // "12.3 MiB"

}  // namespace dd
