// Handling of credentials, in one place: comparing a presented secret without leaking, through
// timing, how much of it matched, and refusing credential files other users could read.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace dd {

// Whether `got` equals `want`, in time that depends only on want's length (no early exit on
// the first differing byte, whatever `got` is).
inline bool SecretEquals(absl::string_view want, absl::string_view got) {
  unsigned char diff = want.size() == got.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got[i] : 0));
  }
  return diff == 0;
}

// INVALID_ARGUMENT naming `what` and `path` when the file cannot be read, is readable or
// writable by group or others (it holds secrets: chmod 600), or is over `max_bytes`.
inline absl::Status CheckPrivateFile(const std::string& path, absl::string_view what, int64_t max_bytes) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " cannot be read"));
  if (st.st_mode & (S_IRWXG | S_IRWXO)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is accessible to group or others (chmod 600 it)"));
  }
  if (st.st_size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is over ", max_bytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace dd
