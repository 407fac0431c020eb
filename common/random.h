// Values that must not be guessable (ids, names, secrets), from the OS's random source:
// std::random_device reads getrandom(2) on Linux, so no value reveals another (unlike a seeded
// generator, whose state its outputs give away). A system call per value: not for hot paths.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"

namespace dd {

inline uint64_t RandomU64() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) | rd();
}

// `words` × 16 hex digits.
inline std::string RandomHex(int words = 1) {
  std::string s;
  for (int i = 0; i < words; ++i) absl::StrAppend(&s, absl::Hex(RandomU64(), absl::kZeroPad16));
  return s;
}

}  // namespace dd
