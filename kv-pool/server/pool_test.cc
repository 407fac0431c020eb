// Pool state machine with injected time: leases, quotas, eviction, isolation, prefixes.
#include "kv-pool/server/pool.h"

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
  std::ofstream(path) << R"([{"name": "a", "token": "short", "quota": "1GiB"}])";
  auto r = LoadTenantConfig(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tenant 0"), std::string::npos) << r.status();
  std::ofstream(path) << R"([{"name": "a", "token": "0123456789abcdef", "quota": "lots"}])";
  EXPECT_FALSE(LoadTenantConfig(path).ok());
  std::ofstream(path) << "not json";
  EXPECT_EQ(LoadTenantConfig(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(path) << R"([{"name": "a", "token": "0123456789abcdef", "quota": "2MiB"}])";
  auto ok = LoadTenantConfig(path);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0].quota_bytes, 2 << 20);
}

}  // namespace
}  // namespace dd::kvpool
