// Bounds a JSON text's shape before it is parsed into a document. A DOM costs tens of bytes per
// value and nesting, so 8 MiB of "[[[[..." becomes hundreds of MiB; this scan costs nothing and
// refuses such a text first. It does not validate JSON (the parser does that afterwards): it
// only counts, ignoring what is inside strings.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dd {

struct JsonBounds {
  int max_depth = 32;            // arrays and objects inside one another
  int64_t max_values = 100000;   // arrays, objects and their elements, counted over the text
};

// OK when `text` nests at most max_depth deep and holds at most max_values values; else
// INVALID_ARGUMENT saying which bound it passed.
[[nodiscard]] absl::Status CheckJsonBounds(absl::string_view text, const JsonBounds& bounds = {});

}  // namespace dd
