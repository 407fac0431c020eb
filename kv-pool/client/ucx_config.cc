#include "kv-pool/client/ucx_config.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace dd::kvpool {
namespace {

constexpr const char* kSegSizeDefault = "32k";

bool SegmentSizeSet() {
  for (const char* name : {"UCX_MM_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

}  // namespace

bool IsSharedMemoryTransport(absl::string_view t) {
  return t == "sm" || t == "shm" || t == "posix" || t == "sysv" || t == "cma" || t == "xpmem" || t == "knem";
}

bool SharedMemoryAllowed() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0' || *tls == '^') return true;  // "^x,y": all but those
  for (absl::string_view t : absl::StrSplit(tls, ',')) {
    if (t == "all" || IsSharedMemoryTransport(t)) return true;
  }
  return false;
}

bool FifoTransportsAllowed() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0' || *tls == '^') return true;
  for (absl::string_view t : absl::StrSplit(tls, ',')) {
    if (t == "all" || t == "sm" || t == "shm" || t == "posix" || t == "sysv") return true;
  }
  return false;
}

absl::StatusOr<ucp_config_t*> ReadUcxConfig() {
  ucp_config_t* config = nullptr;
  if (ucs_status_t st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return absl::InternalError(absl::StrCat("kv pool ucx: ucp_config_read: ", ucs_status_string(st)));
  }
  if (FifoTransportsAllowed() && !SegmentSizeSet()) {  // else UCX warns of a setting no transport took
    if (ucs_status_t st = ucp_config_modify(config, "MM_SEG_SIZE", kSegSizeDefault); st != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(absl::StrCat("kv pool ucx: setting MM_SEG_SIZE: ", ucs_status_string(st)));
    }
  }
  return config;
}

std::string UcxSharedMemorySettings() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (!FifoTransportsAllowed()) return absl::StrCat("ucx ", major, ".", minor, ".", release, "; ", kNoSharedMemory);
  std::vector<std::string> set;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const absl::string_view v(*e);
    for (const char* prefix : {"UCX_MM_", "UCX_POSIX_", "UCX_SYSV_", "UCX_XPMEM_"}) {
      if (absl::StartsWith(v, prefix)) {
        set.emplace_back(v);
        break;
      }
    }
  }
  if (!SegmentSizeSet()) set.push_back(absl::StrCat("UCX_MM_SEG_SIZE=", kSegSizeDefault, " (default)"));
  std::sort(set.begin(), set.end());
  return absl::StrCat("ucx ", major, ".", minor, ".", release, "; ", absl::StrJoin(set, " "));
}

}  // namespace dd::kvpool
