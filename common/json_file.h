// Reads and parses a JSON file (tenants, API keys): never throws; errors name the file and, for
// a syntax error, the byte. Header-only: callers link nlohmann_json themselves.
#pragma once

#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace dd {

inline absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path, const std::string& what) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat(what, " ", path, " cannot be read"));
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::parse_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON (byte ", e.byte, "): ", e.what()));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number out of range (found by fuzz/tenants)
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
}

}  // namespace dd
