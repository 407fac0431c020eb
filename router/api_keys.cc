#include "router/api_keys.h"

#include <algorithm>
#include <optional>
#include <sys/stat.h>


#include "absl/strings/str_cat.h"
#include "common/json_file.h"
#include "common/secrets.h"
#include "nlohmann/json.hpp"
#include "proto/cluster_auth.h"

namespace dd::router {
namespace {

// Compares every configured key in full whatever matches, so timing says nothing about which
// prefix of which key was right.
bool SameKey(const std::string& want, const char* got, size_t got_size) {
  return SecretEquals(want, absl::string_view(got, got_size));
}

// The token of an authorization value "Bearer TOKEN", or false when it is not one.
bool BearerToken(absl::string_view v, const char** token, size_t* size) {
  constexpr absl::string_view kPrefix = "Bearer ";
  if (v.size() <= kPrefix.size() || v.substr(0, kPrefix.size()) != kPrefix) return false;
  *token = v.data() + kPrefix.size();
  *size = v.size() - kPrefix.size();
  return true;
}

// The call's authorization metadata, or nullopt when it has none.
std::optional<absl::string_view> AuthorizationOf(const grpc::ServerContext* ctx) {
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

// The bearer token of the call, or false when there is none.
bool Bearer(const grpc::ServerContext* ctx, const char** token, size_t* size) {
  const std::optional<absl::string_view> v = AuthorizationOf(ctx);
  return v.has_value() && BearerToken(*v, token, size);
}

}  // namespace

absl::StatusOr<std::vector<ApiKey>> LoadApiKeys(const std::string& path) {
  if (path.empty()) return std::vector<ApiKey>();
  if (absl::Status s = CheckPrivateFile(path, "API keys file", 1 << 20); !s.ok()) return s;
  absl::StatusOr<nlohmann::json> parsed = ReadJsonFile(path, "API keys file");
  if (!parsed.ok()) return parsed.status();
  const nlohmann::json& j = *parsed;
  if (!j.is_array() || j.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a non-empty JSON array of {tenant, key}"));
  }
  std::vector<ApiKey> keys;
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& e = j[i];
    const std::string where = absl::StrCat(path, ": entry ", i);
    if (!e.is_object() || !e.contains("tenant") || !e["tenant"].is_string() || !e.contains("key") ||
        !e["key"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": needs string fields tenant and key"));
    }
    ApiKey k{e["tenant"].get<std::string>(), e["key"].get<std::string>()};
    if (e.contains("max_inflight")) {
      const nlohmann::json& m = e["max_inflight"];
      if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > 1000000) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": max_inflight must be an integer in [1, 1000000]"));
      }
      k.max_inflight = m.get<int64_t>();
    }
    if (e.contains("shared_prefixes")) {
      if (!e["shared_prefixes"].is_boolean()) return absl::InvalidArgumentError(absl::StrCat(where, ": shared_prefixes must be true or false"));
      k.shared_prefixes = e["shared_prefixes"].get<bool>();
    }
    if (k.tenant.empty() || k.tenant.size() > 64) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tenant must be 1 to 64 characters"));
    }
    if (k.key.size() < kMinClusterSecretBytes || k.key.size() > 256) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": key must be ", kMinClusterSecretBytes, " to 256 characters"));
    }
    for (unsigned char c : k.key) {
      if (c < 0x21 || c > 0x7e) return absl::InvalidArgumentError(absl::StrCat(where, ": key has a character outside printable ASCII"));
    }
    for (const ApiKey& o : keys) {
      if (o.key == k.key) return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate key"));
    }
    keys.push_back(std::move(k));
  }
  return keys;
}

int64_t ApiAuth::CountTenants(const std::vector<ApiKey>& keys) {
  std::vector<std::string> names;
  for (const ApiKey& k : keys) {
    if (std::find(names.begin(), names.end(), k.tenant) == names.end()) names.push_back(k.tenant);
  }
  return static_cast<int64_t>(names.size());
}

int64_t ApiAuth::TenantMaxInflight(const std::string& tenant) const {
  int64_t n = 0;
  for (const ApiKey& k : keys_) {
    if (k.tenant == tenant) n = std::max(n, k.max_inflight);
  }
  return n;
}

bool ApiAuth::SharesPrefixes(const std::string& tenant) const {
  for (const ApiKey& k : keys_) {
    if (k.tenant == tenant && k.shared_prefixes) return true;
  }
  return false;
}

grpc::Status ApiAuth::Tenant(const grpc::ServerContext* ctx, std::string* tenant) const {
  return TenantOf(AuthorizationOf(ctx), tenant);
}

grpc::Status ApiAuth::TenantOf(std::optional<absl::string_view> authorization, std::string* tenant) const {
  tenant->clear();
  if (!enabled()) return grpc::Status::OK;
  const char* token = nullptr;
  size_t size = 0;
  if (!authorization.has_value() || !BearerToken(*authorization, &token, &size)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing API key (metadata 'authorization: Bearer <key>')");
  }
  const std::string* found = nullptr;
  for (const ApiKey& k : keys_) {
    if (SameKey(k.key, token, size)) found = &k.tenant;
  }
  static const std::string kOperator = "operator";
  if (!operator_key_.empty() && SameKey(operator_key_, token, size)) found = &kOperator;
  if (found == nullptr) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown API key");
  *tenant = *found;
  return grpc::Status::OK;
}

grpc::Status ApiAuth::Operator(const grpc::ServerContext* ctx) const {
  if (!enabled()) return grpc::Status::OK;
  if (operator_key_.empty()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "operator calls are off: the router has tenant API keys but no --operator_key_file");
  }
  const char* token = nullptr;
  size_t size = 0;
  if (!Bearer(ctx, &token, &size)) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing operator key (metadata 'authorization: Bearer <key>')");
  }
  if (!SameKey(operator_key_, token, size)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "this call needs the operator key");
  }
  return grpc::Status::OK;
}

}  // namespace dd::router
