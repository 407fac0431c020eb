// The KV pool's state (docs/architecture.md, "KV store and pool"): tenants, each with its own
// shared-memory region and quota; sequences stored as extents of [K | V] blocks in their tenant's
// region; leases with a TTL renewed by the worker; committed prefixes for reuse; LRU eviction of
// unleased committed data only. Time is passed in, so lease expiry is tested without sleeping.
// Thread-safe.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv-pool/client/kv_store.h"
#include "kv-pool/server/region.h"

namespace dd::kvpool {

struct TenantConfig {
  std::string name;
  std::string token;         // bearer token
  int64_t quota_bytes = 0;   // size of the tenant's region
};

// Reads `[{"name": ..., "token": ..., "quota": "4GiB"}, ...]`; errors name the file and entry.
absl::StatusOr<std::vector<TenantConfig>> LoadTenantConfig(const std::string& path);

inline constexpr std::chrono::milliseconds kMinLeaseTtl{100};
inline constexpr std::chrono::milliseconds kMaxLeaseTtl{24 * 3600 * 1000};

struct PoolOptions {
  std::chrono::milliseconds lease_ttl{30000};
  ShmRegion::Options region;
  std::string shm_prefix = "dd-kvpool";
};

struct Extent {
  int64_t first_chunk = 0, chunks = 0, offset = 0;
};

struct PoolStats {
  int64_t region_bytes = 0, used_bytes = 0, leased_bytes = 0, sequences = 0;
  int64_t evictions = 0, expired_leases = 0, prefix_hits = 0;
};

class Pool {
 public:
  using Clock = std::chrono::steady_clock;
  static absl::StatusOr<std::unique_ptr<Pool>> Create(std::vector<TenantConfig> tenants, const PoolOptions& options);

  // The tenant whose token is `bearer` ("Bearer <token>"); Unauthenticated otherwise.
  absl::StatusOr<int> Authenticate(absl::string_view bearer) const;
  int tenants() const { return static_cast<int>(tenants_.size()); }
  const std::string& tenant_name(int t) const { return tenants_[t]->config.name; }
  const std::string& shm_name(int t) const { return tenants_[t]->region.name(); }
  int64_t region_bytes(int t) const { return tenants_[t]->region.size(); }  // mapped size (>= quota)
  uint8_t* region_data(int t) const { return tenants_[t]->region.data(); }
  int region_fd(int t) const { return tenants_[t]->region.fd(); }
  std::chrono::milliseconds lease_ttl() const { return options_.lease_ttl; }
  // Committed prefix keys a tenant may hold: one per 4 KiB of quota, at least 1024. Real
  // chunks are far larger (SmolLM2: 360 KiB), so the cap only binds on junk; it keeps the
  // pool's metadata under ~3% of the quota whatever the layout.
  static int64_t KeyCap(int64_t quota) { return std::max<int64_t>(1024, quota / 4096); }

  absl::StatusOr<std::pair<SequenceId, Extent>> Open(int t, const KvLayout& layout, int64_t chunks, Clock::time_point now);
  absl::StatusOr<Extent> Extend(int t, SequenceId seq, int64_t chunks);
  absl::Status Commit(int t, SequenceId seq, absl::Span<const uint64_t> keys);
  struct Prefix {
    int64_t blocks = 0;
    SequenceId seq = 0;
    KvLayout layout;
    std::vector<Extent> extents;
  };
  // With `lease`, a match takes a lease on the sequence (released with Release, renewed with
  // Renew, like the owner's); several holders may lease one sequence.
  Prefix Lookup(int t, absl::Span<const uint64_t> keys, bool lease = false, Clock::time_point now = {});
  absl::Status Renew(int t, absl::Span<const SequenceId> seqs, Clock::time_point now);
  absl::Status Release(int t, SequenceId seq);
  // Drops leases that ran out; uncommitted sequences are freed. Returns how many expired.
  int64_t ExpireLeases(Clock::time_point now);
  PoolStats Stats(int t) const;
  // Removes every tenant region's name (for a fast exit that skips destructors).

 private:
  struct Seq {
    KvLayout layout;
    std::vector<Extent> extents;
    int64_t bytes = 0;
    int leases = 1;             // holders; 0 = unleased (evictable if committed, else freed)
    Clock::time_point expires;
    std::vector<uint64_t> keys;  // committed prefix keys
    std::list<SequenceId>::iterator lru;  // valid when leases == 0 && committed
    int64_t chunks = 0;          // allocated, over all extents
  };
  struct Tenant {
    TenantConfig config;
    ShmRegion region;
    RangeAllocator alloc;
    std::unordered_map<SequenceId, Seq> seqs;
    std::unordered_map<uint64_t, std::pair<SequenceId, int64_t>> prefix;  // key → (seq, blocks)
    std::list<SequenceId> lru;  // unleased committed sequences, oldest first
    PoolStats stats;
  };
  explicit Pool(const PoolOptions& options) : options_(options) {}
  absl::StatusOr<Seq*> Find(Tenant& tn, SequenceId seq);
  absl::StatusOr<Extent> AllocateExtent(Tenant& tn, Seq& s, int64_t chunks);
  void Free(Tenant& tn, SequenceId seq);
  void Unlease(Tenant& tn, SequenceId seq, Seq& s);

  PoolOptions options_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Tenant>> tenants_;
};

}  // namespace dd::kvpool
