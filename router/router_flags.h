// Router flags, shared by dd-router and the embedded server (`ddctl serve`).
#pragma once

#include "router/openai_http.h"
#include "router/router_service.h"

namespace dd::router {

RouterOptions RouterOptionsFromFlags();
// --api_keys_file and --operator_key_file, loaded (errors name the file and the problem).
absl::StatusOr<ApiAuth> ApiAuthFromFlags();
// The OpenAI-compatible HTTP endpoint's options (router/openai_http.h): --http_listen (""
// = off), --http_cors_origins, --http_allowed_hosts; `open_api` when the router has no API keys.
HttpOptions HttpOptionsFromFlags(bool open_api);

}  // namespace dd::router
