#include "router/router_flags.h"

#include "absl/flags/flag.h"
#include "proto/request_check.h"

ABSL_FLAG(int64_t, heartbeat_timeout_ms, 3000, "router: a worker silent this long is down (not placed on)");
ABSL_FLAG(int64_t, max_inflight, 256, "router: requests in flight at once; more are refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int32_t, max_resumes, 3, "router: times a request may move to another worker after failures");
ABSL_FLAG(int32_t, max_workers, 256, "router: workers it keeps track of; more registrations are refused");

namespace dd::router {

RouterOptions RouterOptionsFromFlags() {
  RouterOptions o;
  o.heartbeat_timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
  o.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens_limit);
  o.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  o.max_resumes = absl::GetFlag(FLAGS_max_resumes);
  o.max_workers = absl::GetFlag(FLAGS_max_workers);
  return o;
}

}  // namespace dd::router
