// Pool state machine with injected time: leases, quotas, eviction, isolation, prefixes.
#include "kv-pool/server/pool.h"

#include <sys/stat.h>

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"

namespace dd::kvpool {
namespace {

using std::chrono::milliseconds;

const KvLayout kLayout{.n_layers = 2, .n_kv_heads = 2, .head_dim = 64, .chunk_tokens = 8};
constexpr int64_t kChunkBytes = 2 * 2 * 2 * 8 * 64 * 4;  // layers × heads × block bytes = 16 KiB

std::unique_ptr<Pool> MakePool(int64_t quota = 4 << 20) {
  std::vector<TenantConfig> t = {{"alice", "alice-token-0123456789", quota}, {"bob", "bob-token-0123456789ab", quota}};
  auto p = Pool::Create(t, PoolOptions{.lease_ttl = milliseconds(1000), .region = {}, .shm_prefix = "dd-kvpool-test"});
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

TEST(PoolTest, AuthenticatesByBearerToken) {
  auto pool = MakePool();
  EXPECT_EQ(*pool->Authenticate("Bearer bob-token-0123456789ab"), 1);
  EXPECT_EQ(pool->Authenticate("Bearer nope").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(pool->Authenticate("alice-token-0123456789").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(pool->shm_name(0), pool->shm_name(1));
}

TEST(PoolTest, LeaseExpiryFreesUncommittedMemory) {
  auto pool = MakePool();
  const auto t0 = Pool::Clock::now();
  auto a = pool->Open(0, kLayout, 64, t0);
  auto b = pool->Open(0, kLayout, 64, t0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(pool->Stats(0).used_bytes, 2 * 64 * kChunkBytes);
  ASSERT_TRUE(pool->Renew(0, {b->first}, t0 + milliseconds(900)).ok());
  EXPECT_EQ(pool->ExpireLeases(t0 + milliseconds(999)), 0);
  EXPECT_EQ(pool->ExpireLeases(t0 + milliseconds(1000)), 1);  // a expired, b was renewed
  EXPECT_EQ(pool->Stats(0).used_bytes, 64 * kChunkBytes);
  EXPECT_EQ(pool->Renew(0, {a->first}, t0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool->Stats(0).expired_leases, 1);
}

TEST(PoolTest, QuotaExhaustedAndEvictionSparesLeasedData) {
  auto pool = MakePool(1 << 20);  // 1 MiB = 64 chunks of 16 KiB
  const auto now = Pool::Clock::now();
  auto leased = pool->Open(0, kLayout, 32, now);
  auto committed = pool->Open(0, kLayout, 32, now);
  ASSERT_TRUE(leased.ok() && committed.ok());
  auto full = pool->Open(0, kLayout, 1, now);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_NE(full.status().message().find("quota"), std::string::npos);
  // Bob's region is separate: his quota is untouched.
  EXPECT_TRUE(pool->Open(1, kLayout, 32, now).ok());
  // Committed and released: evictable. The leased one never is.
  const uint64_t keys[] = {11, 22};
  ASSERT_TRUE(pool->Commit(0, committed->first, keys).ok());
  ASSERT_TRUE(pool->Release(0, committed->first).ok());
  EXPECT_EQ(pool->Lookup(0, keys).blocks, 2);
  auto again = pool->Open(0, kLayout, 16, now);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(pool->Stats(0).evictions, 1);
  EXPECT_EQ(pool->Lookup(0, keys).blocks, 0);  // evicted with its keys
  EXPECT_TRUE(pool->Renew(0, {leased->first}, now).ok());
  EXPECT_EQ(pool->Open(0, kLayout, 32, now).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PoolTest, TenantsCannotTouchEachOthersSequences) {
  auto pool = MakePool();
  auto a = pool->Open(0, kLayout, 8, Pool::Clock::now());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool->Extend(1, a->first, 8).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool->Release(1, a->first).code(), absl::StatusCode::kNotFound);
  const uint64_t keys[] = {7};
  ASSERT_TRUE(pool->Commit(0, a->first, keys).ok());
  EXPECT_EQ(pool->Lookup(1, keys).blocks, 0);
  EXPECT_EQ(pool->Lookup(0, keys).blocks, 1);
}

TEST(PoolTest, LongestPrefixFollowsTheChain) {
  auto pool = MakePool();
  auto a = pool->Open(0, kLayout, 8, Pool::Clock::now());
  ASSERT_TRUE(a.ok());
  const uint64_t stored[] = {1, 2, 3};
  ASSERT_TRUE(pool->Commit(0, a->first, stored).ok());
  const uint64_t longer[] = {1, 2, 3, 4}, diverged[] = {1, 9, 3}, shifted[] = {2, 3};
  EXPECT_EQ(pool->Lookup(0, longer).blocks, 3);
  EXPECT_EQ(pool->Lookup(0, diverged).blocks, 1);
  EXPECT_EQ(pool->Lookup(0, shifted).blocks, 0);  // key 2 is block 2, not block 1
  EXPECT_EQ(pool->Lookup(0, longer).extents.size(), 1u);
}

TEST(PoolTest, BadInputIsInvalidArgument) {
  auto pool = MakePool();
  const auto now = Pool::Clock::now();
  EXPECT_EQ(pool->Open(0, KvLayout{.n_layers = 0}, 8, now).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Open(0, kLayout, 0, now).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool->Open(0, kLayout, -5, now).status().code(), absl::StatusCode::kInvalidArgument);
  auto a = pool->Open(0, kLayout, 8, now);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool->Extend(0, a->first, int64_t{1} << 40).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PoolTest, TenantConfigErrorsNameTheEntry) {
  const std::string path = ::testing::TempDir() + "/tenants.json";
  std::ofstream(path) << R"([{"name": "a", "token": "0123456789abcdef", "quota": "1GiB"}])";
  // The file holds every tenant's token: refused while group or others may read it.
  chmod(path.c_str(), 0644);
  auto open = LoadTenantConfig(path);
  EXPECT_NE(open.status().message().find("accessible to group or others (chmod 600 it)"), std::string::npos)
      << open.status();
  chmod(path.c_str(), 0600);
  EXPECT_TRUE(LoadTenantConfig(path).ok());
  std::ofstream(path) << R"([{"name": "a", "token": "short", "quota": "1GiB"}])";
  auto r = LoadTenantConfig(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tenant 0"), std::string::npos) << r.status();
  std::ofstream(path) << R"([{"name": "a", "token": "0123456789abcdef", "quota": "lots"}])";
  EXPECT_FALSE(LoadTenantConfig(path).ok());
  std::ofstream(path) << R"([{"name": "a", "token": "0123456789abcdef", "quota": "2XiB"}])";
  r = LoadTenantConfig(path);
  EXPECT_NE(r.status().message().find("unknown unit 'xib'"), std::string::npos) << r.status();
  std::ofstream(path) << "not json";
  r = LoadTenantConfig(path);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("not valid JSON (byte"), std::string::npos) << r.status();
  std::ofstream(path) << R"([{"name": "a", "token": "0123456789abcdef", "quota": "2MiB"}])";
  auto ok = LoadTenantConfig(path);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].quota_bytes, 2 << 20);
}

// Bounded metadata (docs/decisions/0018-pool-leases-quotas-eviction.md): one tenant's requests
// cannot overflow the byte counts, grow the pool's metadata past its quota, or flush its own cache
// with a request that can never fit.
TEST(PoolTest, HugeLayoutIsRefusedWithoutOverflowOrEviction) {
  auto pool = MakePool(1 << 20);
  const auto now = Pool::Clock::now();
  auto committed = pool->Open(0, kLayout, 8, now);
  ASSERT_TRUE(committed.ok());
  const uint64_t keys[] = {5};
  ASSERT_TRUE(pool->Commit(0, committed->first, keys).ok());
  ASSERT_TRUE(pool->Release(0, committed->first).ok());
  // chunks × chunk bytes = 2^32 × 2^55: overflows int64 unless checked.
  const KvLayout huge{.n_layers = 4096, .n_kv_heads = 4096, .head_dim = 65536, .chunk_tokens = 4096};
  for (int64_t chunks : {int64_t{1}, int64_t{1} << 32}) {
    auto r = pool->Open(0, huge, chunks, now);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    EXPECT_NE(r.status().message().find("can never fit"), std::string::npos) << r.status();
  }
  auto big = pool->Open(0, kLayout, 65, now);  // 65 chunks of 16 KiB > 1 MiB
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  const PoolStats st = pool->Stats(0);
  EXPECT_EQ(st.evictions, 0);  // the cached prefix survived every refusal
  EXPECT_GE(st.leased_bytes, 0);
  EXPECT_EQ(pool->Lookup(0, keys).blocks, 1);
}

TEST(PoolTest, PrefixKeysAreBounded) {
  auto pool = MakePool(1 << 20);  // key cap: max(1024, 1 MiB / 4 KiB) = 1024
  ASSERT_EQ(Pool::KeyCap(1 << 20), 1024);
  const auto now = Pool::Clock::now();
  // 8-byte chunks: a junk layout that could otherwise commit 131072 keys into 1 MiB.
  const KvLayout tiny{.n_layers = 1, .n_kv_heads = 1, .head_dim = 1, .chunk_tokens = 1};
  auto a = pool->Open(0, tiny, 2000, now);
  ASSERT_TRUE(a.ok()) << a.status();
  std::vector<uint64_t> keys(2001);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = 1000 + i;
  auto r = pool->Commit(0, a->first, keys);  // more keys than chunks
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument) << r;
  keys.resize(1025);
  r = pool->Commit(0, a->first, keys);  // over the cap, nothing evictable
  EXPECT_EQ(r.code(), absl::StatusCode::kResourceExhausted) << r;
  EXPECT_NE(r.message().find("cap of 1024"), std::string::npos) << r;
  keys.resize(1024);
  ASSERT_TRUE(pool->Commit(0, a->first, keys).ok());
  ASSERT_TRUE(pool->Release(0, a->first).ok());  // committed: cached, evictable
  // Another sequence's keys make room by evicting the oldest cached one, keys and all.
  auto b = pool->Open(0, tiny, 2000, now);
  ASSERT_TRUE(b.ok());
  std::vector<uint64_t> other(10);
  for (size_t i = 0; i < other.size(); ++i) other[i] = 900000 + i;
  ASSERT_TRUE(pool->Commit(0, b->first, other).ok());
  EXPECT_EQ(pool->Stats(0).evictions, 1);
  EXPECT_EQ(pool->Lookup(0, keys).blocks, 0);
  EXPECT_EQ(pool->Lookup(0, other).blocks, 10);
  EXPECT_EQ(pool->Stats(0).sequences, 1);
}

TEST(PoolTest, SequenceIdsArePerTenantAndUnguessable) {
  auto pool = MakePool();
  const auto now = Pool::Clock::now();
  auto a1 = pool->Open(0, kLayout, 1, now), b = pool->Open(1, kLayout, 1, now), a2 = pool->Open(0, kLayout, 1, now);
  ASSERT_TRUE(a1.ok() && b.ok() && a2.ok());
  // Not a shared counter: alice's next id does not reveal that bob opened one in between.
  EXPECT_NE(a2->first, a1->first + 2);
  EXPECT_NE(a2->first, a1->first + 1);
  EXPECT_GT(a1->first, uint64_t{1} << 20);  // drawn from 53 bits; a small id has odds 2^-33
}

TEST(PoolTest, ImpossibleSettingsAreRefusedAtStart) {
  std::vector<TenantConfig> t = {{"alice", "alice-token-0123456789", 1 << 20}};
  auto tiny_ttl = Pool::Create(t, PoolOptions{.lease_ttl = milliseconds(3), .region = {}, .shm_prefix = "dd-kvpool-test"});
  EXPECT_EQ(tiny_ttl.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tiny_ttl.status().message().find("lease TTL"), std::string::npos) << tiny_ttl.status();
  t[0].quota_bytes = int64_t{1} << 62;  // 4 EiB: more than any host has
  auto huge = Pool::Create(t, PoolOptions{.lease_ttl = milliseconds(1000), .region = {}, .shm_prefix = "dd-kvpool-test"});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("more than this host's"), std::string::npos) << huge.status();
}

}  // namespace
}  // namespace dd::kvpool
