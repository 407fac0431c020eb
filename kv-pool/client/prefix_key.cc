#include "kv-pool/client/prefix_key.h"

namespace dd::kvpool {
namespace {

constexpr uint64_t kMul = 0x9E3779B97F4A7C15ULL;  // 2^64 / golden ratio

// The 64-bit finalizer of MurmurHash3: every input bit affects every output bit.
uint64_t Finalize(uint64_t h) {
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDULL;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ULL;
  h ^= h >> 33;
  return h;
}

uint64_t Step(uint64_t h, uint64_t word) {
  h ^= Finalize(word + kMul);
  return (h << 27 | h >> 37) * kMul + 0x52DCE729ULL;
}

}  // namespace

uint64_t HashWords(uint64_t seed, absl::Span<const uint64_t> words) {
  uint64_t h = Finalize(seed ^ kMul);
  for (uint64_t w : words) h = Step(h, w);
  return Finalize(h ^ words.size());
}

std::vector<uint64_t> PrefixKeys(const PrefixNamespace& ns, absl::Span<const int32_t> tokens) {
  std::vector<uint64_t> header = {0x64642D70726566ULL /* "dd-pref" */, ns.model_fingerprint,
                                  static_cast<uint64_t>(ns.layout.n_layers), static_cast<uint64_t>(ns.layout.n_kv_heads),
                                  static_cast<uint64_t>(ns.layout.head_dim), static_cast<uint64_t>(ns.layout.chunk_tokens),
                                  static_cast<uint64_t>(ns.block_tokens), ns.tenant_salt};
  // The layout's KV type joins the header only when it is not f32, so f32 keys stay what they
  // were: a prefix stored in one type is never restored into another.
  if (ns.layout.dtype != KvDtype::kF32) {
    header.push_back(0x6B7679706500ULL /* "kvype" */ + static_cast<uint64_t>(ns.layout.dtype));
  }
  uint64_t prev = HashWords(0, header);
  std::vector<uint64_t> keys;
  std::vector<uint64_t> words;
  const int64_t B = ns.block_tokens;
  for (int64_t b = 0; B > 0 && (b + 1) * B <= static_cast<int64_t>(tokens.size()); ++b) {
    words.assign(1, prev);
    for (int64_t i = b * B; i < (b + 1) * B; ++i) words.push_back(static_cast<uint32_t>(tokens[i]));
    prev = HashWords(1, words);
    keys.push_back(prev);
  }
  return keys;
}

uint64_t TenantSalt(absl::string_view tenant) {
  if (tenant.empty()) return 0;
  std::vector<uint64_t> words;
  words.reserve(tenant.size() + 1);
  words.push_back(0x74656E616E74ULL);  // "tenant"
  for (unsigned char c : tenant) words.push_back(c);
  const uint64_t salt = HashWords(2, words);
  return salt != 0 ? salt : 1;
}

}  // namespace dd::kvpool
