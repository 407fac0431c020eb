// Prefix-reuse keys (docs/architecture.md, "Prefix reuse"; the format is in docs/prefix-keys.md so
// routers, workers and pools agree): a chained 64-bit hash over fixed-size token blocks, namespaced
// by the model's fingerprint, the KV layout, the block size and a tenant salt. Key i stands for the
// whole prefix tokens[0, (i + 1) × block_tokens).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kv-pool/client/kv_store.h"

namespace dd::kvpool {

struct PrefixNamespace {
  uint64_t model_fingerprint = 0;
  KvLayout layout;
  int64_t block_tokens = 256;
  uint64_t tenant_salt = 0;
};

// The salt of an API tenant's keys (docs/prefix-keys.md): 0 for none (an open API), else a
// non-zero hash of the name, the same in every process, so one tenant's prompts never match
// another's stored prefixes.
uint64_t TenantSalt(absl::string_view tenant);

// One key per full block of `tokens` (a trailing partial block gets none).
std::vector<uint64_t> PrefixKeys(const PrefixNamespace& ns, absl::Span<const int32_t> tokens);

// The 64-bit mix the keys are built from (exposed for fingerprints and tests).
uint64_t HashWords(uint64_t seed, absl::Span<const uint64_t> words);

}  // namespace dd::kvpool
