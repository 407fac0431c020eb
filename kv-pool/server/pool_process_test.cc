// The real dd-kv-pool process on loopback (port picked at run time) with the shm:// client.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv-pool/client/shm_kv_store.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool {
namespace {

constexpr char kAlice[] = "alice-token-0123456789", kBob[] = "bob-token-0123456789ab";
const KvLayout kLayout{.n_layers = 3, .n_kv_heads = 2, .head_dim = 32, .chunk_tokens = 8};

// Starts dd-kv-pool (next to this test binary) and reads the port it prints.
class PoolProcess {
 public:
  explicit PoolProcess(int64_t lease_ttl_ms = 30000) {
    const std::string dir = ::testing::TempDir();
    const std::string cfg = dir + "/tenants-" + std::to_string(getpid()) + ".json";
    std::ofstream(cfg) << R"([{"name": "alice", "token": ")" << kAlice << R"(", "quota": "8MiB"},
                              {"name": "bob", "token": ")" << kBob << R"(", "quota": "1MiB"}])";
    char self[4096] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string exe = std::string(self, n > 0 ? n : 0);
    exe = exe.substr(0, exe.rfind('/')) + "/dd-kv-pool";
    int out[2];
    EXPECT_EQ(pipe(out), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      const std::string ttl = "--lease_ttl_ms=" + std::to_string(lease_ttl_ms), tenants = "--tenants=" + cfg;
      execl(exe.c_str(), exe.c_str(), tenants.c_str(), ttl.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    std::string line;
    pollfd pfd{out[0], POLLIN, 0};
    char c = 0;
    while (poll(&pfd, 1, 20000) == 1 && read(out[0], &c, 1) == 1 && c != '\n') line += c;
    close(out[0]);
    const auto at = line.rfind("listening on ");
    EXPECT_NE(at, std::string::npos) << "pool did not start: '" << line << "'";
    if (at != std::string::npos) address_ = line.substr(at + 13);
  }
  ~PoolProcess() { Kill(SIGTERM); }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    if (sig == SIGKILL) {  // a killed pool leaves its regions behind: remove them
      std::error_code ec;
      const std::string prefix = "dd-kvpool-" + std::to_string(pid_) + "-";
      for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
        if (e.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(e.path(), ec);
      }
    }
    pid_ = -1;
  }
  const std::string& address() const { return address_; }
  std::unique_ptr<v1::KvPool::Stub> Stub() {
    return v1::KvPool::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

 private:
  pid_t pid_ = -1;
  std::string address_;
};

std::unique_ptr<KvStore> Connect(const PoolProcess& p, const char* token, LinkModel link = {}) {
  auto s = ConnectShmKvStore({.address = p.address(), .token = token, .link = link, .first_extent_chunks = 4});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::vector<float> BlockFor(uint64_t seed, const ChunkRef& r) {
  std::vector<float> b(kLayout.block_floats());
  std::mt19937 g(static_cast<uint32_t>(seed * 1000003 + r.chunk * 131 + r.layer * 7 + r.kv_head));
  for (float& x : b) x = std::uniform_real_distribution<float>(-1, 1)(g);
  return b;
}

TEST(PoolProcessTest, ConcurrentWriteGatherRoundTripsExactly) {
  PoolProcess pool;
  auto store = Connect(pool, kAlice, {.bandwidth_gbps = 5, .latency_us = 5});
  ASSERT_NE(store, nullptr);
  std::atomic<int> mismatches{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto seq = store->Open(kLayout);
      if (!seq.ok()) return void(++errors);
      const int64_t chunks = 40;  // several extents
      for (int64_t c = 0; c < chunks; ++c) {
        for (int32_t l = 0; l < 3; ++l) {
          for (int32_t h = 0; h < 2; ++h) {
            const ChunkRef r{l, h, c};
            if (!store->Write(*seq, r, BlockFor(t, r).data()).ok()) ++errors;
          }
        }
      }
      std::mt19937 g(t);
      for (int round = 0; round < 30; ++round) {
        std::vector<ChunkRef> refs;
        for (int i = 0; i < 12; ++i) {
          refs.push_back({static_cast<int32_t>(g() % 3), static_cast<int32_t>(g() % 2), static_cast<int64_t>(g() % chunks)});
        }
        std::vector<float> dst(refs.size() * kLayout.block_floats());
        auto id = store->Gather(*seq, refs, dst.data(), round % 2 ? Priority::kUrgent : Priority::kBackground);
        if (!id.ok() || !store->Wait(*id).ok()) return void(++errors);
        for (size_t i = 0; i < refs.size(); ++i) {
          const std::vector<float> want = BlockFor(t, refs[i]);
          if (std::memcmp(want.data(), &dst[i * want.size()], want.size() * sizeof(float)) != 0) ++mismatches;
        }
      }
      if (!store->Release(*seq).ok()) ++errors;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(store->bytes_stored(), 0);
}

TEST(PoolProcessTest, TokensQuotasAndTenantIsolation) {
  PoolProcess pool;
  auto bad = ConnectShmKvStore({.address = pool.address(), .token = "wrong-token-000000000", .link = {}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kUnauthenticated) << bad.status();
  auto stub = pool.Stub();
  {
    grpc::ClientContext ctx;  // no token at all
    v1::StatsResponse r;
    EXPECT_EQ(stub->Stats(&ctx, {}, &r).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Bob's quota is 1 MiB: writing far past it is refused, not silently dropped.
  auto bob = Connect(pool, kBob);
  ASSERT_NE(bob, nullptr);
  auto seq = bob->Open(kLayout);
  ASSERT_TRUE(seq.ok()) << seq.status();
  std::vector<float> block(kLayout.block_floats(), 1.0f);
  absl::Status st;
  for (int64_t c = 0; c < 1000 && st.ok(); ++c) st = bob->Write(*seq, {0, 0, c}, block.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  // Alice cannot touch Bob's sequence through the control plane.
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kAlice);
  v1::ReleaseRequest rel;
  rel.set_sequence(*seq);
  v1::ReleaseResponse rr;
  EXPECT_EQ(stub->Release(&ctx, rel, &rr).error_code(), grpc::StatusCode::NOT_FOUND);
  // Malformed requests.
  grpc::ClientContext ctx2;
  ctx2.AddMetadata("authorization", std::string("Bearer ") + kAlice);
  v1::OpenRequest open;
  open.set_chunks(0);
  v1::OpenResponse orsp;
  EXPECT_EQ(stub->Open(&ctx2, open, &orsp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bob->Write(*seq, {5, 0, 0}, block.data()).code(), absl::StatusCode::kInvalidArgument);
}

TEST(PoolProcessTest, ExpiredLeaseFreesMemory) {
  PoolProcess pool(/*lease_ttl_ms=*/300);
  auto stub = pool.Stub();
  auto call = [&](auto fn) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kAlice);
    return fn(&ctx);
  };
  v1::OpenRequest open;
  open.mutable_layout()->set_n_layers(1);
  open.mutable_layout()->set_n_kv_heads(1);
  open.mutable_layout()->set_head_dim(64);
  open.mutable_layout()->set_chunk_tokens(8);
  open.set_chunks(16);
  v1::OpenResponse orsp;
  ASSERT_TRUE(call([&](grpc::ClientContext* c) { return stub->Open(c, open, &orsp); }).ok());
  v1::StatsResponse stats;
  ASSERT_TRUE(call([&](grpc::ClientContext* c) { return stub->Stats(c, {}, &stats); }).ok());
  EXPECT_GT(stats.used_bytes(), 0);
  // Nobody renews: the reaper frees it within a few TTLs.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (stats.used_bytes() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
    ASSERT_TRUE(call([&](grpc::ClientContext* c) { return stub->Stats(c, {}, &stats); }).ok());
  }
  EXPECT_EQ(stats.used_bytes(), 0);
  EXPECT_EQ(stats.expired_leases(), 1);
}

TEST(PoolProcessTest, KilledPoolGivesACleanErrorNotAHang) {
  PoolProcess pool(/*lease_ttl_ms=*/600);
  auto store = Connect(pool, kAlice);
  ASSERT_NE(store, nullptr);
  auto seq = store->Open(kLayout);
  ASSERT_TRUE(seq.ok());
  const ChunkRef r{1, 1, 2};
  ASSERT_TRUE(store->Write(*seq, r, BlockFor(9, r).data()).ok());
  pool.Kill(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  auto open = store->Open(kLayout);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kUnavailable) << open.status();
  // Data-path calls fail once the lease renewal notices, within a bounded time; until then
  // a gather returns the right bytes (the mapping outlives the process), never wrong ones.
  absl::Status st;
  std::vector<float> dst(kLayout.block_floats());
  while (st.ok() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    auto id = store->Gather(*seq, {&r, 1}, dst.data(), Priority::kUrgent);
    st = id.status();
    if (id.ok()) {
      ASSERT_TRUE(store->Wait(*id).ok());
      ASSERT_EQ(std::memcmp(dst.data(), BlockFor(9, r).data(), dst.size() * sizeof(float)), 0);
    }
    std::this_thread::yield();
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(8));
}

}  // namespace
}  // namespace dd::kvpool
