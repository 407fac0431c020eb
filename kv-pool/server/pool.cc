#include "kv-pool/server/pool.h"

#include <algorithm>

#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/byte_size.h"
#include "common/json_file.h"
#include "common/secrets.h"
#include "common/random.h"
#include "nlohmann/json.hpp"

namespace dd::kvpool {
namespace {

int64_t BlockBytes(const KvLayout& l) { return l.block_bytes(); }
int64_t ChunkBytes(const KvLayout& l) { return l.n_layers * l.n_kv_heads * BlockBytes(l); }

int64_t HostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

}  // namespace

absl::StatusOr<std::vector<TenantConfig>> LoadTenantConfig(const std::string& path) {
  // It holds every tenant's bearer token: refused when others could read it.
  if (absl::Status s = CheckPrivateFile(path, "tenant config", 1 << 20); !s.ok()) return s;
  absl::StatusOr<nlohmann::json> parsed = ReadJsonFile(path, "tenant config");
  if (!parsed.ok()) return parsed.status();
  const nlohmann::json& j = *parsed;
  if (!j.is_array() || j.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a non-empty JSON array of tenants"));
  }
  std::vector<TenantConfig> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const nlohmann::json& e = j[i];
    const std::string where = absl::StrCat(path, ": tenant ", i);
    if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("token") ||
        !e["token"].is_string() || !e.contains("quota") || !e["quota"].is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": needs string fields name, token and quota"));
    }
    TenantConfig t{e["name"].get<std::string>(), e["token"].get<std::string>(), 0};
    if (t.name.empty() || t.token.size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": name must be non-empty and token at least 16 characters"));
    }
    auto q = ParseByteSize(e["quota"].get<std::string>(), "quota");
    if (!q.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", q.status().message()));
    if (*q <= 0) return absl::InvalidArgumentError(absl::StrCat(where, ": quota must be a positive size such as 4GiB"));
    t.quota_bytes = *q;
    for (const TenantConfig& o : out) {
      if (o.name == t.name || o.token == t.token) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate name or token"));
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Pool>> Pool::Create(std::vector<TenantConfig> tenants, const PoolOptions& options) {
  if (options.lease_ttl < kMinLeaseTtl || options.lease_ttl > kMaxLeaseTtl) {
    // The reaper wakes at a quarter of the TTL: a tiny TTL would spin a core.
    return absl::InvalidArgumentError(absl::StrCat("lease TTL must be in [", kMinLeaseTtl.count(), ", ",
                                                   kMaxLeaseTtl.count(), "] ms, got ", options.lease_ttl.count()));
  }
  // Regions are sized by the quotas: quotas the host cannot hold are refused at start, not
  // discovered when a tenant's writes fault.
  int64_t total = 0;
  for (const TenantConfig& t : tenants) {
    if (t.quota_bytes <= 0 || __builtin_add_overflow(total, t.quota_bytes, &total)) {
      return absl::InvalidArgumentError(absl::StrCat("tenant ", t.name, ": quota must be positive and the total fit in 63 bits"));
    }
  }
  const int64_t host = HostMemoryBytes();
  if (host > 0 && total > host) {
    return absl::InvalidArgumentError(absl::StrCat("tenant quotas total ", MiB(total), ", more than this host's ",
                                                   MiB(host), " of memory"));
  }
  std::unique_ptr<Pool> pool(new Pool(options));
  for (TenantConfig& t : tenants) {
    auto region = ShmRegion::Create(options.shm_prefix, t.quota_bytes, options.region);
    if (!region.ok()) return absl::Status(region.status().code(), absl::StrCat("tenant ", t.name, ": ", region.status().message()));
    const int64_t size = t.quota_bytes;  // the region is rounded up to 2 MiB; the quota is exact
    pool->tenants_.push_back(std::unique_ptr<Tenant>(new Tenant{std::move(t), std::move(*region), RangeAllocator(size), {}, {}, {}, {}}));
  }
  return pool;
}

absl::StatusOr<int> Pool::Authenticate(absl::string_view bearer) const {
  if (!absl::StartsWith(bearer, "Bearer ")) {
    return absl::UnauthenticatedError("missing bearer token (metadata 'authorization: Bearer <token>')");
  }
  const absl::string_view token = bearer.substr(7);
  // Every token compared in full (constant time per token): no early exit on a match either.
  int found = -1;
  for (size_t i = 0; i < tenants_.size(); ++i) {
    if (SecretEquals(tenants_[i]->config.token, token)) found = static_cast<int>(i);
  }
  if (found >= 0) return found;
  return absl::UnauthenticatedError("unknown bearer token");
}

absl::StatusOr<Pool::Seq*> Pool::Find(Tenant& tn, SequenceId seq) {
  auto it = tn.seqs.find(seq);
  // Another tenant's sequence looks exactly like a missing one.
  if (it == tn.seqs.end()) return absl::NotFoundError(absl::StrCat("no sequence ", seq, " for tenant ", tn.config.name));
  return &it->second;
}

absl::StatusOr<Extent> Pool::AllocateExtent(Tenant& tn, Seq& s, int64_t chunks) {
  int64_t bytes = 0;
  if (__builtin_mul_overflow(chunks, ChunkBytes(s.layout), &bytes) || bytes > tn.alloc.size()) {
    // Refused before anything is evicted: no eviction could make it fit.
    return absl::ResourceExhaustedError(absl::StrCat("tenant ", tn.config.name, ": ", chunks, " chunks of ",
                                                     ChunkBytes(s.layout), " bytes can never fit its quota of ",
                                                     MiB(tn.alloc.size())));
  }
  int64_t off = tn.alloc.Allocate(bytes);
  while (off < 0 && !tn.lru.empty()) {  // evict unleased committed sequences, oldest first
    const SequenceId victim = tn.lru.front();
    Free(tn, victim);
    ++tn.stats.evictions;
    off = tn.alloc.Allocate(bytes);
  }
  if (off < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant ", tn.config.name, " quota of ", MiB(tn.alloc.size()),
                                                     " exhausted: ", MiB(tn.alloc.used()), " in use, ", MiB(bytes),
                                                     " requested, nothing evictable"));
  }
  const int64_t first = s.extents.empty() ? 0 : s.extents.back().first_chunk + s.extents.back().chunks;
  s.extents.push_back({first, chunks, off});
  s.bytes += (bytes + 4095) / 4096 * 4096;
  s.chunks += chunks;
  return s.extents.back();
}

absl::StatusOr<std::pair<SequenceId, Extent>> Pool::Open(int t, const KvLayout& layout, int64_t chunks,
                                                         Clock::time_point now) {
  if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0 || layout.chunk_tokens <= 0 ||
      layout.n_layers > 4096 || layout.n_kv_heads > 4096 || layout.head_dim > 65536 || layout.chunk_tokens > 4096) {
    return absl::InvalidArgumentError("layout: n_layers, n_kv_heads, head_dim and chunk_tokens must be positive and sane");
  }
  if (chunks <= 0 || chunks > (int64_t{1} << 32)) {
    return absl::InvalidArgumentError(absl::StrCat("chunks must be in [1, 2^32], got ", chunks));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Tenant& tn = *tenants_[t];
  // Random, per tenant: an id says nothing about other tenants' activity and cannot be guessed.
  SequenceId id = 0;
  while (id == 0 || tn.seqs.count(id) != 0) id = RandomU64() >> 11;  // 53 bits: exact in JSON too
  Seq& s = tn.seqs[id];
  s.layout = layout;
  s.expires = now + options_.lease_ttl;
  auto e = AllocateExtent(tn, s, chunks);
  if (!e.ok()) {
    tn.seqs.erase(id);
    return e.status();
  }
  return std::make_pair(id, *e);
}

absl::StatusOr<Extent> Pool::Extend(int t, SequenceId seq, int64_t chunks) {
  if (chunks <= 0 || chunks > (int64_t{1} << 32)) {
    return absl::InvalidArgumentError(absl::StrCat("chunks must be in [1, 2^32], got ", chunks));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Tenant& tn = *tenants_[t];
  auto s = Find(tn, seq);
  if (!s.ok()) return s.status();
  if ((*s)->leases == 0) return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " has no lease"));
  return AllocateExtent(tn, **s, chunks);
}

absl::Status Pool::Commit(int t, SequenceId seq, absl::Span<const uint64_t> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  Tenant& tn = *tenants_[t];
  auto s = Find(tn, seq);
  if (!s.ok()) return s.status();
  if ((*s)->leases == 0) return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " has no lease"));
  // Key i stands for the sequence's first i + 1 blocks: there are never more keys than blocks.
  if (static_cast<int64_t>(keys.size()) > (*s)->chunks) {
    return absl::InvalidArgumentError(absl::StrCat(keys.size(), " prefix keys for sequence ", seq, " of ",
                                                   (*s)->chunks, " chunks (at most one key per chunk)"));
  }
  // Keys are metadata the pool holds for the tenant: at most KeyCap(quota) of them, room made
  // by evicting unleased committed sequences (with their keys), oldest first.
  int64_t fresh = 0;
  for (uint64_t k : keys) fresh += tn.prefix.count(k) == 0 ? 1 : 0;
  const int64_t cap = KeyCap(tn.alloc.size());
  while (static_cast<int64_t>(tn.prefix.size()) + fresh > cap && !tn.lru.empty()) {
    Free(tn, tn.lru.front());
    ++tn.stats.evictions;
  }
  if (static_cast<int64_t>(tn.prefix.size()) + fresh > cap) {
    return absl::ResourceExhaustedError(absl::StrCat("tenant ", tn.config.name, " holds ", tn.prefix.size(),
                                                     " prefix keys; ", fresh, " more exceed its cap of ", cap,
                                                     " (one per 4 KiB of quota)"));
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    auto [it, inserted] = tn.prefix.try_emplace(keys[i], seq, static_cast<int64_t>(i + 1));
    if (inserted) (*s)->keys.push_back(keys[i]);
  }
  return absl::OkStatus();
}

Pool::Prefix Pool::Lookup(int t, absl::Span<const uint64_t> keys, bool lease, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  Tenant& tn = *tenants_[t];
  Prefix best;
  for (size_t i = 0; i < keys.size(); ++i) {  // chained keys: key i stands for the whole prefix
    auto it = tn.prefix.find(keys[i]);
    if (it == tn.prefix.end() || it->second.second != static_cast<int64_t>(i + 1)) break;
    best.blocks = static_cast<int64_t>(i + 1);
    best.seq = it->second.first;
  }
  if (best.blocks > 0) {
    Seq& s = tn.seqs.at(best.seq);
    best.layout = s.layout;
    best.extents = s.extents;
    if (lease) {
      if (s.leases == 0) tn.lru.erase(s.lru);
      ++s.leases;
      s.expires = std::max(s.expires, now + options_.lease_ttl);
    } else if (s.leases == 0) {
      tn.lru.splice(tn.lru.end(), tn.lru, s.lru);  // recently used
    }
    ++tn.stats.prefix_hits;
  }
  return best;
}

absl::Status Pool::Renew(int t, absl::Span<const SequenceId> seqs, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  Tenant& tn = *tenants_[t];
  for (SequenceId id : seqs) {
    auto s = Find(tn, id);
    if (!s.ok()) return s.status();
    if ((*s)->leases == 0) return absl::FailedPreconditionError(absl::StrCat("sequence ", id, " lease already expired"));
    (*s)->expires = now + options_.lease_ttl;
  }
  return absl::OkStatus();
}

void Pool::Free(Tenant& tn, SequenceId seq) {
  auto it = tn.seqs.find(seq);
  if (it == tn.seqs.end()) return;
  Seq& s = it->second;
  for (const Extent& e : s.extents) tn.alloc.Free(e.offset);
  for (uint64_t k : s.keys) tn.prefix.erase(k);
  if (s.leases == 0 && !s.keys.empty()) tn.lru.erase(s.lru);
  tn.seqs.erase(it);
}

void Pool::Unlease(Tenant& tn, SequenceId seq, Seq& s) {
  s.leases = 0;
  if (s.keys.empty()) {
    Free(tn, seq);
  } else {
    s.lru = tn.lru.insert(tn.lru.end(), seq);
  }
}

absl::Status Pool::Release(int t, SequenceId seq) {
  std::lock_guard<std::mutex> lock(mu_);
  Tenant& tn = *tenants_[t];
  auto s = Find(tn, seq);
  if (!s.ok()) return s.status();
  if ((*s)->leases == 0) return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " has no lease"));
  if (--(*s)->leases == 0) Unlease(tn, seq, **s);
  return absl::OkStatus();
}

int64_t Pool::ExpireLeases(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (auto& tn : tenants_) {
    std::vector<SequenceId> expired;
    for (auto& [id, s] : tn->seqs) {
      if (s.leases > 0 && s.expires <= now) expired.push_back(id);
    }
    for (SequenceId id : expired) Unlease(*tn, id, tn->seqs.at(id));
    tn->stats.expired_leases += static_cast<int64_t>(expired.size());
    n += static_cast<int64_t>(expired.size());
  }
  return n;
}

PoolStats Pool::Stats(int t) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Tenant& tn = *tenants_[t];
  PoolStats s = tn.stats;
  s.region_bytes = tn.alloc.size();
  s.used_bytes = tn.alloc.used();
  s.sequences = static_cast<int64_t>(tn.seqs.size());
  for (const auto& [id, q] : tn.seqs) s.leased_bytes += q.leases > 0 ? q.bytes : 0;
  return s;
}

}  // namespace dd::kvpool
