// Integer-list flags of the C++ benchmark drivers, parsed without exceptions (no engine headers:
// the pool benchmark uses it too).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"

namespace dd::bench {

// A flag's comma-separated integers, each in [lo, hi]. A value that is not an integer or out of
// range, or an empty list, ends the benchmark with a message naming the flag (exit status 2),
// never an uncaught exception.
inline std::vector<int64_t> Ints(const std::vector<std::string>& v, const char* flag = "a list flag",
                                 int64_t lo = std::numeric_limits<int64_t>::min(),
                                 int64_t hi = std::numeric_limits<int64_t>::max()) {
  std::vector<int64_t> out;
  for (const auto& s : v) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(s, &n)) {
      std::fprintf(stderr, "bench: %s: '%s' is not an integer\n", flag, s.c_str());
      std::exit(2);
    }
    if (n < lo || n > hi) {
      std::fprintf(stderr, "bench: %s: %lld is outside %lld..%lld\n", flag, static_cast<long long>(n),
                   static_cast<long long>(lo), static_cast<long long>(hi));
      std::exit(2);
    }
    out.push_back(n);
  }
  if (out.empty()) {
    std::fprintf(stderr, "bench: %s: expected at least one value\n", flag);
    std::exit(2);
  }
  return out;
}

}  // namespace dd::bench
