#include "kv-pool/client/pool_kv_store.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "kv-pool/client/data_path.h"
#include "kv-pool/client/transfer_queue.h"
#include "kv-pool/client/ucx_config.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool {
namespace {

absl::Status FromGrpc(const grpc::Status& st, absl::string_view what) {
  if (st.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), absl::StrCat("kv pool ", what, ": ", st.error_message()));
}

std::unique_ptr<v1::KvPool::Stub> NewStub(const PoolClientOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args;
  if (!options.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    creds = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  }
  return v1::KvPool::NewStub(grpc::CreateCustomChannel(options.address, creds, args));
}

class PoolKvStore : public KvStore {
 public:
  PoolKvStore(const PoolClientOptions& o, std::unique_ptr<v1::KvPool::Stub> stub)
      : options_(o), stub_(std::move(stub)), queue_(o.link, o.transfer_lanes) {}

  ~PoolKvStore() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    renew_cv_.notify_all();
    if (renewer_.joinable()) renewer_.join();
    queue_.Drain();
    std::vector<SequenceId> ids;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.ok()) {  // a lost pool is not waited for; its leases expire there
        for (const auto& [id, s] : seqs_) ids.push_back(id);
      }
    }
    for (SequenceId id : ids) (void)Release(id);
  }

  absl::Status Recover() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.ok()) return absl::OkStatus();
      stop_ = true;
    }
    renew_cv_.notify_all();
    if (renewer_.joinable()) renewer_.join();
    queue_.Drain();  // transfers of the old connection fail fast (the data path is aborted)
    std::vector<uint64_t> stale;  // the pool's ids of the old connection's sequences
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [id, seq] : seqs_) stale.push_back(seq.remote);
      seqs_.clear();  // they lived in the lost pool (its leases expire there, if it comes back)
      bytes_ = 0;
      stop_ = false;
    }
    const uint64_t old_instance = instance_;
    data_.reset();
    lost_.store(false, std::memory_order_release);
    if (options_.locate) {  // the pool may be back elsewhere
      absl::StatusOr<std::string> uri = options_.locate();
      const std::string scheme = options_.transport == PoolTransport::kShm ? "shm://" : "ucx://";
      if (uri.ok() && absl::StartsWith(*uri, scheme) && uri->substr(scheme.size()) != options_.address) {
        LOG(INFO) << "kv pool: " << options_.address << " is replaced by " << *uri;
        std::lock_guard<std::mutex> lock(mu_);
        options_.address = uri->substr(scheme.size());
        stub_ = NewStub(options_);
      }
    }
    absl::Status st = Connect();
    if (st.ok() && instance_ == old_instance) {
      // The same pool process: only the connection broke. What the old sequences hold is
      // freed now rather than when their leases run out, so the rebuilt requests fit its quota.
      for (uint64_t remote : stale) {
        v1::ReleaseRequest req;
        req.set_sequence(remote);
        v1::ReleaseResponse resp;
        (void)Call("release", [&](grpc::ClientContext* c) { return stub_->Release(c, req, &resp); });
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!st.ok()) {
      lost_.store(true, std::memory_order_release);
      return absl::UnavailableError(absl::StrCat("kv pool at ", options_.address, " not back yet: ", st.message()));
    }
    broken_ = absl::OkStatus();
    return absl::OkStatus();
  }

  absl::Status Connect() {
    v1::HandshakeResponse hs;
    v1::HandshakeRequest hr;
    if (options_.transport == PoolTransport::kUcx) {
      hr.set_ucx_shm_settings(UcxSharedMemorySettings());
      hr.set_ucx_tcp_settings(UcxTcpSettings());
    }
    RETURN_IF_ERROR(Call("handshake", [&](grpc::ClientContext* c) { return stub_->Handshake(c, hr, &hs); }));
    auto path = options_.transport == PoolTransport::kShm ? NewShmDataPath(hs, options_.token)
                                                          : NewUcxDataPath(hs, options_.rpc_timeout_ms, options_.ucx_path,
                                                                           NamesThisHost(options_.address));
    if (!path.ok()) return path.status();
    data_ = std::move(*path);
    data_->set_abort(&lost_);
    ttl_ms_ = hs.lease_ttl_ms();
    capacity_.store(hs.region_bytes(), std::memory_order_relaxed);
    instance_ = hs.instance();
    renewer_ = std::thread([this] { RenewLoop(); });
    return absl::OkStatus();
  }

  absl::StatusOr<SequenceId> Open(const KvLayout& layout) override {
    if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0 || layout.chunk_tokens <= 0) {
      return absl::InvalidArgumentError("KvStore::Open: layout fields must be positive");
    }
    RETURN_IF_ERROR(Broken());
    v1::OpenRequest req;
    req.mutable_layout()->set_n_layers(layout.n_layers);
    req.mutable_layout()->set_n_kv_heads(layout.n_kv_heads);
    req.mutable_layout()->set_head_dim(layout.head_dim);
    req.mutable_layout()->set_chunk_tokens(layout.chunk_tokens);
    req.mutable_layout()->set_dtype(static_cast<int64_t>(layout.dtype));
    req.set_chunks(options_.first_extent_chunks);
    v1::OpenResponse resp;
    RETURN_IF_ERROR(Call("open", [&](grpc::ClientContext* c) { return stub_->Open(c, req, &resp); }));
    RETURN_IF_ERROR(SamePool(resp.instance()));
    std::lock_guard<std::mutex> lock(mu_);
    const SequenceId id = ++next_local_;
    Seq& s = seqs_[id];
    s.remote = resp.sequence();
    s.layout = layout;
    AddExtent(s, resp.extent());
    return id;
  }

  absl::Status Write(SequenceId seq, const ChunkRef& ref, const void* block) override {
    RETURN_IF_ERROR(Broken());
    std::unique_lock<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(Seq * s, Find(seq));
    RETURN_IF_ERROR(CheckChunkRef(s->layout, ref));
    if (s->read_only) return absl::FailedPreconditionError("KvStore: a prefix handle is read-only");
    while (ref.chunk >= s->capacity) {  // grow: double the chunks held so far
      v1::ExtendRequest req;
      req.set_sequence(s->remote);
      req.set_chunks(std::max(s->capacity, ref.chunk + 1 - s->capacity));
      lock.unlock();
      v1::ExtendResponse resp;
      RETURN_IF_ERROR(Call("extend", [&](grpc::ClientContext* c) { return stub_->Extend(c, req, &resp); }));
      RETURN_IF_ERROR(SamePool(resp.instance()));
      lock.lock();
      ASSIGN_OR_RETURN(s, Find(seq));
      AddExtent(*s, resp.extent());
    }
    const int64_t bytes = s->layout.block_bytes();
    const int64_t offset = Offset(*s, ref);
    lock.unlock();  // the copy or put runs unlocked; blocks of one sequence do not overlap
    if (absl::Status st = data_->Put(offset, block, bytes); !st.ok()) return Lost(st);
    lock.lock();
    ASSIGN_OR_RETURN(s, Find(seq));
    const int64_t bit = BlockIndex(s->layout, ref);
    if (bit >= static_cast<int64_t>(s->written.size())) s->written.resize(bit + 1, false);
    if (!s->written[bit]) {
      s->written[bit] = true;
      bytes_ += bytes;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<KvLayout> Layout(SequenceId seq) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return UnknownSequence(seq);
    return it->second.layout;
  }

  using KvStore::GatherTo;
  absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts,
                                      Priority priority, DstMemory memory, BlockPart part) override {
    if (memory == DstMemory::kDevice && !WritesDeviceMemory()) return NoDeviceWrites();
    const bool cuda = memory == DstMemory::kDevice;  // the data path's destinations are CUDA memory
    RETURN_IF_ERROR(DestinationsMatch(refs, dsts));
    RETURN_IF_ERROR(Broken());
    std::unique_lock<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(Seq * s, Find(seq));
    TransferQueue::Job job{{dsts.begin(), dsts.end()}, PartBytes(s->layout, part), {}, nullptr};
    std::vector<int64_t> offsets;
    for (const ChunkRef& r : refs) {
      ASSIGN_OR_RETURN(const int64_t off, WrittenOffset(*s, r));
      offsets.push_back(off + PartOffset(s->layout, part));  // the part's bytes within the block
    }
    if (data_->Mapped(0) != nullptr && !cuda) {  // shared memory: the copy engine reads the mapping
      for (int64_t off : offsets) job.src.push_back(data_->Mapped(off));
    } else {
      const int64_t bytes = job.block_bytes;
      job.fetch = [this, offsets = std::move(offsets), bytes, dsts = job.dst, cuda](size_t begin, size_t end) {
        absl::Status st = data_->Get(absl::MakeConstSpan(offsets).subspan(begin, end - begin), bytes,
                                     absl::MakeConstSpan(dsts).subspan(begin, end - begin), cuda);
        return st.ok() ? st : Lost(st);
      };
    }
    lock.unlock();  // with an infinite link the fetch runs inside Submit, and Lost() locks
    return queue_.Submit(std::move(job), priority);
  }

 public:
  bool WritesDeviceMemory() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return data_ != nullptr && data_->cuda_destinations();
  }

  // data_ changes only in Recover, which callers run with nothing else of theirs in flight
  // (the engine's thread calls both); the lock orders it against the transfer threads.
  std::vector<MappedRange> MappedRanges() const override {
    std::lock_guard<std::mutex> lock(mu_);
    if (data_ == nullptr || data_->Mapped(0) == nullptr) return {};
    return {{data_->Mapped(0), data_->mapped_bytes()}};
  }

  absl::Status BlockAddresses(SequenceId seq, absl::Span<const ChunkRef> refs, std::vector<const void*>* out) override {
    out->clear();
    RETURN_IF_ERROR(Broken());
    std::lock_guard<std::mutex> lock(mu_);
    if (data_ == nullptr || data_->Mapped(0) == nullptr) return KvStore::BlockAddresses(seq, refs, out);
    ASSIGN_OR_RETURN(Seq * s, Find(seq));
    for (const ChunkRef& r : refs) {
      const absl::StatusOr<int64_t> off = WrittenOffset(*s, r);
      if (!off.ok()) {
        out->clear();  // nothing half-answered
        return off.status();
      }
      out->push_back(data_->Mapped(*off));
    }
    return absl::OkStatus();
  }

  absl::Status Wait(TransferId id) override { return queue_.Wait(id); }

  absl::Status Release(SequenceId seq) override {
    queue_.Drain();  // queued gathers may still read the sequence's blocks
    int64_t freed = 0;
    uint64_t remote = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ASSIGN_OR_RETURN(Seq * s, Find(seq));
      if (!s->read_only) {
        for (bool w : s->written) freed += w ? s->layout.block_bytes() : 0;
      }
      bytes_ -= freed;
      remote = s->remote;
      seqs_.erase(seq);
      if (!broken_.ok()) return absl::OkStatus();  // nothing to tell a lost pool
    }
    v1::ReleaseRequest req;
    req.set_sequence(remote);
    v1::ReleaseResponse resp;
    return Call("release", [&](grpc::ClientContext* c) { return stub_->Release(c, req, &resp); });
  }

  // The pool bounds prefixes by its tenant's quota; `owner` has no role there.
  absl::Status CommitPrefix(SequenceId seq, absl::Span<const uint64_t> keys, uint64_t /*owner*/) override {
    RETURN_IF_ERROR(Broken());
    v1::CommitRequest req;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ASSIGN_OR_RETURN(Seq * s, Find(seq));
      req.set_sequence(s->remote);
    }
    for (uint64_t k : keys) req.add_block_keys(k);
    v1::CommitResponse resp;
    return Call("commit", [&](grpc::ClientContext* c) { return stub_->Commit(c, req, &resp); });
  }

  absl::StatusOr<PrefixMatch> LookupPrefix(absl::Span<const uint64_t> keys, const KvLayout& layout,
                                           int64_t block_chunks) override {
    RETURN_IF_ERROR(Broken());
    v1::LookupPrefixRequest req;
    for (uint64_t k : keys) req.add_block_keys(k);
    req.set_lease(true);
    v1::LookupPrefixResponse resp;
    RETURN_IF_ERROR(Call("lookup", [&](grpc::ClientContext* c) { return stub_->LookupPrefix(c, req, &resp); }));
    RETURN_IF_ERROR(SamePool(resp.instance()));
    if (resp.blocks() == 0) return PrefixMatch{};
    const v1::Layout& l = resp.layout();
    const int64_t chunks = resp.blocks() * block_chunks;
    int64_t capacity = 0;
    for (const v1::Extent& e : resp.extents()) capacity = std::max(capacity, e.first_chunk() + e.chunks());
    if (l.n_layers() != layout.n_layers || l.n_kv_heads() != layout.n_kv_heads || l.head_dim() != layout.head_dim ||
        l.chunk_tokens() != layout.chunk_tokens || l.dtype() != static_cast<int64_t>(layout.dtype) || chunks > capacity) {
      // Keys are namespaced by layout, so this means a foreign or corrupt entry: not reused.
      v1::ReleaseRequest rel;
      rel.set_sequence(resp.sequence());
      v1::ReleaseResponse rr;
      (void)Call("release", [&](grpc::ClientContext* c) { return stub_->Release(c, rel, &rr); });
      return PrefixMatch{};
    }
    std::lock_guard<std::mutex> lock(mu_);
    const SequenceId id = ++next_local_;
    Seq& s = seqs_[id];
    s.remote = resp.sequence();
    s.read_only = true;
    s.layout = layout;
    for (const v1::Extent& e : resp.extents()) AddExtent(s, e);
    s.capacity = capacity;
    s.written.assign(chunks * layout.n_layers * layout.n_kv_heads, true);  // committed blocks are complete
    return PrefixMatch{resp.blocks(), id};
  }

  int64_t ReservedBytes(const KvLayout& layout, int64_t chunks) const override {
    int64_t extent = std::max<int64_t>(1, options_.first_extent_chunks);  // Open's, then Write doubles it
    while (extent < chunks) extent *= 2;
    return KvStore::ReservedBytes(layout, extent);
  }
  int64_t capacity_bytes() const override { return capacity_.load(std::memory_order_relaxed); }
  int64_t bytes_stored() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  int64_t wait_ns() const override { return queue_.wait_ns(); }
  void SetLink(const LinkModel& link) override { queue_.SetLink(link); }

 private:
  struct Seq {
    uint64_t remote = 0;        // the pool's id
    bool read_only = false;     // a prefix handle from LookupPrefix
    KvLayout layout;
    std::vector<v1::Extent> extents;
    int64_t capacity = 0;     // chunks
    std::vector<bool> written;  // per block (BlockIndex)
  };

  template <typename F>
  absl::Status Call(absl::string_view what, F&& f) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + options_.token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.rpc_timeout_ms));
    const grpc::Status st = f(&ctx);
    // The pool serves no UNAVAILABLE of its own: the connection failed. When the pool does not
    // answer a health check either, the store is lost now (not only at the next lease renewal),
    // so that Recover reconnects, where the pool's PoolLocate says when it has one; a broken
    // connection to a live pool (a GOAWAY) is only this call's error. Called with mu_ free.
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE && what != "handshake" && what != "health" &&
        what != "renew" && !Answers()) {
      return Lost(FromGrpc(st, what));
    }
    return FromGrpc(st, what);
  }
  bool Answers() {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + options_.token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.rpc_timeout_ms));
    v1::HealthResponse h;
    return stub_->Health(&ctx, {}, &h).ok();
  }

  absl::Status Broken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  absl::StatusOr<Seq*> Find(SequenceId seq) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return UnknownSequence(seq);
    return &it->second;
  }
  void AddExtent(Seq& s, const v1::Extent& e) {
    s.extents.push_back(e);
    s.capacity = e.first_chunk() + e.chunks();
  }
  // The offset of a block the sequence holds: the ref checked against its layout, the block
  // written (NOT_FOUND otherwise: as for any gather of it).
  static absl::StatusOr<int64_t> WrittenOffset(const Seq& s, const ChunkRef& r) {
    RETURN_IF_ERROR(CheckChunkRef(s.layout, r));
    const int64_t bit = BlockIndex(s.layout, r);
    if (r.chunk >= s.capacity || bit >= static_cast<int64_t>(s.written.size()) || !s.written[bit]) {
      return NeverWritten(r);
    }
    return Offset(s, r);
  }
  // Byte offset of a block in the tenant's region (callers check capacity first).
  static int64_t Offset(const Seq& s, const ChunkRef& r) {
    const int64_t bb = s.layout.block_bytes();
    for (const v1::Extent& e : s.extents) {
      if (r.chunk >= e.first_chunk() && r.chunk < e.first_chunk() + e.chunks()) {
        const ChunkRef in_extent{r.layer, r.kv_head, r.chunk - e.first_chunk()};
        return e.offset() + BlockIndex(s.layout, in_extent) * bb;
      }
    }
    return -1;
  }
  // An answer from another pool process than the one handshaken with (restarted at the same
  // address before the lease renewal noticed): its extents are not in the region this store
  // maps, so the pool counts as lost (Recover handshakes again).
  absl::Status SamePool(uint64_t instance) {
    if (instance == instance_) return absl::OkStatus();
    return Lost(absl::UnavailableError("the pool restarted (another process answers at its address)"));
  }
  // A data-path failure means the pool is gone: every later call fails the same way.
  absl::Status Lost(const absl::Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.ok()) broken_ = absl::UnavailableError(absl::StrCat("kv pool at ", options_.address, " lost: ", st.message()));
    lost_.store(true, std::memory_order_release);
    return broken_;
  }

  void RenewLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    const auto period = std::chrono::milliseconds(std::max<int64_t>(1, ttl_ms_ / 3));
    while (!renew_cv_.wait_for(lock, period, [&] { return stop_; })) {
      v1::RenewRequest req;
      for (const auto& [id, s] : seqs_) req.add_sequences(s.remote);
      lock.unlock();
      v1::RenewResponse resp;
      absl::Status st = req.sequences_size() > 0
                            ? Call("renew", [&](grpc::ClientContext* c) { return stub_->Renew(c, req, &resp); })
                            : Call("health", [&](grpc::ClientContext* c) {
                                v1::HealthResponse h;
                                return stub_->Health(c, {}, &h);
                              });
      lock.lock();
      if (!st.ok() && broken_.ok()) {
        broken_ = absl::UnavailableError(absl::StrCat("kv pool at ", options_.address, " lost: ", st.message()));
        lost_.store(true, std::memory_order_release);
      }
    }
  }

  PoolClientOptions options_;
  std::unique_ptr<v1::KvPool::Stub> stub_;
  mutable std::mutex mu_;
  std::condition_variable renew_cv_;
  std::unordered_map<SequenceId, Seq> seqs_;
  absl::Status broken_;
  bool stop_ = false;
  std::atomic<bool> lost_{false};
  std::atomic<int64_t> capacity_{0};  // the tenant's region (quota), from the handshake
  uint64_t instance_ = 0;  // HandshakeResponse.instance of the pool this store maps
  std::unique_ptr<DataPath> data_;
  SequenceId next_local_ = 0;
  int64_t ttl_ms_ = 0, bytes_ = 0;
  std::thread renewer_;
  TransferQueue queue_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStore>> ConnectPoolKvStore(const PoolClientOptions& options) {
  if (options.token.empty()) return absl::InvalidArgumentError("kv pool token is empty (set DD_KV_POOL_TOKEN)");
  auto store = std::make_unique<PoolKvStore>(options, NewStub(options));
  RETURN_IF_ERROR(store->Connect());
  return store;
}

bool NamesThisHost(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host == "localhost" || host == "::1" || absl::StartsWith(host, "127.")) return true;
  char name[256] = {};
  return gethostname(name, sizeof(name) - 1) == 0 && host == name;
}

absl::StatusOr<std::unique_ptr<KvStore>> OpenKvStore(const std::string& uri, const std::string& token,
                                                     const LinkModel& link, int64_t inproc_prefix_cache_bytes,
                                                     int64_t inproc_owner_bytes, PoolLocate locate) {
  if (uri.empty() || uri == "inproc://") {
    return NewInProcessKvStore(link, inproc_prefix_cache_bytes, inproc_owner_bytes);
  }
  if (uri.find(',') != std::string::npos) {  // several pools: layers striped over them
    if (locate) return absl::InvalidArgumentError("kv store: a located pool cannot be one of several shards");
    std::vector<std::unique_ptr<KvStore>> shards;
    for (absl::string_view part : absl::StrSplit(uri, ',')) {
      if (part == "inproc://") return absl::InvalidArgumentError("kv store: inproc:// cannot be a shard");
      ASSIGN_OR_RETURN(auto shard, OpenKvStore(std::string(part), token, link));
      shards.push_back(std::move(shard));
    }
    return NewShardedKvStore(std::move(shards));
  }
  std::string ca;
  if (const char* path = std::getenv("DD_KV_POOL_CA"); path != nullptr && *path != '\0') {
    std::ifstream f(path);
    if (!f) return absl::NotFoundError(absl::StrCat("DD_KV_POOL_CA: cannot read ", path));
    std::stringstream ss;
    ss << f.rdbuf();
    ca = ss.str();
  }
  const char* tls_name = std::getenv("DD_KV_POOL_TLS_NAME");
  UcxPath ucx_path = UcxPath::kAuto;
  if (const char* p = std::getenv("DD_UCX_PATH"); p != nullptr && *p != '\0') {
    const std::string v(p);
    if (v == "am") ucx_path = UcxPath::kActiveMessages;
    else if (v == "rma") ucx_path = UcxPath::kRma;
    else if (v != "auto") return absl::InvalidArgumentError(absl::StrCat("DD_UCX_PATH '", v, "': expected am, rma or auto"));
  }
  int lanes = 1;
  if (const char* p = std::getenv("DD_KV_TRANSFER_LANES"); p != nullptr && *p != '\0') {
    if (!absl::SimpleAtoi(p, &lanes) || lanes < 0 || lanes > TransferQueue::kMaxLanes) {
      return absl::InvalidArgumentError(absl::StrCat("DD_KV_TRANSFER_LANES '", p, "': expected 0 (gathers on the ",
                                                     "caller's thread) to ", TransferQueue::kMaxLanes));
    }
  }
  for (auto [scheme, transport] : {std::pair{"shm://", PoolTransport::kShm}, std::pair{"ucx://", PoolTransport::kUcx}}) {
    const std::string prefix(scheme);
    if (absl::StartsWith(uri, prefix) && uri.size() > prefix.size()) {
      return ConnectPoolKvStore(PoolClientOptions{.address = uri.substr(prefix.size()), .token = token,
                                                  .transport = transport, .ucx_path = ucx_path, .link = link,
                                                  .transfer_lanes = lanes, .tls_ca_pem = ca,
                                                  .tls_server_name = tls_name != nullptr ? tls_name : "",
                                                  .locate = std::move(locate)});
    }
  }
  if (absl::StartsWith(uri, "registry://")) {
    return absl::InvalidArgumentError(absl::StrCat("kv store '", uri, "' is found in a registry: only dd-decode-worker ",
                                                   "with --registry etcd://... takes it"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("kv store '", uri, "': expected inproc://, shm://HOST:PORT or ucx://HOST:PORT"));
}

}  // namespace dd::kvpool
