// The pool's tenants file, the router's API keys file: operator-written JSON, but a typo must
// give an error that names the problem, never a crash.
#include "fuzz/fuzz_util.h"
#include "kv-pool/server/pool.h"
#include "router/api_keys.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dd::fuzz::MemFile f(data, size);
  auto tenants = dd::kvpool::LoadTenantConfig(f.path());
  if (tenants.ok()) {
    for (const auto& t : *tenants) dd::fuzz::Require(t.quota_bytes > 0 && t.token.size() >= 16, "tenant validated");
  }
  (void)dd::router::LoadApiKeys(f.path());  // refuses: a memfd is mode 0777; exercises the check
  return 0;
}
