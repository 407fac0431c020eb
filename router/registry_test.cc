// Placement and liveness in the router's worker registry (no processes: the registry is
// pure bookkeeping; tests/serve covers it with real workers).
#include "router/registry.h"

#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "router/router_service.h"

namespace dd::router {
namespace {

dd::worker::v1::RegisterRequest Worker(const std::string& id, const std::string& model, int batch, int64_t tokens) {
  dd::worker::v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_address("127.0.0.1:1");
  r.set_model(model);
  r.set_mode("full");
  r.mutable_load()->set_max_batch(batch);
  r.mutable_load()->set_active_tokens(tokens);
  return r;
}

TEST(RegistryTest, AnIdCannotBeTakenOverWhileItsOwnerHeartbeats) {
  WorkerRegistry reg(std::chrono::seconds(10));
  const absl::StatusOr<std::string> owner = reg.Register(Worker("w1", "m", 2, 0));
  ASSERT_TRUE(owner.ok());
  dd::worker::v1::RegisterRequest thief = Worker("w1", "m", 2, 0);
  thief.set_address("10.9.9.9:6666");
  const absl::StatusOr<std::string> taken = reg.Register(thief);
  ASSERT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists) << taken.status();
  EXPECT_NE(taken.status().message().find("127.0.0.1:1"), std::string::npos) << taken.status();
  const std::vector<dd::v1::WorkerInfo> known = reg.Snapshot();
  ASSERT_EQ(known.size(), 1u);
  EXPECT_EQ(known[0].address(), "127.0.0.1:1");  // requests still go to the owner
  // The owner's heartbeats name its registration; a guessed lease is refused.
  dd::worker::v1::HeartbeatRequest hb;
  hb.set_worker_id("w1");
  hb.set_lease("not-the-lease");
  EXPECT_FALSE(reg.Heartbeat(hb));
  hb.set_lease(*owner);
  EXPECT_TRUE(reg.Heartbeat(hb));
  // A restart at the same address registers again at once; the old lease is void.
  const absl::StatusOr<std::string> again = reg.Register(Worker("w1", "m", 2, 0));
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, *owner);
  EXPECT_FALSE(reg.Heartbeat(hb));
}

TEST(RegistryTest, NoWorkersIsUnavailableUnknownModelIsInvalid) {
  WorkerRegistry reg(std::chrono::seconds(10));
  EXPECT_TRUE(absl::IsUnavailable(reg.Pick("", {}, 0).status()));
  EXPECT_TRUE(absl::IsUnavailable(reg.Pick("gemma", {}, 0).status()));
  ASSERT_TRUE(reg.Register(Worker("w1", "gemma", 2, 0)).ok());
  auto bad = reg.Pick("llama", {}, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_NE(bad.status().message().find("gemma"), std::string::npos) << "lists the served models";
}

TEST(RegistryTest, PicksLeastLoadedAndRefusesWhenFull) {
  WorkerRegistry reg(std::chrono::seconds(10));
  ASSERT_TRUE(reg.Register(Worker("busy", "m", 2, 5000)).ok());
  ASSERT_TRUE(reg.Register(Worker("idle", "m", 2, 10)).ok());
  auto a = reg.Pick("m", {}, 0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->worker_id, "idle");  // fewer active tokens
  auto b = reg.Pick("m", {}, 0);
  EXPECT_EQ(b->worker_id, "busy");  // idle now has one in flight from the router
  ASSERT_TRUE(reg.Pick("m", {}, 0).ok());
  ASSERT_TRUE(reg.Pick("m", {}, 0).ok());
  auto full = reg.Pick("m", {}, 0);
  EXPECT_TRUE(absl::IsResourceExhausted(full.status())) << full.status();
  reg.Done("busy");
  auto again = reg.Pick("m", {}, 0);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->worker_id, "busy");
}

TEST(RegistryTest, ExcludedAndDeadWorkersAreSkipped) {
  WorkerRegistry reg(std::chrono::seconds(1));
  ASSERT_TRUE(reg.Register(Worker("a", "m", 4, 0)).ok());
  const absl::StatusOr<std::string> lease = reg.Register(Worker("b", "m", 4, 100));
  ASSERT_TRUE(lease.ok());
  auto p = reg.Pick("m", {"a"}, 0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->worker_id, "b");
  reg.MarkDown("b");
  EXPECT_TRUE(absl::IsUnavailable(reg.Pick("m", {"a"}, 0).status()));
  dd::worker::v1::HeartbeatRequest hb;
  hb.set_worker_id("b");
  hb.mutable_load()->set_max_batch(4);
  EXPECT_FALSE(reg.Heartbeat(hb)) << "a heartbeat without the registration's lease";
  hb.set_lease(*lease);
  EXPECT_TRUE(reg.Heartbeat(hb));  // back up
  EXPECT_TRUE(reg.Pick("m", {"a"}, 0).ok());
  hb.set_worker_id("never-registered");
  EXPECT_FALSE(reg.Heartbeat(hb));
  // Silence past the timeout takes a worker out.
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (reg.workers_up() > 0 && Clock::now() < until) std::this_thread::yield();
  EXPECT_EQ(reg.workers_up(), 0);
  EXPECT_TRUE(absl::IsUnavailable(reg.Pick("m", {}, 0).status()));
}

TEST(RegistryTest, DrainingWorkersGetNothingNew) {
  WorkerRegistry reg(std::chrono::seconds(10));
  const absl::StatusOr<std::string> lease = reg.Register(Worker("a", "m", 4, 0));  // the idlest
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(reg.Register(Worker("b", "m", 4, 500)).ok());
  dd::worker::v1::HeartbeatRequest hb;
  hb.set_worker_id("a");
  hb.set_lease(*lease);
  hb.mutable_load()->set_max_batch(4);
  hb.mutable_load()->set_draining(true);
  ASSERT_TRUE(reg.Heartbeat(hb));
  for (int i = 0; i < 3; ++i) {
    auto p = reg.Pick("m", {}, 0);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->worker_id, "b");
    reg.Done("b");
  }
  EXPECT_EQ(reg.workers_up(), 2);  // still up: it is finishing its requests
  auto none = reg.Pick("m", {"b"}, 0);
  EXPECT_TRUE(absl::IsUnavailable(none.status())) << none.status();
  EXPECT_NE(none.status().message().find("draining"), std::string::npos) << none.status();
}

TEST(RegistryTest, PrefixLocalityKeepsAWorkerWhenNearlyIdle) {
  WorkerRegistry reg(std::chrono::seconds(10));
  ASSERT_TRUE(reg.Register(Worker("a", "m", 8, 0)).ok());
  ASSERT_TRUE(reg.Register(Worker("b", "m", 8, 0)).ok());
  auto first = reg.Pick("m", {}, 42);
  ASSERT_TRUE(first.ok());
  auto second = reg.Pick("m", {}, 42);  // the other worker is idler by one, locality wins
  EXPECT_EQ(second->worker_id, first->worker_id);
  auto other = reg.Pick("m", {}, 7);  // no locality: least loaded
  EXPECT_NE(other->worker_id, first->worker_id);
}

// Bounded state (docs/decisions/0026-security-model.md): junk registrations cannot grow the router
// without bound.
TEST(RegistryTest, RegistryIsBoundedAndForgetsSilentWorkers) {
  WorkerRegistry reg(std::chrono::milliseconds(20), /*max_workers=*/3, /*forget_after=*/std::chrono::milliseconds(200));
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(reg.Register(Worker(id, "m", 4, 0)).ok());
  const absl::Status full = reg.Register(Worker("d", "m", 4, 0)).status();
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_TRUE(reg.Register(Worker("a", "m", 4, 0)).ok());  // re-registering a known id is fine
  auto big = Worker(std::string(WorkerRegistry::kMaxFieldBytes + 1, 'x'), "m", 4, 0);
  const absl::Status r = reg.Register(big).status();
  EXPECT_TRUE(absl::IsInvalidArgument(r)) << r;
  EXPECT_NE(r.message().find("worker_id"), std::string::npos) << r;
  auto placed = reg.Pick("m", {"b", "c"}, 0);  // a request in flight on "a" keeps it known
  ASSERT_TRUE(placed.ok());
  ASSERT_EQ(placed->worker_id, "a");
  // Once b (registered first) has been silent past forget_after, "d" takes its place.
  const auto until = Clock::now() + std::chrono::seconds(10);
  absl::Status d = full;
  while (!d.ok() && Clock::now() < until) {
    std::this_thread::yield();
    d = reg.Register(Worker("d", "m", 4, 0)).status();
  }
  EXPECT_TRUE(d.ok()) << d;
  std::set<std::string> known;
  for (const auto& w : reg.Snapshot()) known.insert(w.worker_id());
  EXPECT_TRUE(known.count("a") && known.count("d") && !known.count("b")) << known.size();
  EXPECT_LE(known.size(), 3u);
}

TEST(RequestIdTest, IdsAreRandomAndUnique) {
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    const std::string id = NewRequestId();
    ASSERT_EQ(id.size(), 4u + 32u) << id;
    ASSERT_EQ(id.rfind("req-", 0), 0u) << id;
    EXPECT_TRUE(seen.insert(id).second) << "repeated id " << id;
  }
  // Consecutive ids share no long prefix beyond "req-" (a counter's would).
  const std::string a = NewRequestId(), b = NewRequestId();
  EXPECT_NE(a.substr(0, 12), b.substr(0, 12));
}

TEST(RegistryTest, EveryReplicaPlacesARepeatedPromptOnTheWorkerThatPublishedItsPrefix) {
  // Two router replicas follow the same records. The worker that served a prompt publishes its
  // prefix key; the replica that never saw the prompt places it there too.
  WorkerRegistry a(std::chrono::seconds(10)), b(std::chrono::seconds(10));
  for (WorkerRegistry* r : {&a, &b}) {
    r->set_external_liveness(true);
    r->Reset({Worker("w1", "m", 4, 0), Worker("w2", "m", 4, 0)});
  }
  const uint64_t key = 0x5eed;
  absl::StatusOr<Placement> first = a.Pick("m", {}, key);
  ASSERT_TRUE(first.ok());
  const std::string other = first->worker_id == "w1" ? "w2" : "w1";
  // B holds one request on that worker, so by load alone it would pick the other one.
  b.Hold(first->worker_id);
  dd::worker::v1::RegisterRequest published = Worker(first->worker_id, "m", 4, 0);
  published.mutable_load()->add_recent_prefix_keys(key);
  ASSERT_TRUE(b.Upsert(published).ok());
  absl::StatusOr<Placement> again = b.Pick("m", {}, key);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->worker_id, first->worker_id);
  EXPECT_NE(again->worker_id, other);
}

TEST(RegistryTest, WithExternalLivenessAWorkerIsUpUntilItsRecordGoes) {
  // A negative heartbeat timeout: every heartbeat is already too old.
  WorkerRegistry timed(std::chrono::milliseconds(-1)), reg(std::chrono::milliseconds(-1));
  ASSERT_TRUE(timed.Upsert(Worker("w1", "m", 2, 0)).ok());
  EXPECT_EQ(timed.workers_up(), 0);
  reg.set_external_liveness(true);
  ASSERT_TRUE(reg.Upsert(Worker("w1", "m", 2, 0)).ok());
  EXPECT_EQ(reg.workers_up(), 1) << "an etcd outage keeps the last known workers";
  reg.Remove("w1");
  EXPECT_EQ(reg.workers_up(), 0);
  ASSERT_TRUE(reg.Upsert(Worker("w1", "m", 2, 0)).ok());
  reg.Reset({Worker("w2", "m", 2, 0)});  // a full listing replaces the view
  const std::vector<dd::v1::WorkerInfo> known = reg.Snapshot();
  ASSERT_EQ(known.size(), 1u);
  EXPECT_EQ(known[0].worker_id(), "w2");
  dd::worker::v1::RegisterRequest bad = Worker("", "m", 2, 0);
  EXPECT_TRUE(absl::IsInvalidArgument(reg.Upsert(bad)));
}

TEST(RegistryTest, AWorkerRecordIsTakenOnlySignedForItsKeyFreshAndUnderALease) {
  const std::string secret = "cluster-secret-0123456789abcdef0123";
  const std::string key = "/dd/workers/w1";
  const double now = 1.8e9;
  const std::string json = R"({"workerId": "w1", "address": "127.0.0.1:1", "publishedUnixSeconds": 1800000000})";
  auto held = [](std::string v, int64_t lease = 7) { return RegistryRecord{std::move(v), lease}; };
  dd::worker::v1::RegisterRequest r;
  EXPECT_TRUE(ParseWorkerRecord(secret, key, held(SignRecord(secret, key, json)), now, &r).ok());
  EXPECT_EQ(r.address(), "127.0.0.1:1");
  EXPECT_TRUE(absl::IsPermissionDenied(ParseWorkerRecord(secret, key, held(json), now, &r))) << "unsigned";
  EXPECT_TRUE(absl::IsPermissionDenied(
      ParseWorkerRecord(secret, key, held(SignRecord("another-secret-0123456789abcdef", key, json)), now, &r)));
  std::string tampered = SignRecord(secret, key, json);
  tampered.replace(tampered.find("127.0.0.1:1"), 11, "10.6.6.6:66");
  EXPECT_TRUE(absl::IsPermissionDenied(ParseWorkerRecord(secret, key, held(tampered), now, &r)));
  EXPECT_TRUE(absl::IsPermissionDenied(
      ParseWorkerRecord(secret, "/dd/workers/w2", held(SignRecord(secret, key, json)), now, &r)))
      << "a signed record copied under another key";
  EXPECT_TRUE(absl::IsPermissionDenied(
      ParseWorkerRecord(secret, key, held(SignRecord(secret, key, json)), now + 3600, &r)))
      << "a replayed record an hour old";
  EXPECT_TRUE(absl::IsInvalidArgument(ParseWorkerRecord(secret, key, held(SignRecord(secret, key, json), 0), now, &r)))
      << "a record under no lease would never expire";
  EXPECT_TRUE(ParseWorkerRecord("", key, held(json), now + 3600, &r).ok()) << "no secret: unsigned records";
  EXPECT_TRUE(absl::IsInvalidArgument(ParseWorkerRecord("", "/dd/workers/w2", held(json), now, &r)));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseWorkerRecord("", key, held(std::string(70000, ' ')), now, &r)));
}

}  // namespace
}  // namespace dd::router
