// The real dd-kv-pool process on loopback (port picked at run time) with the shm:// client.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <poll.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv-pool/client/data_path.h"
#include "kv-pool/client/fd_passing.h"
#include "kv-pool/client/pool_kv_store.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/server/pool_process.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool {
namespace {

using testing_util::kAlice;
using testing_util::kBob;
using testing_util::PoolProcess;
using testing_util::Sample;
using testing_util::Scrape;
const KvLayout kLayout{.n_layers = 3, .n_kv_heads = 2, .head_dim = 32, .chunk_tokens = 8};

std::unique_ptr<KvStore> Connect(const PoolProcess& p, const char* token, LinkModel link = {},
                                 PoolTransport transport = PoolTransport::kShm) {
  auto s = ConnectPoolKvStore({.address = p.address(), .token = token, .transport = transport, .link = link,
                               .first_extent_chunks = 4});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

std::vector<float> BlockFor(uint64_t seed, const ChunkRef& r) {
  std::vector<float> b((kLayout.block_bytes() / 4));
  std::mt19937 g(static_cast<uint32_t>(seed * 1000003 + r.chunk * 131 + r.layer * 7 + r.kv_head));
  for (float& x : b) x = std::uniform_real_distribution<float>(-1, 1)(g);
  return b;
}

// Writes chunks [0, chunks) of layers 0-2 (KV head chunk % 2), each BlockFor(seed, ref), in
// order chunk by chunk, appending their refs to *refs.
void WriteLayers(KvStore& store, SequenceId seq, int64_t chunks, uint64_t seed, std::vector<ChunkRef>* refs) {
  for (int64_t c = 0; c < chunks; ++c) {
    for (int32_t l = 0; l < 3; ++l) {
      refs->push_back({l, static_cast<int32_t>(c % 2), c});
      ASSERT_TRUE(store.Write(seq, refs->back(), BlockFor(seed, refs->back()).data()).ok());
    }
  }
}

// Both data paths: shared memory (mapped region) and UCX (one-sided puts and gets; UCX picks
// the transport: shared memory or tcp on this host).
class PoolTransportTest : public ::testing::TestWithParam<PoolTransport> {};

INSTANTIATE_TEST_SUITE_P(Transports, PoolTransportTest, ::testing::Values(PoolTransport::kShm, PoolTransport::kUcx),
                         [](const auto& info) { return info.param == PoolTransport::kShm ? "shm" : "ucx"; });

// Four threads write and gather their own sequences at once; every block comes back exact.
void ConcurrentRoundTrips(KvStore* store) {
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
        // Even rounds gather in order; odd rounds scatter block i to slot n-1-i (GatherTo), every
        // third of them the V halves alone (BlockPart::kValues).
        const size_t n = refs.size();
        const bool scatter = round % 2 == 1, values = round % 6 == 5;
        const BlockPart part = values ? BlockPart::kValues : BlockPart::kWhole;
        const int64_t floats = PartBytes(kLayout, part) / 4, skip = PartOffset(kLayout, part) / 4;
        std::vector<float> dst(n * floats);
        std::vector<void*> dsts;
        for (size_t i = 0; i < n; ++i) dsts.push_back(&dst[(scatter ? n - 1 - i : i) * floats]);
        auto id = scatter ? store->GatherTo(*seq, refs, dsts, Priority::kUrgent, DstMemory::kHost, part)
                          : store->Gather(*seq, refs, dst.data(), Priority::kBackground);
        if (!id.ok() || !store->Wait(*id).ok()) return void(++errors);
        for (size_t i = 0; i < n; ++i) {
          const std::vector<float> want = BlockFor(t, refs[i]);
          if (std::memcmp(want.data() + skip, dsts[i], floats * sizeof(float)) != 0) ++mismatches;
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

// Through a link model: gathers queue on the store's transfer thread while puts come from four.
TEST_P(PoolTransportTest, ConcurrentWriteGatherRoundTripsExactly) {
  PoolProcess pool;
  auto store = Connect(pool, kAlice, {.bandwidth_gbps = 5, .latency_us = 5}, GetParam());
  ASSERT_NE(store, nullptr);
  ConcurrentRoundTrips(store.get());
}

// Infinite link: each thread's gathers run on its own thread (over ucx://, on its own UCX
// worker and endpoint), on both UCX paths.
TEST_P(PoolTransportTest, ConcurrentInlineGathersRoundTripExactly) {
  PoolProcess pool(30000, "8MiB", {"--ucx_rma", "--ucx_rma_unconfined"});
  for (UcxPath path : {UcxPath::kActiveMessages, UcxPath::kRma}) {
    if (GetParam() == PoolTransport::kShm && path == UcxPath::kRma) continue;
    SCOPED_TRACE(path == UcxPath::kRma ? "rma" : "active messages");
    auto s = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = GetParam(),
                                 .ucx_path = path, .first_extent_chunks = 4});
    ASSERT_TRUE(s.ok()) << s.status();
    ConcurrentRoundTrips(s->get());
  }
}

TEST(PoolProcessTest, TokensQuotasAndTenantIsolation) {
  PoolProcess pool;
  auto bad = ConnectPoolKvStore({.address = pool.address(), .token = "wrong-token-000000000"});
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
  std::vector<float> block((kLayout.block_bytes() / 4), 1.0f);
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

// Tenant regions (docs/decisions/0017-pool-regions-memfd.md): regions have no name anyone on the
// host could open; a tenant's region descriptor is handed out only for its token, and each token
// gets its own tenant's region.
TEST(PoolProcessTest, RegionsAreAnonymousAndHandedOutOnlyForTheToken) {
  PoolProcess pool;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    EXPECT_EQ(e.path().filename().string().rfind("dd-kvpool", 0), std::string::npos) << e.path();
  }
  auto stub = pool.Stub();
  v1::HandshakeResponse hs;
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kAlice);
  ASSERT_TRUE(stub->Handshake(&ctx, {}, &hs).ok());
  ASSERT_FALSE(hs.fd_socket().empty());
  auto wrong = ReceiveRegionFd(hs.fd_socket(), "wrong-token-000000000");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied) << wrong.status();
  EXPECT_FALSE(ReceiveRegionFd(hs.fd_socket(), std::string(600, 'x')).ok());  // oversized: refused here
  auto alice = ReceiveRegionFd(hs.fd_socket(), kAlice), bob = ReceiveRegionFd(hs.fd_socket(), kBob);
  ASSERT_TRUE(alice.ok() && bob.ok()) << alice.status() << bob.status();
  struct stat a, b;
  ASSERT_EQ(fstat(*alice, &a), 0);
  ASSERT_EQ(fstat(*bob, &b), 0);
  EXPECT_EQ(a.st_size, hs.region_bytes());
  EXPECT_NE(a.st_ino, b.st_ino);  // different files: bob's token never yields alice's region
  close(*alice);
  close(*bob);
  // A client that connects and says nothing does not stall the pool past its 2 s read timeout.
  const int idle = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, hs.fd_socket().data() + 1, hs.fd_socket().size() - 1);
  ASSERT_EQ(connect(idle, reinterpret_cast<sockaddr*>(&addr),
                    static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + hs.fd_socket().size())), 0);
  auto after = ReceiveRegionFd(hs.fd_socket(), kAlice);
  EXPECT_TRUE(after.ok()) << after.status();
  if (after.ok()) close(*after);
  close(idle);
}

TEST(PoolProcessTest, MetricsReflectThePool) {
  PoolProcess pool;
  auto store = Connect(pool, kAlice);
  ASSERT_NE(store, nullptr);
  auto seq = store->Open(kLayout);
  ASSERT_TRUE(seq.ok());
  const std::string used = R"(dd_pool_bytes{tenant="alice",state="used"})";
  std::string body = Scrape(pool.metrics());
  ASSERT_NE(body.find("# TYPE dd_pool_bytes gauge"), std::string::npos) << body;
  EXPECT_GT(Sample(body, used), 0);
  EXPECT_EQ(Sample(body, R"(dd_pool_bytes{tenant="bob",state="quota"})"), 1 << 20);
  EXPECT_EQ(Sample(body, R"(dd_pool_sequences{tenant="alice"})"), 1);
  ASSERT_TRUE(store->Release(*seq).ok());
  body = Scrape(pool.metrics());
  EXPECT_EQ(Sample(body, used), 0);
  EXPECT_EQ(Sample(body, R"(dd_pool_sequences{tenant="alice"})"), 0);

  // The UCX data path's traffic: one block written and gathered back over active messages.
  auto ucx = Connect(pool, kAlice, {}, PoolTransport::kUcx);
  ASSERT_NE(ucx, nullptr);
  auto useq = ucx->Open(kLayout);
  ASSERT_TRUE(useq.ok());
  const ChunkRef ref{0, 0, 0};
  ASSERT_TRUE(ucx->Write(*useq, ref, BlockFor(1, ref).data()).ok());
  std::vector<float> back((kLayout.block_bytes() / 4));
  auto id = ucx->Gather(*useq, {ref}, back.data(), Priority::kUrgent);
  ASSERT_TRUE(id.ok() && ucx->Wait(*id).ok());
  body = Scrape(pool.metrics());
  const double block = static_cast<double>((kLayout.block_bytes() / 4) * sizeof(float));
  EXPECT_EQ(Sample(body, R"(dd_pool_ucx_requests_total{op="put"})"), 1) << body;
  EXPECT_EQ(Sample(body, R"(dd_pool_ucx_bytes_total{op="put"})"), block);
  EXPECT_EQ(Sample(body, R"(dd_pool_ucx_requests_total{op="get"})"), 1);
  EXPECT_EQ(Sample(body, R"(dd_pool_ucx_bytes_total{op="get"})"), block);
  EXPECT_EQ(Sample(body, R"(dd_pool_ucx_requests_total{op="refused"})"), 0);
}

// Sets (or, with nullptr, unsets) an environment variable for a scope: the pool process and
// UCX contexts read it when they start.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* was = std::getenv(name);
    had_ = was != nullptr;
    if (had_) saved_ = was;
    if (value != nullptr) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_, saved_.c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string saved_;
};

// A pool run with --ucx_rma offers one-sided access (trusted tenants, RDMA); the client uses it
// when asked and the bytes round-trip the same.
TEST(PoolProcessTest, UcxOneSidedPathWhenThePoolOffersIt) {
  PoolProcess pool(30000, "8MiB", {"--ucx_rma", "--ucx_rma_unconfined"});
  auto s = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                               .ucx_path = UcxPath::kRma, .first_extent_chunks = 4});
  ASSERT_TRUE(s.ok()) << s.status();
  auto seq = (*s)->Open(kLayout);
  ASSERT_TRUE(seq.ok());
  std::vector<ChunkRef> refs;
  for (int64_t c = 0; c < 6; ++c) {
    refs.push_back({1, 1, c});
    ASSERT_TRUE((*s)->Write(*seq, refs.back(), BlockFor(3, refs.back()).data()).ok());
  }
  std::vector<float> dst(refs.size() * (kLayout.block_bytes() / 4));
  auto id = (*s)->Gather(*seq, refs, dst.data(), Priority::kUrgent);
  ASSERT_TRUE(id.ok() && (*s)->Wait(*id).ok());
  for (size_t i = 0; i < refs.size(); ++i) {
    EXPECT_TRUE(std::equal(dst.begin() + i * (kLayout.block_bytes() / 4), dst.begin() + (i + 1) * (kLayout.block_bytes() / 4),
                           BlockFor(3, refs[i]).begin())) << i;
  }
  // No request went through the active-message path.
  EXPECT_EQ(Sample(Scrape(pool.metrics()), R"(dd_pool_ucx_requests_total{op="get"})"), 0);
  // Gathers into CUDA memory (GPUDirect): off unless $DD_UCX_GPUDIRECT=on, then claimed exactly
  // where this UCX reports CUDA memory, and never over active messages or shared memory; a
  // store that does not claim refuses a gather into device memory.
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  ASSERT_EQ(ucp_init(&params, nullptr, &context), UCS_OK);
  const bool ucx_cuda = (UcxMemoryTypes(context) & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  ucp_cleanup(context);
  {
    ScopedEnv unset("DD_UCX_GPUDIRECT", nullptr);
    auto off = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                                   .ucx_path = UcxPath::kRma, .first_extent_chunks = 4});
    ASSERT_TRUE(off.ok()) << off.status();
    EXPECT_FALSE((*off)->WritesDeviceMemory());
    auto seq2 = (*off)->Open(kLayout);
    ASSERT_TRUE(seq2.ok());
    ASSERT_TRUE((*off)->Write(*seq2, refs[0], BlockFor(3, refs[0]).data()).ok());
    void* one = dst.data();
    EXPECT_EQ((*off)->GatherTo(*seq2, {&refs[0], 1}, {&one, 1}, Priority::kUrgent, DstMemory::kDevice).status().code(),
              absl::StatusCode::kUnimplemented);
  }
  ScopedEnv on("DD_UCX_GPUDIRECT", "on");
  auto rma = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                                 .ucx_path = UcxPath::kRma, .first_extent_chunks = 4});
  ASSERT_TRUE(rma.ok()) << rma.status();
  EXPECT_EQ((*rma)->WritesDeviceMemory(), ucx_cuda);
  for (auto [transport, path] : {std::pair{PoolTransport::kUcx, UcxPath::kActiveMessages},
                                 std::pair{PoolTransport::kShm, UcxPath::kAuto}}) {
    auto other = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = transport,
                                     .ucx_path = path, .first_extent_chunks = 4});
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_FALSE((*other)->WritesDeviceMemory());
  }
}

TEST(PoolProcessTest, LayersStripedOverTwoPools) {
  PoolProcess a, b;
  auto store = OpenKvStore("shm://" + a.address() + ",shm://" + b.address(), kAlice, {});
  ASSERT_TRUE(store.ok()) << store.status();
  auto seq = (*store)->Open(kLayout);
  ASSERT_TRUE(seq.ok());
  std::vector<ChunkRef> refs;
  ASSERT_NO_FATAL_FAILURE(WriteLayers(**store, *seq, 6, 3, &refs));
  // Scattered destinations (block i to slot n-1-i), split between the two pools' gathers.
  const size_t n = refs.size();
  std::vector<float> dst(n * (kLayout.block_bytes() / 4));
  std::vector<void*> dsts;
  for (size_t i = 0; i < n; ++i) dsts.push_back(&dst[(n - 1 - i) * (kLayout.block_bytes() / 4)]);
  auto id = (*store)->GatherTo(*seq, refs, dsts, Priority::kBackground);
  ASSERT_TRUE(id.ok() && (*store)->Wait(*id).ok());
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(std::memcmp(dsts[i], BlockFor(3, refs[i]).data(),
                          (kLayout.block_bytes() / 4) * sizeof(float)), 0) << i;
  }
  // Both pools hold part of it.
  const std::string used = R"(dd_pool_bytes{tenant="alice",state="used"})";
  EXPECT_GT(Sample(Scrape(a.metrics()), used), 0);
  EXPECT_GT(Sample(Scrape(b.metrics()), used), 0);
  EXPECT_EQ(OpenKvStore("shm://" + a.address() + ",inproc://", kAlice, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// shm:// maps the tenant's region into the client, so it can say where each block lies there
// (a device gathers from it directly): the addresses hold the written bytes and lie in the
// ranges; a striped store spans both pools' ranges; ucx:// maps none (the in-process store's
// arena: kv_store_test).
TEST(PoolProcessTest, ShmStoresSayWhereEachBlockLiesInTheirMapping) {
  PoolProcess a, b;
  auto store = OpenKvStore("shm://" + a.address() + ",shm://" + b.address(), kAlice, {});
  ASSERT_TRUE(store.ok()) << store.status();
  const std::vector<KvStore::MappedRange> ranges = (*store)->MappedRanges();
  ASSERT_EQ(ranges.size(), 2u);
  auto seq = (*store)->Open(kLayout);
  ASSERT_TRUE(seq.ok());
  std::vector<ChunkRef> refs;
  ASSERT_NO_FATAL_FAILURE(WriteLayers(**store, *seq, 4, 5, &refs));
  std::vector<const void*> addrs;
  ASSERT_TRUE((*store)->BlockAddresses(*seq, refs, &addrs).ok());
  ASSERT_EQ(addrs.size(), refs.size());
  const int64_t bytes = (kLayout.block_bytes() / 4) * static_cast<int64_t>(sizeof(float));
  for (size_t i = 0; i < refs.size(); ++i) {
    const auto* p = static_cast<const char*>(addrs[i]);
    // Layer l lives in shard l % 2: its block in that shard's range.
    const KvStore::MappedRange& r = ranges[refs[i].layer % 2];
    EXPECT_TRUE(p >= static_cast<const char*>(r.base) && p + bytes <= static_cast<const char*>(r.base) + r.bytes) << i;
    EXPECT_EQ(std::memcmp(p, BlockFor(5, refs[i]).data(), bytes), 0) << i;
  }
  // A block never written is refused as a gather of it would be, and leaves nothing behind.
  const std::vector<ChunkRef> unwritten = {refs[0], refs[1], {0, 0, 7}};
  EXPECT_EQ((*store)->BlockAddresses(*seq, unwritten, &addrs).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(addrs.empty());
  auto ucx = OpenKvStore("ucx://" + a.address(), kAlice, {});
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  EXPECT_TRUE((*ucx)->MappedRanges().empty());
  EXPECT_EQ((*ucx)->BlockAddresses(*seq, {}, &addrs).code(), absl::StatusCode::kUnimplemented);
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

// The layout's KV type travels on the wire and sets the block size: an f16 sequence holds half
// an f32 one's bytes; a type the pool does not know is refused by name, nothing allocated.
TEST(PoolProcessTest, TheLayoutsKvTypeSetsTheBlockSizeAndAnUnknownOneIsRefused) {
  PoolProcess pool;
  auto stub = pool.Stub();
  auto call = [&](auto fn) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kAlice);
    return fn(&ctx);
  };
  const auto used_after_open = [&](int64_t dtype, grpc::Status* st) {
    v1::OpenRequest open;
    open.mutable_layout()->set_n_layers(2);
    open.mutable_layout()->set_n_kv_heads(1);
    open.mutable_layout()->set_head_dim(64);
    open.mutable_layout()->set_chunk_tokens(8);
    open.mutable_layout()->set_dtype(dtype);
    open.set_chunks(16);
    v1::OpenResponse orsp;
    v1::StatsResponse before, after;
    EXPECT_TRUE(call([&](grpc::ClientContext* c) { return stub->Stats(c, {}, &before); }).ok());
    *st = call([&](grpc::ClientContext* c) { return stub->Open(c, open, &orsp); });
    EXPECT_TRUE(call([&](grpc::ClientContext* c) { return stub->Stats(c, {}, &after); }).ok());
    return after.used_bytes() - before.used_bytes();
  };
  grpc::Status st;
  const int64_t f32 = used_after_open(0, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const int64_t f16 = used_after_open(1, &st);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_GT(f16, 0);
  EXPECT_EQ(2 * f16, f32);
  EXPECT_EQ(used_after_open(9, &st), 0);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("KV dtype 9 is unknown"), std::string::npos) << st.error_message();
}

TEST_P(PoolTransportTest, KilledPoolGivesACleanErrorNotAHang) {
  PoolProcess pool(/*lease_ttl_ms=*/600);
  auto store = Connect(pool, kAlice, {}, GetParam());
  ASSERT_NE(store, nullptr);
  auto seq = store->Open(kLayout);
  ASSERT_TRUE(seq.ok());
  const ChunkRef r{1, 1, 2};
  ASSERT_TRUE(store->Write(*seq, r, BlockFor(9, r).data()).ok());
  pool.Kill(SIGKILL);
  const auto t0 = std::chrono::steady_clock::now();
  auto open = store->Open(kLayout);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kUnavailable) << open.status();
  // Data-path calls fail once the lease renewal (or UCX) notices, within a bounded time;
  // until then a gather returns the right bytes (a shm mapping outlives the process), never
  // wrong ones.
  absl::Status st;
  std::vector<float> dst((kLayout.block_bytes() / 4));
  while (st.ok() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    auto id = store->Gather(*seq, {&r, 1}, dst.data(), Priority::kUrgent);
    st = id.status();
    if (id.ok()) st = store->Wait(*id);  // a transfer in flight may fail too (ucx)
    if (id.ok() && st.ok()) {
      ASSERT_EQ(std::memcmp(dst.data(), BlockFor(9, r).data(), dst.size() * sizeof(float)), 0);
    }
    std::this_thread::yield();
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(8));
}

// A pool killed and started again at the same address before the lease renewal noticed: the
// store still maps the old region, so the new pool's extents would be read and written in the
// wrong memory (another worker's committed prefix read as garbage). The next Open, Extend or
// LookupPrefix sees another pool instance and fails UNAVAILABLE, so the worker reconnects.
TEST(PoolProcessTest, APoolRestartedAtTheSameAddressIsNoticedAtTheNextCall) {
  auto first = std::make_unique<PoolProcess>(/*lease_ttl_ms=*/60000);
  const std::string address = first->address();
  ASSERT_FALSE(address.empty());
  auto store = Connect(*first, kAlice);
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Open(kLayout).ok());
  first->Kill(SIGKILL);
  PoolProcess second(60000, "8MiB", {"--listen=" + address});
  ASSERT_EQ(second.address(), address);
  // The first call may meet the old connection's end; none may succeed through the old mapping.
  absl::Status st;
  for (int i = 0; i < 5 && st.message().find("restarted") == absl::string_view::npos; ++i) {
    st = i % 2 == 0 ? store->LookupPrefix({1, 2, 3}, kLayout, 1).status() : store->Open(kLayout).status();
    ASSERT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  }
  EXPECT_NE(st.message().find("restarted"), std::string::npos) << st;
  EXPECT_EQ(store->Open(kLayout).status().code(), absl::StatusCode::kUnavailable);  // lost until reconnected
  // Reconnected, the store works with the new pool.
  ASSERT_TRUE(store->Recover().ok());
  auto seq = store->Open(kLayout);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const ChunkRef r{0, 1, 0};
  ASSERT_TRUE(store->Write(*seq, r, BlockFor(3, r).data()).ok());
  std::vector<float> dst((kLayout.block_bytes() / 4));
  auto id = store->Gather(*seq, {&r, 1}, dst.data(), Priority::kUrgent);
  ASSERT_TRUE(id.ok() && store->Wait(*id).ok());
  EXPECT_EQ(std::memcmp(dst.data(), BlockFor(3, r).data(), dst.size() * sizeof(float)), 0);
}

// A pool (serving tcp too) started with `name`=`value` in its environment alone.
std::unique_ptr<PoolProcess> PoolWithOwnSetting(const char* name, const char* value) {
  ScopedEnv own(name, value);
  return std::make_unique<PoolProcess>(30000, "8MiB", std::vector<std::string>{"--ucx_tcp"});
}

// Alice's Handshake with `req`, as a worker of an earlier build sends it: the pool answers but
// withholds its UCX address and a session.
v1::HandshakeResponse WithheldHandshake(PoolProcess& pool, const v1::HandshakeRequest& req) {
  v1::HandshakeResponse hs;
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kAlice);
  EXPECT_TRUE(pool.Stub()->Handshake(&ctx, req, &hs).ok());
  EXPECT_TRUE(hs.ucx_worker_address().empty());
  EXPECT_TRUE(hs.ucx_session().empty());
  return hs;
}

// A default ucx:// worker (this process's environment) is refused by `pool` before it connects,
// with a message naming each of `named`.
void ExpectRefusedNaming(const PoolProcess& pool, std::initializer_list<const char*> named) {
  auto refused = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                                     .first_extent_chunks = 4});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  for (const char* n : named) EXPECT_NE(refused.status().message().find(n), std::string::npos) << refused.status();
}

// Over UCX's shared memory a worker whose segment size differs from the pool's crashed the pool
// inside UCX (both ways round, measured by hand). Such a worker is refused before it connects,
// naming both settings; over tcp the same worker connects and round-trips, and the pool lives.
TEST(PoolProcessTest, UcxSharedMemorySettingsMustMatchThePools) {
  ScopedEnv any_tls("UCX_TLS", nullptr);  // both ends may use shared memory, whatever CI's environment
  ScopedEnv mm("UCX_MM_SEG_SIZE", nullptr), posix("UCX_POSIX_SEG_SIZE", nullptr), sysv("UCX_SYSV_SEG_SIZE", nullptr);
  std::unique_ptr<PoolProcess> pool = PoolWithOwnSetting("UCX_MM_SEG_SIZE", "16k");
  ASSERT_FALSE(pool->address().empty());
  // An older worker, which reports no settings, gets no UCX address or session to reach it by.
  const std::string shm = WithheldHandshake(*pool, {}).ucx_shm_settings();
  EXPECT_NE(shm.find("UCX_MM_SEG_SIZE=16k"), std::string::npos) << shm;
  ExpectRefusedNaming(*pool, {"UCX_MM_SEG_SIZE=16k", "UCX_MM_SEG_SIZE=32k"});
  ScopedEnv tcp("UCX_TLS", "tcp");
  auto s = ConnectPoolKvStore({.address = pool->address(), .token = kAlice, .transport = PoolTransport::kUcx,
                               .first_extent_chunks = 4});
  ASSERT_TRUE(s.ok()) << s.status();
  auto seq = (*s)->Open(kLayout);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const ChunkRef r{2, 1, 3};
  ASSERT_TRUE((*s)->Write(*seq, r, BlockFor(4, r).data()).ok());
  std::vector<float> dst((kLayout.block_bytes() / 4));
  auto id = (*s)->Gather(*seq, {&r, 1}, dst.data(), Priority::kUrgent);
  ASSERT_TRUE(id.ok() && (*s)->Wait(*id).ok());
  EXPECT_EQ(std::memcmp(dst.data(), BlockFor(4, r).data(), dst.size() * sizeof(float)), 0);
  int status = 0;
  EXPECT_EQ(waitpid(pool->pid(), &status, WNOHANG), 0) << "the pool exited";
}

// UCX's FIFO records a message's length in 16 bits: with 64 KiB segments a full one killed the
// receiving process (measured: the gatherer, by an assertion in UCX). A pool asked for such
// segments does not start (exit status 2, a setting to fix: not 1, UCX unavailable, nor a
// signal); a worker asked for them is refused with that reason, not the settings mismatch it
// would also have with the pool.
TEST(PoolProcessTest, FifoSegmentsUcxCannotCarryAreRefusedAtStart) {
  ScopedEnv any_tls("UCX_TLS", nullptr);
  ScopedEnv mm("UCX_MM_SEG_SIZE", nullptr), posix("UCX_POSIX_SEG_SIZE", nullptr), sysv("UCX_SYSV_SEG_SIZE", nullptr);
  {
    std::unique_ptr<PoolProcess> pool = PoolWithOwnSetting("UCX_POSIX_SEG_SIZE", "64k");
    EXPECT_TRUE(pool->address().empty()) << "a pool with 64 KiB FIFO segments started";
    const std::optional<int> status = pool->WaitExit(std::chrono::steady_clock::now() + std::chrono::seconds(20));
    ASSERT_TRUE(status.has_value()) << "the pool neither started nor exited";
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 2) << "wait status " << *status;
  }
  PoolProcess pool(30000, "8MiB", {"--ucx_tcp"});
  ASSERT_FALSE(pool.address().empty());
  ScopedEnv big("UCX_MM_SEG_SIZE", "65536");
  ExpectRefusedNaming(pool, {"UCX_MM_SEG_SIZE=65536 is over 65535 bytes"});
}

// Over tcp a fragment larger than the receiver's segment killed the receiver inside UCX (a pool
// with 1 MiB receive segments against a worker with 64 KiB, by hand). A worker with other tcp
// settings is refused before it connects, naming both; one with the pool's settings gathers a
// reply of many fragments byte-exact; one that leaves tcp out connects whatever they are.
TEST(PoolProcessTest, UcxTcpSettingsMustMatchThePools) {
  ScopedEnv any_tls("UCX_TLS", nullptr);
  ScopedEnv rx("UCX_TCP_RX_SEG_SIZE", nullptr), tx("UCX_TCP_TX_SEG_SIZE", nullptr);
  std::unique_ptr<PoolProcess> pool = PoolWithOwnSetting("UCX_TCP_RX_SEG_SIZE", "256k");
  ASSERT_FALSE(pool->address().empty());
  // A worker of the stop before, which reports shared-memory settings but no tcp ones, gets no
  // UCX address or session to reach it by.
  v1::HandshakeRequest stop40;
  stop40.set_ucx_shm_settings(UcxSharedMemorySettings());
  EXPECT_EQ(WithheldHandshake(*pool, stop40).ucx_tcp_settings(), "UCX_TCP_RX_SEG_SIZE=256k");
  {
    ScopedEnv tcp("UCX_TLS", "tcp");
    ExpectRefusedNaming(*pool, {"UCX_TCP_RX_SEG_SIZE=256k", "UCX_TCP_RX_SEG_SIZE=1m"});
    // A pool of the stop before reports no tcp settings: refused too, with the fix that helps.
    ScopedEnv same("UCX_TCP_RX_SEG_SIZE", "256k");
    v1::HandshakeRequest req;
    req.set_ucx_shm_settings(UcxSharedMemorySettings());
    req.set_ucx_tcp_settings(UcxTcpSettings());
    v1::HandshakeResponse hs;
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + kAlice);
    ASSERT_TRUE(pool->Stub()->Handshake(&ctx, req, &hs).ok());
    ASSERT_FALSE(hs.ucx_worker_address().empty());  // this worker matches the pool ...
    hs.clear_ucx_tcp_settings();                       // ... as the older pool would not say
    auto older = NewUcxDataPath(hs, 1000, UcxPath::kActiveMessages, true);
    ASSERT_FALSE(older.ok());
    EXPECT_EQ(older.status().code(), absl::StatusCode::kFailedPrecondition) << older.status();
    EXPECT_NE(older.status().message().find("an older pool"), std::string::npos) << older.status();
    EXPECT_NE(older.status().message().find("Upgrade the pool"), std::string::npos) << older.status();
  }
  // Each of these round-trips 960 blocks of 2 KiB in one gather (over tcp eight eager replies of
  // 240 KiB, each nearly filling the 256 KiB segments of both ends).
  for (const auto& [tls, seg] : {std::pair{"tcp", "256k"}, std::pair{"sm,self", "64k"}}) {
    ScopedEnv transport("UCX_TLS", tls), rx_seg("UCX_TCP_RX_SEG_SIZE", seg);
    auto s = ConnectPoolKvStore({.address = pool->address(), .token = kAlice, .transport = PoolTransport::kUcx,
                                 .first_extent_chunks = 160});
    ASSERT_TRUE(s.ok()) << tls << ": " << s.status();
    auto seq = (*s)->Open(kLayout);
    ASSERT_TRUE(seq.ok()) << seq.status();
    std::vector<ChunkRef> refs;
    for (int64_t c = 0; c < 160; ++c) {
      for (int32_t l = 0; l < kLayout.n_layers; ++l) {
        for (int32_t h = 0; h < kLayout.n_kv_heads; ++h) refs.push_back({l, h, c});
      }
    }
    for (const ChunkRef& r : refs) ASSERT_TRUE((*s)->Write(*seq, r, BlockFor(5, r).data()).ok());
    std::vector<float> dst(refs.size() * (kLayout.block_bytes() / 4));
    auto id = (*s)->Gather(*seq, refs, dst.data(), Priority::kUrgent);
    ASSERT_TRUE(id.ok() && (*s)->Wait(*id).ok()) << tls;
    for (size_t i = 0; i < refs.size(); ++i) {
      ASSERT_EQ(std::memcmp(dst.data() + i * (kLayout.block_bytes() / 4), BlockFor(5, refs[i]).data(),
                            (kLayout.block_bytes() / 4) * sizeof(float)), 0) << tls << " block " << i;
    }
  }
  int status = 0;
  EXPECT_EQ(waitpid(pool->pid(), &status, WNOHANG), 0) << "the pool exited";
}

// Over tcp a gather's reply travels as eager messages that fit the tcp receive segment (no
// rendezvous round trip): with 1 MiB segments 40 blocks of 64 KiB go as three replies of 14, 14
// and 12 blocks, all eager; with 64 KiB segments no block fits, and two rendezvous replies carry
// them. (The data path reads $DD_UCX_EAGER and $DD_UCX_PIECES once per process; no test sets them.)
// Byte-exact either way, counted by the pool's metrics.
TEST(PoolProcessTest, UcxTcpRepliesGoEagerWhenTheyFitASegment) {
  ScopedEnv any_tls("UCX_TLS", nullptr), pieces("DD_UCX_PIECES", nullptr), eager("DD_UCX_EAGER", nullptr);
  ScopedEnv rx("UCX_TCP_RX_SEG_SIZE", nullptr), tx("UCX_TCP_TX_SEG_SIZE", nullptr);
  const KvLayout big{.n_layers = 1, .n_kv_heads = 1, .head_dim = 1024, .chunk_tokens = 8};
  ASSERT_EQ((big.block_bytes() / 4) * sizeof(float), size_t{64} << 10);
  constexpr int64_t kBlocks = 40;
  for (const auto& [seg, eager_replies, gets] : {std::tuple{"1m", 3, 3}, std::tuple{"64k", 0, 2}}) {
    std::unique_ptr<PoolProcess> pool = PoolWithOwnSetting("UCX_TCP_RX_SEG_SIZE", seg);
    ASSERT_FALSE(pool->address().empty());
    ScopedEnv tcp("UCX_TLS", "tcp"), same("UCX_TCP_RX_SEG_SIZE", seg);
    auto s = ConnectPoolKvStore({.address = pool->address(), .token = kAlice, .transport = PoolTransport::kUcx,
                                 .first_extent_chunks = kBlocks});
    ASSERT_TRUE(s.ok()) << seg << ": " << s.status();
    auto seq = (*s)->Open(big);
    ASSERT_TRUE(seq.ok()) << seq.status();
    std::vector<ChunkRef> refs;
    std::vector<float> want(kBlocks * (big.block_bytes() / 4));
    std::mt19937 g(7);
    for (int64_t c = 0; c < kBlocks; ++c) {
      refs.push_back({0, 0, kBlocks - 1 - c});  // in reverse: no two lie together, so each reply is packed
      float* block = want.data() + c * (big.block_bytes() / 4);
      for (int64_t i = 0; i < (big.block_bytes() / 4); ++i) block[i] = std::uniform_real_distribution<float>(-1, 1)(g);
      ASSERT_TRUE((*s)->Write(*seq, refs.back(), block).ok());
    }
    std::vector<float> dst(want.size());
    auto id = (*s)->Gather(*seq, refs, dst.data(), Priority::kUrgent);
    ASSERT_TRUE(id.ok() && (*s)->Wait(*id).ok()) << seg;
    EXPECT_EQ(std::memcmp(dst.data(), want.data(), want.size() * sizeof(float)), 0) << seg;
    const std::string body = Scrape(pool->metrics());
    EXPECT_EQ(Sample(body, "dd_pool_ucx_eager_replies_total"), eager_replies) << seg << "\n" << body;
    EXPECT_EQ(Sample(body, R"(dd_pool_ucx_requests_total{op="get"})"), gets) << seg;
    int status = 0;
    EXPECT_EQ(waitpid(pool->pid(), &status, WNOHANG), 0) << "the pool exited";
  }
}

// Gathers in flight when the pool dies, on both UCX data paths (active messages; one-sided gets
// against a pool run with --ucx_rma) over tcp and shared memory: the gathering thread gets
// UNAVAILABLE within the bound (UCX's peer-failure callback, the data path's deadline, or the
// lease renewal, whichever comes first), and every gather that succeeded before returned
// exactly the bytes written.
class KilledMidGatherTest : public ::testing::TestWithParam<std::tuple<UcxPath, const char*>> {};

INSTANTIATE_TEST_SUITE_P(PathsAndTransports, KilledMidGatherTest,
                         ::testing::Combine(::testing::Values(UcxPath::kActiveMessages, UcxPath::kRma),
                                            ::testing::Values("tcp", "sm,self")),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == UcxPath::kRma ? "rma_" : "am_") +
                                  (std::get<1>(info.param)[0] == 't' ? "tcp" : "sm");
                         });

TEST_P(KilledMidGatherTest, GathersInFlightFailWithUnavailable) {
  const auto [path, tls] = GetParam();
  PoolProcess pool(/*lease_ttl_ms=*/600, "8MiB",
                   path == UcxPath::kRma ? std::vector<std::string>{"--ucx_tcp", "--ucx_rma", "--ucx_rma_unconfined"}
                                         : std::vector<std::string>{"--ucx_tcp"});
  absl::StatusOr<std::unique_ptr<KvStore>> s;
  {
    ScopedEnv transport("UCX_TLS", tls);  // read when the store's UCX context is made
    s = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                            .ucx_path = path, .first_extent_chunks = 4});
  }
  ASSERT_TRUE(s.ok()) << s.status();
  KvStore& store = **s;
  auto seq = store.Open(kLayout);
  ASSERT_TRUE(seq.ok()) << seq.status();
  const int64_t chunks = 40;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int32_t l = 0; l < 3; ++l) {
      for (int32_t h = 0; h < 2; ++h) ASSERT_TRUE(store.Write(*seq, {l, h, c}, BlockFor(5, {l, h, c}).data()).ok());
    }
  }
  std::atomic<int> gathers{0}, mismatches{0};
  std::atomic<bool> finished{false}, stop{false};
  absl::Status failure;  // the thread's; read after the join
  std::thread gatherer([&] {
    std::mt19937 g(11);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!stop && std::chrono::steady_clock::now() < give_up) {
      std::vector<ChunkRef> refs;
      for (int i = 0; i < 96; ++i) {
        refs.push_back({static_cast<int32_t>(g() % 3), static_cast<int32_t>(g() % 2), static_cast<int64_t>(g() % chunks)});
      }
      std::vector<float> dst(refs.size() * (kLayout.block_bytes() / 4));
      auto id = store.Gather(*seq, refs, dst.data(), Priority::kUrgent);
      absl::Status st = id.ok() ? store.Wait(*id) : id.status();
      if (!st.ok()) {
        failure = st;
        break;
      }
      for (size_t i = 0; i < refs.size(); ++i) {
        if (std::memcmp(&dst[i * (kLayout.block_bytes() / 4)], BlockFor(5, refs[i]).data(),
                        (kLayout.block_bytes() / 4) * sizeof(float)) != 0) {
          ++mismatches;
        }
      }
      ++gathers;
    }
    finished = true;
  });
  // Kill the pool while the thread is gathering back to back.
  const auto start_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (gathers < 20 && !finished && std::chrono::steady_clock::now() < start_deadline) std::this_thread::yield();
  if (gathers < 20) {
    stop = true;
    gatherer.join();
    FAIL() << "gathers did not get going: " << failure;
  }
  pool.Kill(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  while (!finished && std::chrono::steady_clock::now() - killed < std::chrono::seconds(15)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto took = std::chrono::steady_clock::now() - killed;
  gatherer.join();  // it gives up by itself after 20 s at the latest
  EXPECT_EQ(failure.code(), absl::StatusCode::kUnavailable) << failure;
  EXPECT_LT(took, std::chrono::seconds(8));
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace dd::kvpool
