#include "common/byte_size.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace dd {

std::string MiB(int64_t bytes) { return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20)); }

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text, absl::string_view flag) {
  const std::string s(text);
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  std::string unit(end);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char ch) { return std::isspace(ch); }), unit.end());
  for (char& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k" || unit == "kib" || unit == "kb") scale = 1024.0;
  else if (unit == "m" || unit == "mib" || unit == "mb") scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib" || unit == "gb") scale = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib" || unit == "tb") scale = 1024.0 * 1024 * 1024 * 1024;
  const std::string prefix = absl::StrCat("--", flag, " = '", text, "': ");
  if (end == s.c_str() || !(value >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "expected a non-negative size such as 8GiB, 512MiB or 1073741824 (bytes)"));
  }
  if (scale == 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "unknown unit '", unit, "' (B, KiB, MiB, GiB, TiB)"));
  }
  if (value * scale > 9.0e18) return absl::InvalidArgumentError(absl::StrCat(prefix, "larger than 8 EiB"));
  return static_cast<int64_t>(value * scale);
}

}  // namespace dd
