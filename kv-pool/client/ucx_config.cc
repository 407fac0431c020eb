#include "kv-pool/client/ucx_config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "ucs/config/parser.h"

extern char** environ;

namespace dd::kvpool {
namespace {

// A UCX size setting ("32k", "1m", "inf") in bytes, read as UCX reads it; nullopt when UCX
// cannot read it.
std::optional<size_t> UcxSize(const char* text) {
  size_t bytes = 0;
  if (ucs_config_sscanf_memunits(text, &bytes, nullptr) != 1) return std::nullopt;
  return bytes;
}

}  // namespace

bool UcxSegmentSizeSet() {
  for (const char* name : {"UCX_MM_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

absl::Status CheckUcxSegmentSizes() {
  if (!FifoTransportsAllowed()) return absl::OkStatus();
  for (const char* name : {"UCX_MM_SEG_SIZE", "UCX_POSIX_SEG_SIZE", "UCX_SYSV_SEG_SIZE", "UCX_XPMEM_SEG_SIZE"}) {
    const char* env = std::getenv(name);
    const std::optional<size_t> bytes = env != nullptr ? UcxSize(env) : std::nullopt;
    if (bytes && *bytes > static_cast<size_t>(kUcxMaxSegBytes)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv pool ucx: ", name, "=", env, " is over ", kUcxMaxSegBytes,
          " bytes: UCX's shared-memory FIFO records a message's length in 16 bits, and a full segment that large "
          "kills the receiving process inside UCX. Set a size of at most ",
          kUcxMaxSegBytes, " bytes, or unset it for the data path's default (", kUcxSegSizeDefault, ")"));
    }
  }
  return absl::OkStatus();
}

bool UcxTcpSegmentSizeSet() { return std::getenv("UCX_TCP_RX_SEG_SIZE") != nullptr; }

int64_t UcxTcpSegmentBytes() {
  const char* env = std::getenv("UCX_TCP_RX_SEG_SIZE");
  const std::string text = env != nullptr ? std::string(env) : std::string(kUcxTcpSegSizeDefault);
  const std::optional<size_t> bytes = UcxSize(text.c_str());
  return !bytes || *bytes > static_cast<size_t>(INT64_MAX) ? 0 : static_cast<int64_t>(*bytes);  // "inf"
}

int64_t UcxEagerReplyBytes() {
  constexpr int64_t kHeadroom = 1024, kMax = int64_t{16} << 20;
  return std::clamp<int64_t>(UcxTcpSegmentBytes() - kHeadroom, 0, kMax);
}

std::string UcxAmTransport(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return "";
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::string found;
  // e.g. "#   lane[0]:  1:tcp/lo.0 md[0]   -> md[1]/tcp/sysdev[255] am am_bw#0 keepalive wireup"
  for (absl::string_view line : absl::StrSplit(absl::string_view(text != nullptr ? text : "", size), '\n')) {
    if (!absl::StrContains(line, "lane[")) continue;
    const std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (std::find(words.begin(), words.end(), "am") == words.end()) continue;
    for (absl::string_view w : words) {  // the first "<index>:<transport>/<device>"
      const size_t colon = w.find(':'), slash = w.find('/');
      if (colon != absl::string_view::npos && slash != absl::string_view::npos && colon < slash && colon > 0 &&
          w.substr(0, colon).find_first_not_of("0123456789") == absl::string_view::npos) {
        found = std::string(w.substr(colon + 1, slash - colon - 1));
        break;
      }
    }
    if (!found.empty()) break;
  }
  std::free(text);
  return found;
}

bool IsSharedMemoryTransport(absl::string_view t) {
  return t == "sm" || t == "shm" || t == "mm" || t == "posix" || t == "sysv" || t == "cma" || t == "xpmem" ||
         t == "knem";
}

namespace {

// A UCX_TLS entry as the transport it names: UCX also takes "\\tcp" (strictly that name) and
// "tcp:aux" (as an auxiliary transport), and loads tcp for both.
absl::string_view TlsEntry(absl::string_view entry) {
  absl::ConsumePrefix(&entry, "\\");
  absl::ConsumeSuffix(&entry, ":aux");
  return entry;
}

// UCX reads an exclusion list that starts with "all" ("^all...") as every transport (its list
// parser takes a first "all" as "allow all"). `excluded`: UCX_TLS after its "^".
bool ExcludesAllMeansAll(absl::string_view excluded) {
  return TlsEntry(excluded.substr(0, excluded.find(','))) == "all";
}

}  // namespace

bool TlsAllowsAny(std::initializer_list<absl::string_view> transports) {
  const char* env = std::getenv("UCX_TLS");
  absl::string_view tls = env != nullptr ? env : "";
  if (tls.empty()) return true;
  const bool exclude = absl::ConsumePrefix(&tls, "^");  // "^a,b": every transport but a and b
  if (exclude && ExcludesAllMeansAll(tls)) return true;
  // Whether a UCX_TLS entry names transport `t` (itself, or an alias covering it).
  auto names = [](absl::string_view entry, absl::string_view t) {
    if (entry == t || entry == "all") return true;
    const bool shared = t == "posix" || t == "sysv" || t == "cma" || t == "xpmem" || t == "knem";
    if ((entry == "sm" || entry == "shm") && shared) return true;
    return entry == "mm" && (t == "posix" || t == "sysv" || t == "xpmem");
  };
  for (absl::string_view t : transports) {
    bool named = false;
    for (absl::string_view entry : absl::StrSplit(tls, ',')) named = named || names(TlsEntry(entry), t);
    if (named != exclude) return true;
  }
  return false;
}

absl::StatusOr<std::string> TlsWithoutTcp(absl::string_view tls) {
  if (tls.empty()) return std::string("^tcp");
  if (absl::ConsumePrefix(&tls, "^")) {
    if (ExcludesAllMeansAll(tls)) return std::string("^tcp");
    std::vector<absl::string_view> out = absl::StrSplit(tls, ',', absl::SkipEmpty());
    bool has_tcp = false;
    for (absl::string_view t : out) has_tcp = has_tcp || TlsEntry(t) == "tcp";
    if (!has_tcp) out.push_back("tcp");
    return absl::StrCat("^", absl::StrJoin(out, ","));
  }
  std::vector<absl::string_view> kept;
  for (absl::string_view t : absl::StrSplit(tls, ',', absl::SkipEmpty())) {
    if (TlsEntry(t) == "all") return std::string("^tcp");
    if (TlsEntry(t) != "tcp") kept.push_back(t);
  }
  if (kept.empty() || (kept.size() == 1 && kept[0] == "self")) {
    return absl::FailedPreconditionError(absl::StrCat("UCX_TLS=", tls, " leaves no transport but tcp"));
  }
  return absl::StrJoin(kept, ",");
}

bool TlsNamesTcp() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '^') return false;
  for (absl::string_view t : absl::StrSplit(tls, ',')) {
    if (TlsEntry(t) == "tcp") return true;
  }
  return false;
}

bool UcxContextHasTcp(ucp_context_h context) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return true;  // cannot tell: assume the worst
  ucp_context_print_info(context, f);
  std::fclose(f);
  const bool tcp = text == nullptr || absl::StrContains(absl::string_view(text, size), "-- tcp/");
  std::free(text);
  return tcp;
}

bool UcxCudaDestinations(bool rma, uint64_t memory_types, bool allowed) {
  return rma && allowed && (memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

absl::StatusOr<bool> UcxGpuDirectAllowed() {
  const char* v = std::getenv("DD_UCX_GPUDIRECT");
  if (v == nullptr || *v == '\0' || std::string(v) == "off") return false;
  if (std::string(v) == "on") return true;
  return absl::InvalidArgumentError(absl::StrCat("DD_UCX_GPUDIRECT '", v, "': expected on or off"));
}

uint64_t UcxMemoryTypes(ucp_context_h context) {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  return ucp_context_query(context, &attr) == UCS_OK ? attr.memory_types : 0;
}

bool SharedMemoryAllowed() { return TlsAllowsAny({"posix", "sysv", "cma", "xpmem", "knem"}); }

bool FifoTransportsAllowed() { return TlsAllowsAny({"posix", "sysv", "xpmem"}); }

bool SharedMemoryOnly() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0') return false;
  for (absl::string_view entry : absl::StrSplit(tls, ',')) {
    const absl::string_view t = TlsEntry(entry);  // "\\posix", "cma:aux" name posix, cma
    if (!IsSharedMemoryTransport(t) && t != "self") return false;
  }
  return true;
}

bool UcxSharedMemoryCompatible(absl::string_view a, absl::string_view b) {
  return a == b || absl::EndsWith(a, kNoSharedMemory) || absl::EndsWith(b, kNoSharedMemory);
}

bool UcxTcpCompatible(absl::string_view a, absl::string_view b) { return a == b || a == kNoTcp || b == kNoTcp; }

absl::StatusOr<ucp_config_t*> ReadUcxConfig(bool tcp) {
  if (absl::Status st = CheckUcxSegmentSizes(); !st.ok()) return st;
  std::string tls;  // UCX_TLS for this context, when it differs from the environment's
  if (!tcp && TlsAllowsAny({"tcp"})) {
    const char* env = std::getenv("UCX_TLS");
    absl::StatusOr<std::string> without = TlsWithoutTcp(env != nullptr ? env : "");
    if (!without.ok()) return absl::FailedPreconditionError(absl::StrCat("kv pool ucx: ", without.status().message()));
    tls = *without;
  }
  ucp_config_t* config = nullptr;
  if (ucs_status_t st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return absl::InternalError(absl::StrCat("kv pool ucx: ucp_config_read: ", ucs_status_string(st)));
  }
  if (!tls.empty()) {
    if (ucs_status_t st = ucp_config_modify(config, "TLS", tls.c_str()); st != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(absl::StrCat("kv pool ucx: setting TLS=", tls, ": ", ucs_status_string(st)));
    }
  }
  // Only where a transport takes the setting (else UCX warns of it), and not over the user's own.
  const struct {
    bool applies;
    const char* name;
    absl::string_view value;
  } defaults[] = {{FifoTransportsAllowed() && !UcxSegmentSizeSet(), "MM_SEG_SIZE", kUcxSegSizeDefault},
                  {tcp && TlsAllowsAny({"tcp"}) && !UcxTcpSegmentSizeSet(), "RX_SEG_SIZE", kUcxTcpSegSizeDefault}};
  for (const auto& d : defaults) {
    if (!d.applies) continue;
    if (ucs_status_t st = ucp_config_modify(config, d.name, std::string(d.value).c_str()); st != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(absl::StrCat("kv pool ucx: setting ", d.name, ": ", ucs_status_string(st)));
    }
  }
  return config;
}

namespace {

// The environment's UCX variables that `wanted` picks, plus `default_line` (unless empty), sorted
// and joined: a settings line two processes compare.
template <typename Pred>
std::string SettingsLine(const Pred& wanted, std::string default_line) {
  std::vector<std::string> set;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (wanted(absl::string_view(*e))) set.emplace_back(*e);
  }
  if (!default_line.empty()) set.push_back(std::move(default_line));
  std::sort(set.begin(), set.end());
  return absl::StrJoin(set, " ");
}

}  // namespace

std::string UcxSharedMemorySettings() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (!FifoTransportsAllowed()) return absl::StrCat("ucx ", major, ".", minor, ".", release, "; ", kNoSharedMemory);
  const auto fifo = [](absl::string_view v) {
    for (const char* prefix : {"UCX_MM_", "UCX_POSIX_", "UCX_SYSV_", "UCX_XPMEM_"}) {
      if (absl::StartsWith(v, prefix)) return true;
    }
    return false;
  };
  // The default written as the variable would be: an explicit UCX_MM_SEG_SIZE=32k compares equal.
  return absl::StrCat("ucx ", major, ".", minor, ".", release, "; ",
                      SettingsLine(fifo, UcxSegmentSizeSet() ? "" : absl::StrCat("UCX_MM_SEG_SIZE=", kUcxSegSizeDefault)));
}

std::string UcxTcpSettings() {
  if (!TlsAllowsAny({"tcp"})) return std::string(kNoTcp);
  const auto segments = [](absl::string_view v) {
    return absl::StartsWith(v, "UCX_TCP_") && absl::StrContains(v.substr(0, v.find('=')), "SEG_SIZE");
  };
  return SettingsLine(segments, UcxTcpSegmentSizeSet() ? "" : absl::StrCat("UCX_TCP_RX_SEG_SIZE=", kUcxTcpSegSizeDefault));
}

}  // namespace dd::kvpool
