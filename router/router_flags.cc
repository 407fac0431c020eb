#include "router/router_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/byte_size.h"
#include "proto/cluster_auth.h"
#include "proto/request_check.h"

ABSL_FLAG(int64_t, heartbeat_timeout_ms, 3000, "router: a worker silent this long is down (not placed on)");
ABSL_FLAG(int64_t, max_inflight, 256, "router: requests in flight at once; more are refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, tenant_max_inflight, 0,
          "router: requests one API tenant may have in flight (a key's \"max_inflight\" in --api_keys_file wins); "
          "0 = with two or more tenants, an equal share of the workers' capacity (batch + queue of those up, at "
          "most --max_inflight), else no per-tenant limit");
ABSL_FLAG(bool, expose_worker_id, false,
          "router: name the serving worker in every caller's usage; off, only the operator key and an open API "
          "see it (a tenant would otherwise learn where other tenants' prompts were placed)");
ABSL_FLAG(int32_t, max_resumes, 3, "router: times a request may move to another worker after failures");
ABSL_FLAG(int32_t, max_workers, 256, "router: workers it keeps track of; more registrations are refused");
ABSL_FLAG(std::string, api_keys_file, "",
          "router: tenant API keys, JSON [{\"tenant\": NAME, \"key\": KEY}] (mode 0600); Generate and ListModels "
          "then need 'authorization: Bearer KEY'");
ABSL_FLAG(std::string, operator_key_file, "",
          "router: the operator key (one line, mode 0600) that ListWorkers and Stats need once any key is set");

ABSL_FLAG(std::string, http_listen, "",
          "router: OpenAI-compatible HTTP endpoint (/v1/models, /v1/completions, /v1/chat/completions) on "
          "HOST:PORT (port 0 = pick one); empty = off");

ABSL_FLAG(std::string, http_cors_origins, "",
          "router: browser origins the HTTP endpoint answers (comma-separated, e.g. https://app.example.com); a "
          "request with any other Origin header gets 403. Empty = no browser access");
ABSL_FLAG(std::string, http_allowed_hosts, "",
          "router: Host names the HTTP endpoint answers (comma-separated, no port). Empty = any with API keys; "
          "without keys only IP addresses and localhost (against DNS rebinding)");

ABSL_FLAG(int32_t, http_threads, 64,
          "router: HTTP requests handled at once (a streamed one holds its thread until it ends); 4x as many wait, "
          "then 503. Idle connections take none");
ABSL_FLAG(std::string, http_max_body_bytes, "8MiB",
          "router: largest HTTP request body (e.g. 1MiB); a larger one gets 413 before any of it is read. Bodies "
          "are read only after the API key is checked");
ABSL_FLAG(int32_t, http_max_connections_per_client, 256,
          "router: open HTTP connections one client address may hold (more are closed at once); raise it when every "
          "request arrives through one proxy");

namespace dd::router {

absl::StatusOr<HttpOptions> HttpOptionsFromFlags(const ApiAuth& auth) {
  HttpOptions o;
  absl::StatusOr<int64_t> body = ParseByteSize(absl::GetFlag(FLAGS_http_max_body_bytes), "http_max_body_bytes");
  if (!body.ok()) return body.status();
  if (*body < 1024 || *body > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("--http_max_body_bytes must be between 1KiB and 1GiB");
  }
  o.max_body_bytes = *body;
  o.auth = auth;
  o.listen = absl::GetFlag(FLAGS_http_listen);
  o.cors_origins = absl::StrSplit(absl::GetFlag(FLAGS_http_cors_origins), ',', absl::SkipWhitespace());
  o.allowed_hosts = absl::StrSplit(absl::GetFlag(FLAGS_http_allowed_hosts), ',', absl::SkipWhitespace());
  o.open_api = !auth.enabled();
  o.threads = absl::GetFlag(FLAGS_http_threads);
  o.max_connections_per_client = absl::GetFlag(FLAGS_http_max_connections_per_client);
  return o;
}

RouterOptions RouterOptionsFromFlags() {
  RouterOptions o;
  o.heartbeat_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  o.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  o.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  o.tenant_max_inflight = absl::GetFlag(FLAGS_tenant_max_inflight);
  o.expose_worker_id = absl::GetFlag(FLAGS_expose_worker_id);
  o.max_resumes = absl::GetFlag(FLAGS_max_resumes);
  o.max_workers = absl::GetFlag(FLAGS_max_workers);
  return o;
}

absl::StatusOr<ApiAuth> ApiAuthFromFlags() {
  absl::StatusOr<std::vector<ApiKey>> keys = LoadApiKeys(absl::GetFlag(FLAGS_api_keys_file));
  if (!keys.ok()) return keys.status();
  // The operator key file has the cluster secret's format and checks.
  absl::StatusOr<std::string> op = LoadClusterSecret(absl::GetFlag(FLAGS_operator_key_file));
  if (!op.ok()) return absl::InvalidArgumentError(absl::StrCat("--operator_key_file: ", op.status().message()));
  return ApiAuth(*std::move(keys), *std::move(op));
}

}  // namespace dd::router
