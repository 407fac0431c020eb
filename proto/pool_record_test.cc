#include "proto/pool_record.h"

#include <chrono>
#include <map>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace dd {
namespace {

constexpr double kNow = 1.8e9;
const std::string kSecret = "0123456789abcdef0123456789abcdef";

PoolRecord Record(const std::string& id, const std::string& node, double published = kNow) {
  PoolRecord r;
  r.pool_id = id;
  r.address = "10.0.0." + std::to_string(id.size()) + ":50052";
  r.node = node;
  r.ucx = true;
  r.capacity_bytes = 1 << 30;
  r.published_unix_seconds = published;
  return r;
}

RegistryRecord Signed(const std::string& key, const std::string& json, int64_t lease = 7) {
  return {SignRecord(kSecret, key, json), lease};
}

TEST(PoolRecord, RoundTripsSigned) {
  const std::string key = "/dualdecoder/pools/p1";
  const PoolRecord in = Record("p1", "node-a");
  absl::StatusOr<PoolRecord> out = ParsePoolRecord(kSecret, key, Signed(key, PoolRecordJson(in)), kNow + 1);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->pool_id, "p1");
  EXPECT_EQ(out->address, in.address);
  EXPECT_EQ(out->node, "node-a");
  EXPECT_TRUE(out->ucx);
  EXPECT_EQ(out->capacity_bytes, in.capacity_bytes);
}

TEST(PoolRecord, RefusesForgedCopiedStaleAndMalformedRecords) {
  const std::string key = "/dualdecoder/pools/p1";
  const std::string json = PoolRecordJson(Record("p1", "node-a"));
  auto refused = [&](const std::string& k, const RegistryRecord& v, double now = kNow) {
    return !ParsePoolRecord(kSecret, k, v, now).ok();
  };
  EXPECT_TRUE(refused(key, {json, 7})) << "unsigned";
  EXPECT_TRUE(refused(key, {SignRecord("another secret of enough length!", key, json), 7})) << "another secret";
  EXPECT_TRUE(refused("/dualdecoder/pools/p2", Signed(key, json))) << "copied to another key";
  const std::string p2 = "/dualdecoder/pools/p2";
  EXPECT_TRUE(refused(p2, Signed(p2, json))) << "signed for the key but naming another id";
  EXPECT_TRUE(refused(key, Signed(key, json), kNow + 3600)) << "replayed an hour later";
  EXPECT_TRUE(refused(key, Signed(key, json, /*lease=*/0))) << "held under no lease";
  EXPECT_TRUE(refused(key, Signed(key, "[1, 2]"))) << "not an object";
  EXPECT_TRUE(refused(key, Signed(key, "{\"pool_id\": \"p1\", \"node\": \"n\"}"))) << "no address";
  EXPECT_TRUE(refused(key, Signed(key, "{\"pool_id\": \"p1\", \"node\": \"n\", \"address\": 5}"))) << "address not a string";
  PoolRecord big = Record("p1", std::string(300, 'n'));
  EXPECT_TRUE(refused(key, Signed(key, PoolRecordJson(big)))) << "node of 300 bytes";
  PoolRecord negative = Record("p1", "n");
  negative.capacity_bytes = -1;
  EXPECT_TRUE(refused(key, Signed(key, PoolRecordJson(negative)))) << "negative capacity";
  EXPECT_TRUE(refused(key, Signed(key, std::string(5000, ' ')))) << "over 4 KiB";
  // Without a cluster secret an unsigned record is read (a development cluster).
  EXPECT_TRUE(ParsePoolRecord("", key, {json, 7}, kNow + 3600).ok());
}

TEST(PoolRecord, PicksThePoolOnTheNodeTheNewestFirst) {
  std::map<std::string, PoolRecord> pools;
  pools["/p/pools/old"] = Record("old", "node-a", kNow - 5);
  pools["/p/pools/new"] = Record("new", "node-a", kNow);
  pools["/p/pools/big"] = Record("big", "node-b");
  pools["/p/pools/big"].capacity_bytes = int64_t{1} << 40;
  absl::StatusOr<PoolRecord> shm = PickPool(pools, "node-a", PoolReach::kShm);
  ASSERT_TRUE(shm.ok());
  EXPECT_EQ(shm->pool_id, "new") << "a replaced pool's key outlives it: the newest record is the live one";
  EXPECT_EQ(PickPool(pools, "node-a", PoolReach::kUcx)->pool_id, "new") << "ucx prefers the node's own pool";
  EXPECT_EQ(PickPool(pools, "node-c", PoolReach::kUcx)->pool_id, "big") << "else the largest";
  absl::StatusOr<PoolRecord> none = PickPool(pools, "node-c", PoolReach::kShm);
  EXPECT_TRUE(absl::IsNotFound(none.status()));
  EXPECT_NE(none.status().message().find("node-c"), std::string::npos) << none.status();
  pools["/p/pools/big"].ucx = false;
  pools["/p/pools/new"].ucx = pools["/p/pools/old"].ucx = false;
  EXPECT_TRUE(absl::IsNotFound(PickPool(pools, "node-a", PoolReach::kUcx).status())) << "no pool serves ucx://";
  EXPECT_EQ(PickPool(pools, "node-a", PoolReach::kShm)->pool_id, "new") << "shm needs no ucx";
}

// A registry held in this process: Follow hands the handler to the test, which plays etcd.
class HandRegistry : public ClusterRegistry {
 public:
  std::unique_ptr<RegistryMembership> Join(std::string, std::function<std::string()>,
                                           std::function<bool(const std::string&)>, std::chrono::milliseconds,
                                           int64_t) override {
    return std::make_unique<RegistryMembership>();
  }
  std::unique_ptr<RegistryFollower> Follow(std::string prefix, RegistryFollower::Handler handler) override {
    EXPECT_EQ(prefix, "/dd/pools/");
    handler_ = std::move(handler);
    struct None : RegistryFollower {
      int64_t resyncs() const override { return 0; }
    };
    return std::make_unique<None>();
  }
  RegistryFollower::Handler handler_;
};

TEST(PoolLocator, FollowsRecordsWaitsAndSaysWhyNoneFits) {
  auto hand = std::make_shared<HandRegistry>();
  RegistryConfig config{.url = "hand", .prefix = "/dd/", .backend = hand};
  PoolLocator locator(config, kSecret, "node-a", PoolReach::kShm);
  const auto now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string k1 = "/dd/pools/p1", k2 = "/dd/pools/p2";
  // A listing with one record signed with another secret: nothing fits, and the refusal is named.
  hand->handler_.reset({{k1, {SignRecord("another secret of enough length!", k1, PoolRecordJson(Record("p1", "node-a", now))), 7}}});
  absl::StatusOr<std::string> none = locator.Locate();
  ASSERT_TRUE(absl::IsNotFound(none.status()));
  EXPECT_NE(none.status().message().find("1 records refused"), std::string::npos) << none.status();
  EXPECT_NE(none.status().message().find("not signed with this cluster's secret"), std::string::npos) << none.status();
  // Wait returns once a valid record arrives, from another thread as the follower's (before or
  // during the wait: the answer is the same).
  PoolRecord p2 = Record("p2", "node-a", now);
  std::thread writer([&] { hand->handler_.put(k2, Signed(k2, PoolRecordJson(p2))); });
  absl::StatusOr<std::string> at = locator.Wait(std::chrono::seconds(30), [](int64_t) {});
  writer.join();
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(*at, "shm://" + p2.address);
  // Its key erased: gone again.
  hand->handler_.erase(k2);
  EXPECT_FALSE(locator.Locate().ok());
  EXPECT_TRUE(absl::IsNotFound(locator.Wait(std::chrono::milliseconds(10), [](int64_t) {}).status()));
}

TEST(PoolRecord, ParsesRegistryStoreUris) {
  EXPECT_EQ(*ParseRegistryKvStore("registry://shm"), PoolReach::kShm);
  EXPECT_EQ(*ParseRegistryKvStore("registry://ucx"), PoolReach::kUcx);
  EXPECT_FALSE(ParseRegistryKvStore("registry://tcp").ok());
  EXPECT_TRUE(IsRegistryKvStore("registry://x"));
  EXPECT_FALSE(IsRegistryKvStore("shm://h:1"));
}

}  // namespace
}  // namespace dd
