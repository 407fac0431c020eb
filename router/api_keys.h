// Who may call the router's public API (docs/operations.md, "Security model as built"). Two
// credentials, both sent as gRPC metadata `authorization: Bearer <key>`:
//   tenant API keys (--api_keys_file: a JSON array [{"tenant": NAME, "key": KEY}, ...], keys of
//   at least 32 printable characters, file mode 0600) for Generate and ListModels;
//   the operator key (--operator_key_file: one line, 0600, like the cluster secret) for the
//   operator calls ListWorkers and Stats.
// Health stays open (it says only whether the router can serve; probes use it). With neither
// file the API is open, as for the local embedded default. With tenant keys but no operator
// key, the operator calls are refused outright: nothing about the fleet leaks to a tenant.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace dd::router {

struct ApiKey {
  std::string tenant, key;
  int64_t max_inflight = 0;  // the tenant's requests in flight at once (0: the router's default)
  // Prefix reuse shared with the other tenants that set it (a common system prompt): their
  // prompts' prefixes are keyed without a tenant salt, so they learn whether one another sent
  // a prefix. Off: the tenant's prefixes are its own.
  bool shared_prefixes = false;
};

absl::StatusOr<std::vector<ApiKey>> LoadApiKeys(const std::string& path);

class ApiAuth {
 public:
  ApiAuth() = default;
  ApiAuth(std::vector<ApiKey> keys, std::string operator_key)
      : keys_(std::move(keys)), operator_key_(std::move(operator_key)), tenant_count_(CountTenants(keys_)) {}
  bool enabled() const { return !keys_.empty() || !operator_key_.empty(); }
  // A tenant call: OK with the tenant's name in `tenant` ("" when the API is open), else
  // UNAUTHENTICATED. The operator key is accepted too (tenant "operator").
  grpc::Status Tenant(const grpc::ServerContext* ctx, std::string* tenant) const;
  // The same for an authorization value as it came ("Bearer KEY"; nullopt: none was sent), for
  // fronts that check a caller before its request reaches gRPC (the HTTP front, before the body).
  grpc::Status TenantOf(std::optional<absl::string_view> authorization, std::string* tenant) const;
  // An operator call: OK only with the operator key when any credential is configured.
  grpc::Status Operator(const grpc::ServerContext* ctx) const;
  // Distinct tenants with keys.
  int64_t tenant_count() const { return tenant_count_; }
  // The largest max_inflight among the tenant's keys (0: none set).
  int64_t TenantMaxInflight(const std::string& tenant) const;
  // Whether any of the tenant's keys opts into shared prefixes.
  bool SharesPrefixes(const std::string& tenant) const;

 private:
  static int64_t CountTenants(const std::vector<ApiKey>& keys);

  std::vector<ApiKey> keys_;
  std::string operator_key_;
  int64_t tenant_count_ = 0;  // asked on every request: counted once
};

}  // namespace dd::router
