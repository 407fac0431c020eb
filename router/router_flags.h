// Router flags, shared by dd-router and the embedded server (`ddctl serve`).
#pragma once

#include "router/router_service.h"

namespace dd::router {

RouterOptions RouterOptionsFromFlags();

}  // namespace dd::router
