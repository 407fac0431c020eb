// Validation of a public GenerateRequest, shared by the router and the decode worker: a worker
// reachable without the router (ddctl serve's internal port, a misrouted call) refuses exactly
// what the router refuses. INVALID_ARGUMENT names the field.
#pragma once

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "proto/generate.pb.h"

// --max_new_tokens_limit: the largest max_new_tokens a request may ask for (router and worker).
ABSL_DECLARE_FLAG(int64_t, max_new_tokens_limit);

namespace dd {

absl::Status ValidateGenerateRequest(const dd::v1::GenerateRequest& req, int64_t max_new_tokens_limit);
// At most 128 bytes of printable ASCII ("" passes).
absl::Status ValidateRequestId(const std::string& id);

}  // namespace dd
