#include "common/json_bounds.h"

#include "absl/strings/str_cat.h"

namespace dd {

absl::Status CheckJsonBounds(absl::string_view text, const JsonBounds& bounds) {
  int depth = 0;
  int64_t values = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    switch (ch) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > bounds.max_depth) {
          return absl::InvalidArgumentError(
              absl::StrCat("the JSON nests deeper than ", bounds.max_depth, " arrays and objects"));
        }
        [[fallthrough]];
      case ',':
        if (++values > bounds.max_values) {
          return absl::InvalidArgumentError(absl::StrCat("the JSON holds more than ", bounds.max_values, " values"));
        }
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace dd
