// Router flags, shared by dd-router and the embedded server (`ddctl serve`).
#pragma once

#include "router/openai_http.h"
#include "router/router_service.h"

namespace dd::router {

RouterOptions RouterOptionsFromFlags();
// --api_keys_file and --operator_key_file, loaded (errors name the file and the problem).
absl::StatusOr<ApiAuth> ApiAuthFromFlags();
// The OpenAI-compatible HTTP endpoint's options (router/openai_http.h): --http_listen (""
// = off), --http_cors_origins, --http_allowed_hosts, --http_max_body_bytes; `auth`, the
// router's keys, checked before a body is read (open when it has none).
absl::StatusOr<HttpOptions> HttpOptionsFromFlags(const ApiAuth& auth);

}  // namespace dd::router
