// Router flags, shared by dd-router and the embedded server (`ddctl serve`).
#pragma once

#include "router/router_service.h"

namespace dd::router {

RouterOptions RouterOptionsFromFlags();
// --api_keys_file and --operator_key_file, loaded (errors name the file and the problem).
absl::StatusOr<ApiAuth> ApiAuthFromFlags();

}  // namespace dd::router
