// Tenant isolation (docs/decisions/0019-ucx-active-messages.md): over UCX a tenant reaches its own
// region and nothing else, whatever the transport (tcp, shared memory). Runs the real dd-kv-pool;
// the attacker is tenant bob with his own valid handshake, using the real client and raw active
// messages he crafts himself.
#include <sys/wait.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <random>

#include "gtest/gtest.h"
#include "kv-pool/client/data_path.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/client/ucx_protocol.h"
#include "kv-pool/server/pool_process.h"

namespace dd::kvpool {
namespace {

using testing_util::kAlice;
using testing_util::kBob;
using testing_util::PoolProcess;
using testing_util::Sample;
using testing_util::Scrape;
namespace wire = ucxproto;

v1::HandshakeResponse Handshake(PoolProcess& pool, const char* token) {
  v1::HandshakeResponse hs;
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + token);
  v1::HandshakeRequest req;
  req.set_ucx_shm_settings(UcxSharedMemorySettings());  // as a ucx:// worker does
  req.set_ucx_tcp_settings(UcxTcpSettings());
  EXPECT_TRUE(pool.Stub()->Handshake(&ctx, req, &hs).ok());
  return hs;
}

// An attacker's own UCX endpoint to the pool: sends any header and data under any AM id and
// waits (with a deadline) for the pool's reply code.
class RawAm {
 public:
  explicit RawAm(const std::string& pool_address) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    // The pool's own shared-memory settings: a mismatch crashes the pool inside UCX, which an
    // attacker on the pool's uid could do more simply (ucx_config.h); this test is about offsets.
    absl::StatusOr<ucp_config_t*> config = ReadUcxConfig();
    ok_ = config.ok() && ucp_init(&params, *config, &context_) == UCS_OK;
    if (config.ok()) ucp_config_release(*config);
    ucp_worker_params_t wp{};
    ok_ = ok_ && ucp_worker_create(context_, &wp, &worker_) == UCS_OK;
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = wire::kReplyId;
    hp.arg = this;
    hp.cb = [](void* arg, const void* header, size_t length, void* data, size_t data_length,
               const ucp_am_recv_param_t* param) {
      auto* self = static_cast<RawAm*>(arg);
      wire::Reply r;
      if (length == sizeof(r)) {
        std::memcpy(&r, header, sizeof(r));
        self->reply_ = r.code;
        ++self->codes_[r.code];
        self->reply_bytes_ = data_length;
        self->reply_rndv_ = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
        const auto* bytes = static_cast<const uint8_t*>(data);
        if (self->reply_rndv_) self->reply_data_.clear();
        else self->reply_data_.assign(bytes, bytes + data_length);
      }
      // A hoarder keeps the blocks of a rendezvous reply and never takes them: the pool's send
      // never completes.
      if (!self->hoard_ || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) return UCS_OK;
      self->held_.push_back(data);
      return UCS_INPROGRESS;
    };
    ok_ = ok_ && ucp_worker_set_am_recv_handler(worker_, &hp) == UCS_OK;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(pool_address.data());
    ok_ = ok_ && ucp_ep_create(worker_, &ep, &ep_) == UCS_OK;
  }
  ~RawAm() {
    for (void* d : held_) ucp_am_data_release(worker_, d);
    if (ep_ != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      Wait(ucp_ep_close_nbx(ep_, &p));
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }
  bool ok() const { return ok_; }
  // The last reply: its data's length, whether it came by rendezvous (its data then dropped),
  // else its data.
  size_t reply_bytes() const { return reply_bytes_; }
  bool reply_rndv() const { return reply_rndv_; }
  const std::vector<uint8_t>& reply_data() const { return reply_data_; }
  void set_hoard(bool on) { hoard_ = on; }
  // Replies seen per status code.
  int replies(absl::StatusCode code) const {
    auto it = codes_.find(static_cast<int32_t>(code));
    return it == codes_.end() ? 0 : it->second;
  }
  int replies() const {  // all of them
    int n = 0;
    for (const auto& [code, count] : codes_) n += count;
    return n;
  }

  // Sends `n` copies of a message without waiting for replies, then progresses until every send
  // is done and `want` replies came, or `wait` passed.
  void Flood(int n, unsigned id, const void* header, size_t header_bytes, const void* data, size_t data_bytes,
             int want, std::chrono::milliseconds wait) {
    std::vector<ucs_status_ptr_t> sent;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    for (int i = 0; i < n; ++i) sent.push_back(ucp_am_send_nbx(ep_, id, header, header_bytes, data, data_bytes, &p));
    const auto deadline = std::chrono::steady_clock::now() + wait;
    auto done = [&] {
      int seen = 0;
      for (const auto& [code, count] : codes_) seen += count;
      if (seen < want) return false;
      for (ucs_status_ptr_t r : sent) {
        if (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      }
      return true;
    };
    while (!done() && std::chrono::steady_clock::now() < deadline) ucp_worker_progress(worker_);
    for (ucs_status_ptr_t r : sent) {
      if (r != nullptr && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);
    }
  }

  // Progresses the worker for `wait` (takes what comes; a hoarder keeps rendezvous replies).
  void Progress(std::chrono::milliseconds wait) {
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (std::chrono::steady_clock::now() < deadline) ucp_worker_progress(worker_);
  }

  // The pool's reply code, or nullopt when none came within `wait`. `rndv`: the data goes by
  // rendezvous whatever its size.
  std::optional<absl::StatusCode> Send(unsigned id, const void* header, size_t header_bytes, const void* data,
                                       size_t data_bytes, std::chrono::milliseconds wait = std::chrono::seconds(3),
                                       bool rndv = false) {
    reply_.reset();
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | (rndv ? UCP_AM_SEND_FLAG_RNDV : 0);
    Wait(ucp_am_send_nbx(ep_, id, header, header_bytes, data, data_bytes, &p));
    const auto deadline = std::chrono::steady_clock::now() + wait;
    while (!reply_ && std::chrono::steady_clock::now() < deadline) ucp_worker_progress(worker_);
    if (!reply_) return std::nullopt;
    return static_cast<absl::StatusCode>(*reply_);
  }

 private:
  void Wait(ucs_status_ptr_t r) {
    if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);
  }
  bool ok_ = false;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::optional<int32_t> reply_;
  size_t reply_bytes_ = 0;
  bool reply_rndv_ = false;
  std::vector<uint8_t> reply_data_;
  std::map<int32_t, int> codes_;
  bool hoard_ = false;
  std::vector<void*> held_;  // rendezvous replies kept, released at the end
};

class UcxIsolationTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { setenv("UCX_TLS", GetParam(), 1); }  // read by the pool and the clients
  void TearDown() override { unsetenv("UCX_TLS"); }
  // The pool serves tcp only when told (ucx_tcp_exposure_test).
  static std::vector<std::string> PoolFlags() {
    return std::string(GetParam()) == "tcp" ? std::vector<std::string>{"--ucx_tcp"} : std::vector<std::string>{};
  }
  // A pool, Bob's Handshake (he attacks with active messages he crafts) and Alice's data path
  // (the tenant that must go on being served).
  void StartPool() {
    pool_ = std::make_unique<PoolProcess>(30000, "8MiB", PoolFlags());
    ASSERT_FALSE(pool_->address().empty());
    bob_hs_ = Handshake(*pool_, kBob);
    auto alice = NewUcxDataPath(Handshake(*pool_, kAlice), 5000, UcxPath::kAuto, true);
    ASSERT_TRUE(alice.ok()) << alice.status();
    alice_ = std::move(*alice);
  }
  // A get under Bob's session.
  wire::GetRequest BobsGet(uint32_t count, int64_t block_bytes, uint32_t flags) const {
    wire::GetRequest get;
    std::memcpy(get.session, bob_hs_.ucx_session().data(), wire::kSessionBytes);
    get.count = count;
    get.block_bytes = block_bytes;
    get.flags = flags;
    return get;
  }
  // A put under Bob's session.
  wire::PutRequest BobsPut(int64_t offset, int64_t bytes) const {
    wire::PutRequest put;
    std::memcpy(put.session, bob_hs_.ucx_session().data(), wire::kSessionBytes);
    put.offset = offset;
    put.bytes = bytes;
    return put;
  }
  std::unique_ptr<PoolProcess> pool_;
  v1::HandshakeResponse bob_hs_;
  std::unique_ptr<DataPath> alice_;  // destroyed before the pool
};

INSTANTIATE_TEST_SUITE_P(Transports, UcxIsolationTest, ::testing::Values("tcp", "sm,self"),
                         [](const auto& info) { return std::string(info.param[0] == 't' ? "tcp" : "sm"); });

constexpr int64_t kBlock = 4096;

// A put and a get of one block round-trip on `path`: the pool still serves that tenant.
void ExpectServed(DataPath& path, float value) {
  std::vector<float> secret(kBlock / sizeof(float), value), got(kBlock / sizeof(float), 0.0f);
  ASSERT_TRUE(path.Put(0, secret.data(), kBlock).ok());
  void* dst = got.data();
  ASSERT_TRUE(path.Get({0}, kBlock, {&dst, 1}).ok());
  EXPECT_EQ(got, secret);
}

TEST_P(UcxIsolationTest, ATenantReachesOnlyItsOwnRegion) {
  PoolProcess pool(30000, "8MiB", PoolFlags());
  ASSERT_FALSE(pool.address().empty());
  const v1::HandshakeResponse alice_hs = Handshake(pool, kAlice), bob_hs = Handshake(pool, kBob);
  // No one-sided access is offered: no remote key, no address of the pool's memory.
  EXPECT_TRUE(bob_hs.ucx_rkey().empty());
  EXPECT_EQ(bob_hs.remote_base(), 0u);
  ASSERT_EQ(bob_hs.ucx_session().size(), static_cast<size_t>(wire::kSessionBytes));
  EXPECT_NE(bob_hs.ucx_session(), alice_hs.ucx_session());
  EXPECT_EQ(NewUcxDataPath(bob_hs, 3000, UcxPath::kRma, true).status().code(), absl::StatusCode::kFailedPrecondition);

  auto alice = NewUcxDataPath(alice_hs, 3000, UcxPath::kAuto, true);
  auto bob = NewUcxDataPath(bob_hs, 3000, UcxPath::kAuto, true);
  ASSERT_TRUE(alice.ok() && bob.ok()) << alice.status() << bob.status();
  std::vector<float> secret(kBlock / sizeof(float), 42.5f), got(kBlock / sizeof(float), -1.0f);
  void* dst = got.data();
  ASSERT_TRUE((*alice)->Put(0, secret.data(), kBlock).ok());

  // The same offset names bob's own (still zero) region, never alice's bytes.
  ASSERT_TRUE((*bob)->Get({0}, kBlock, {&dst, 1}).ok());
  EXPECT_EQ(got, std::vector<float>(got.size(), 0.0f));
  // Outside his region (past its end, negative, overflowing) is refused, gets and puts alike.
  const int64_t end = bob_hs.region_bytes();
  for (int64_t off : {end, end - kBlock + 1, int64_t{-kBlock}, int64_t{1} << 40, INT64_MAX - 8, INT64_MIN}) {
    EXPECT_EQ((*bob)->Get({off}, kBlock, {&dst, 1}).code(), absl::StatusCode::kOutOfRange) << off;
    EXPECT_EQ((*bob)->Put(off, secret.data(), kBlock).code(), absl::StatusCode::kOutOfRange) << off;
  }

  // Raw messages bob crafts himself.
  RawAm raw(bob_hs.ucx_worker_address());
  ASSERT_TRUE(raw.ok());
  wire::GetRequest get;
  std::memcpy(get.session, bob_hs.ucx_session().data(), wire::kSessionBytes);
  get.count = 1;
  get.block_bytes = kBlock;
  int64_t offsets[2] = {0, 0};
  EXPECT_EQ(raw.Send(wire::kGetId, &get, sizeof(get), offsets, 8), absl::StatusCode::kOk);  // well formed
  wire::GetRequest forged = get;
  forged.session[0] ^= 1;  // a session the pool never issued
  EXPECT_EQ(raw.Send(wire::kGetId, &forged, sizeof(forged), offsets, 8), absl::StatusCode::kUnauthenticated);
  wire::GetRequest huge = get;  // count × block_bytes overflowing 64 bits
  huge.count = 2;
  huge.block_bytes = INT64_MAX / 2 + 1;
  EXPECT_EQ(raw.Send(wire::kGetId, &huge, sizeof(huge), offsets, 16), absl::StatusCode::kInvalidArgument);
  wire::GetRequest lying = get;  // says 2 offsets, sends 1
  lying.count = 2;
  EXPECT_EQ(raw.Send(wire::kGetId, &lying, sizeof(lying), offsets, 8), absl::StatusCode::kInvalidArgument);
  wire::GetRequest many = get;
  many.count = wire::kMaxBlocksPerGet + 1;
  EXPECT_EQ(raw.Send(wire::kGetId, &many, sizeof(many), offsets, 16), absl::StatusCode::kInvalidArgument);
  wire::GetRequest bad_magic = get;
  bad_magic.magic = 0;
  EXPECT_EQ(raw.Send(wire::kGetId, &bad_magic, sizeof(bad_magic), offsets, 8), absl::StatusCode::kInvalidArgument);
  wire::PutRequest put;
  std::memcpy(put.session, bob_hs.ucx_session().data(), wire::kSessionBytes);
  put.offset = 0;
  put.bytes = kBlock * 2;  // more than it carries
  EXPECT_EQ(raw.Send(wire::kPutId, &put, sizeof(put), secret.data(), kBlock), absl::StatusCode::kInvalidArgument);
  put.bytes = kBlock;
  put.offset = end;
  EXPECT_EQ(raw.Send(wire::kPutId, &put, sizeof(put), secret.data(), kBlock), absl::StatusCode::kOutOfRange);
  const char junk[3] = {1, 2, 3};  // a header of the wrong size: dropped, no reply
  EXPECT_EQ(raw.Send(wire::kGetId, junk, sizeof(junk), nullptr, 0, std::chrono::milliseconds(500)), std::nullopt);

  // One-sided access with a key of the right shape (from another pool run with --ucx_rma, at
  // this pool's own address): the pool has no RMA feature, so nothing serves it.
  {
    std::vector<std::string> flags = PoolFlags();
    flags.push_back("--ucx_rma");
    flags.push_back("--ucx_rma_unconfined");
    PoolProcess rma_pool(30000, "8MiB", flags);
    const v1::HandshakeResponse other = Handshake(rma_pool, kBob);
    ASSERT_FALSE(other.ucx_rkey().empty());
    v1::HandshakeResponse spliced = bob_hs;
    spliced.set_ucx_rkey(other.ucx_rkey());
    spliced.set_remote_base(other.remote_base());
    auto rma = NewUcxDataPath(spliced, 1000, UcxPath::kRma, true);
    if (rma.ok()) {
      std::vector<float> probe(got.size(), -1.0f);
      void* pdst = probe.data();
      (void)(*rma)->Get({0}, kBlock, {&pdst, 1});  // fails or times out; must not read alice's bytes
      EXPECT_NE(probe, secret);
    }
  }

  // The pool is alive and alice's bytes are intact.
  ASSERT_TRUE((*alice)->Get({0}, kBlock, {&dst, 1}).ok());
  EXPECT_EQ(got, secret);
}

// Gathers large enough for rendezvous come back byte-exact in any order, into scattered
// destinations: over tcp the pool packs the reply and the worker receives it staged (a buffer
// kept for the next reply up to 4 MiB, fresh above); over shared memory an iov both ways.
TEST_P(UcxIsolationTest, LargeGathersComeBackExactlyInAnyOrder) {
  PoolProcess pool(30000, "8MiB", PoolFlags());
  auto alice = NewUcxDataPath(Handshake(pool, kAlice), 5000, UcxPath::kAuto, true);
  ASSERT_TRUE(alice.ok()) << alice.status();
  constexpr int64_t kBig = 16384, kStored = 384;  // 6 MiB of alice's 8
  const int64_t floats = kBig / sizeof(float);
  std::vector<float> stored(kStored * floats);
  for (size_t i = 0; i < stored.size(); ++i) stored[i] = static_cast<float>(i % 100003) * 0.5f - 7.0f;
  ASSERT_TRUE((*alice)->Put(0, stored.data(), kStored * kBig).ok());
  std::mt19937 g(7);
  for (int64_t n : {int64_t{64}, int64_t{64}, int64_t{320}, int64_t{3}}) {  // 1 MiB twice, 5 MiB, 48 KiB
    std::vector<int64_t> blocks(kStored);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::shuffle(blocks.begin(), blocks.end(), g);
    blocks.resize(n);
    std::vector<int64_t> offsets;
    for (int64_t b : blocks) offsets.push_back(b * kBig);
    std::vector<float> got(n * floats, -1.0f);
    std::vector<void*> dsts;  // block i lands in slot n-1-i
    for (int64_t i = 0; i < n; ++i) dsts.push_back(&got[(n - 1 - i) * floats]);
    ASSERT_TRUE((*alice)->Get(offsets, kBig, dsts).ok()) << n;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(dsts[i], &stored[blocks[i] * floats], kBig), 0) << "block " << i << " of " << n;
    }
  }
}

// A tenant that floods gets and never takes the replies holds one of the pool's sends and at
// most 256 waiting replies (the rest refused, RESOURCE_EXHAUSTED); another tenant's gathers still
// come through (reply_queue.h: a stalled send stops counting against the others after 500 ms).
TEST_P(UcxIsolationTest, AHoardingTenantDoesNotStallAnother) {
  ASSERT_NO_FATAL_FAILURE(StartPool());
  std::vector<float> secret(kBlock / sizeof(float), 3.25f), got(kBlock / sizeof(float), 0.0f);
  ASSERT_TRUE(alice_->Put(0, secret.data(), kBlock).ok());

  RawAm bob(bob_hs_.ucx_worker_address());
  ASSERT_TRUE(bob.ok());
  bob.set_hoard(true);
  constexpr int kBlocks = 64, kSent = 300;
  constexpr int kHeld = 1, kQueued = 256;  // reply_queue.h's limits per endpoint
  // 1 MiB of reply: rendezvous on every transport.
  const wire::GetRequest get = BobsGet(kBlocks, 16384, wire::kPackReply);
  std::vector<int64_t> offsets(kBlocks);
  for (int i = 0; i < kBlocks; ++i) offsets[i] = (i * 7 % kBlocks) * get.block_bytes;  // not adjacent: packed
  bob.Flood(kSent, wire::kGetId, &get, sizeof(get), offsets.data(), offsets.size() * sizeof(int64_t),
            kHeld + (kSent - kHeld - kQueued), std::chrono::seconds(10));
  EXPECT_EQ(bob.replies(absl::StatusCode::kResourceExhausted), kSent - kHeld - kQueued);
  EXPECT_EQ(bob.replies(absl::StatusCode::kOk), kHeld);  // the held reply's header

  const auto start = std::chrono::steady_clock::now();
  void* dst = got.data();
  ASSERT_TRUE(alice_->Get({0}, kBlock, {&dst, 1}).ok());
  EXPECT_EQ(got, secret);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
}

// Over tcp the pool sends a reply eager when the worker asks and it fits the tcp segment
// (UcxEagerReplyBytes); a larger one, or any over a pool that serves no tcp, goes by rendezvous
// whatever the worker asked (a 64 MiB eager reply would be reassembled by UCX, and over shared
// memory copied through the FIFO by the pool's thread alone). Both arrive whole.
TEST_P(UcxIsolationTest, EagerRepliesOnlyAsLargeAsATcpSegment) {
  ASSERT_NO_FATAL_FAILURE(StartPool());
  const bool tcp = std::string(GetParam()) == "tcp";
  RawAm bob(bob_hs_.ucx_worker_address());
  ASSERT_TRUE(bob.ok());
  constexpr int64_t kBlocks = 64, kBytes = 16384;
  std::vector<uint8_t> pattern(kBlocks * kBytes);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 / 7);
  for (int64_t b = 0; b < kBlocks; ++b) {
    const wire::PutRequest put = BobsPut(b * kBytes, kBytes);
    ASSERT_EQ(bob.Send(wire::kPutId, &put, sizeof(put), pattern.data() + b * kBytes, kBytes),
              absl::StatusCode::kOk);
  }
  // 32 blocks in reverse (512 KiB): eager over tcp, byte-exact.
  wire::GetRequest get = BobsGet(32, kBytes, wire::kPackReply | wire::kEagerReply);
  std::vector<int64_t> offsets(get.count);
  for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = (kBlocks - 1 - 2 * i) * kBytes;
  int ok = bob.replies(absl::StatusCode::kOk);
  bob.Flood(1, wire::kGetId, &get, sizeof(get), offsets.data(), offsets.size() * sizeof(int64_t), bob.replies() + 1,
            std::chrono::seconds(10));  // the request eager, as the pool wants it
  ASSERT_EQ(bob.replies(absl::StatusCode::kOk), ++ok);
  EXPECT_EQ(bob.reply_bytes(), size_t{32} * kBytes);
  EXPECT_EQ(bob.reply_rndv(), !tcp);
  if (tcp) {
    ASSERT_EQ(bob.reply_data().size(), size_t{32} * kBytes);
    for (size_t i = 0; i < offsets.size(); ++i) {
      ASSERT_EQ(std::memcmp(bob.reply_data().data() + i * kBytes, pattern.data() + offsets[i], kBytes), 0) << i;
    }
  }
  // 4096 blocks (64 MiB, the most a get may ask): by rendezvous on either transport.
  get.count = wire::kMaxBlocksPerGet;
  offsets.resize(get.count);
  for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = (i * 7 % kBlocks) * kBytes;
  bob.Flood(1, wire::kGetId, &get, sizeof(get), offsets.data(), offsets.size() * sizeof(int64_t), bob.replies() + 1,
            std::chrono::seconds(20));
  EXPECT_EQ(bob.replies(absl::StatusCode::kOk), ++ok);
  EXPECT_EQ(bob.reply_bytes(), static_cast<size_t>(wire::kMaxReplyBytes));
  EXPECT_TRUE(bob.reply_rndv());

  ExpectServed(*alice_, 1.5f);
}

// A tenant that hoards replies on many endpoints holds at most 256 MiB of the pool's packed
// copies between them: each endpoint's one reply in flight keeps its copy for as long as the
// tenant does not take it, and the stall rule lets further replies go (reply_queue.h), so before
// this budget eight endpoints pinned 8 x 64 MiB. Another tenant's gathers still come through.
TEST_P(UcxIsolationTest, AHoardingTenantHoldsABoundedShareOfThePoolsMemory) {
  ASSERT_NO_FATAL_FAILURE(StartPool());
  // 64 MiB packed: rendezvous, hoarded.
  const wire::GetRequest get =
      BobsGet(wire::kMaxBlocksPerGet, wire::kMaxReplyBytes / wire::kMaxBlocksPerGet, wire::kPackReply);
  std::vector<int64_t> offsets(get.count);
  for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = (i * 7 % 64) * get.block_bytes;
  constexpr int kEndpoints = 8;
  constexpr double kBudget = 256 << 20, kReply = wire::kMaxReplyBytes;
  static_assert(kEndpoints * kReply > kBudget, "without the budget all would have been held");
  std::vector<std::unique_ptr<RawAm>> bob;
  for (int i = 0; i < kEndpoints; ++i) {
    bob.push_back(std::make_unique<RawAm>(bob_hs_.ucx_worker_address()));
    ASSERT_TRUE(bob.back()->ok());
    bob.back()->set_hoard(true);
  }
  // Each endpoint asks once; the pool sends what the budget allows (two at a time, then more
  // as the first stall), the rest wait unpacked. Give the stall rule time to let them all go.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(4);
  for (auto& b : bob) {
    b->Flood(1, wire::kGetId, &get, sizeof(get), offsets.data(), offsets.size() * sizeof(int64_t), 0,
             std::chrono::milliseconds(1));
  }
  double held = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    for (auto& b : bob) b->Progress(std::chrono::milliseconds(20));
    held = std::max(held, Sample(Scrape(pool_->metrics()), "dd_pool_ucx_reply_bytes_held"));
  }
  EXPECT_EQ(held, kBudget) << "the most the pool held for bob's replies, in bytes";

  ExpectServed(*alice_, 4.5f);
}

// Requests whose data comes by rendezvous and that the pool refuses (a get's offsets must come
// eager; a put out of range, with a forged session, or with a malformed header) are dropped
// without harm: the pool answers what it can and goes on serving. It once released such data
// inside UCX's callback and then returned UCS_OK, so UCX released it again: over shared memory
// the first such request crashed the pool.
TEST_P(UcxIsolationTest, RefusedRendezvousRequestsLeaveThePoolServing) {
  ASSERT_NO_FATAL_FAILURE(StartPool());
  RawAm bob(bob_hs_.ucx_worker_address());
  ASSERT_TRUE(bob.ok());

  const wire::GetRequest get = BobsGet(wire::kMaxBlocksPerGet, kBlock, 0);  // 32 KiB of offsets, sent by rendezvous
  std::vector<int64_t> offsets(get.count, 0);
  constexpr auto kWait = std::chrono::seconds(3);
  EXPECT_EQ(bob.Send(wire::kGetId, &get, sizeof(get), offsets.data(), offsets.size() * sizeof(int64_t), kWait, true),
            absl::StatusCode::kInvalidArgument);

  std::vector<uint8_t> bytes(size_t{1} << 20, 0x5a);
  wire::PutRequest put = BobsPut(bob_hs_.region_bytes(), static_cast<int64_t>(bytes.size()));  // just past his region
  EXPECT_EQ(bob.Send(wire::kPutId, &put, sizeof(put), bytes.data(), bytes.size(), kWait, true),
            absl::StatusCode::kOutOfRange);
  put.offset = 0;
  put.session[0] ^= 1;
  EXPECT_EQ(bob.Send(wire::kPutId, &put, sizeof(put), bytes.data(), bytes.size(), kWait, true),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(bob.Send(wire::kPutId, &put, sizeof(put) - 1, bytes.data(), bytes.size(), std::chrono::milliseconds(300), true),
            std::nullopt);  // nothing to answer: the header is not a PutRequest

  ExpectServed(*alice_, 2.5f);
  int status = 0;
  EXPECT_EQ(waitpid(pool_->pid(), &status, WNOHANG), 0) << "the pool exited";
}

}  // namespace
}  // namespace dd::kvpool
