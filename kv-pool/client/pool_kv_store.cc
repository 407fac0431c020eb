#include "kv-pool/client/shm_kv_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "kv-pool/client/transfer_queue.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool {
namespace {

absl::Status FromGrpc(const grpc::Status& st, absl::string_view what) {
  if (st.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), absl::StrCat("kv pool ", what, ": ", st.error_message()));
}

class ShmKvStore : public KvStore {
 public:
  ShmKvStore(const PoolClientOptions& o, std::unique_ptr<v1::KvPool::Stub> stub)
      : options_(o), stub_(std::move(stub)), queue_(o.link) {}

  ~ShmKvStore() override {
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
    if (base_ != nullptr) munmap(base_, region_bytes_);
  }

  absl::Status Connect() {
    v1::HandshakeResponse hs;
    RETURN_IF_ERROR(Call("handshake", [&](grpc::ClientContext* c) { return stub_->Handshake(c, {}, &hs); }));
    const int fd = shm_open(hs.shm_name().c_str(), O_RDWR, 0);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat("kv pool region ", hs.shm_name(), " cannot be opened (",
                                                        std::strerror(errno), "): shm:// needs the pool on this host"));
    }
    void* p = mmap(nullptr, hs.region_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap of the kv pool region: ", std::strerror(errno)));
    base_ = static_cast<uint8_t*>(p);
    region_bytes_ = hs.region_bytes();
    ttl_ms_ = hs.lease_ttl_ms();
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
    req.set_chunks(options_.first_extent_chunks);
    v1::OpenResponse resp;
    RETURN_IF_ERROR(Call("open", [&](grpc::ClientContext* c) { return stub_->Open(c, req, &resp); }));
    std::lock_guard<std::mutex> lock(mu_);
    Seq& s = seqs_[resp.sequence()];
    s.layout = layout;
    AddExtent(s, resp.extent());
    return resp.sequence();
  }

  absl::Status Write(SequenceId seq, const ChunkRef& ref, const float* block) override {
    RETURN_IF_ERROR(Broken());
    std::unique_lock<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(Seq * s, Find(seq));
    RETURN_IF_ERROR(CheckChunkRef(s->layout, ref));
    while (ref.chunk >= s->capacity) {  // grow: double the chunks held so far
      v1::ExtendRequest req;
      req.set_sequence(seq);
      req.set_chunks(std::max(s->capacity, ref.chunk + 1 - s->capacity));
      lock.unlock();
      v1::ExtendResponse resp;
      RETURN_IF_ERROR(Call("extend", [&](grpc::ClientContext* c) { return stub_->Extend(c, req, &resp); }));
      lock.lock();
      ASSIGN_OR_RETURN(s, Find(seq));
      AddExtent(*s, resp.extent());
    }
    const int64_t bytes = s->layout.block_floats() * static_cast<int64_t>(sizeof(float));
    std::memcpy(Block(*s, ref), block, bytes);
    const int64_t bit = Bit(s->layout, ref);
    if (bit >= static_cast<int64_t>(s->written.size())) s->written.resize(bit + 1, false);
    if (!s->written[bit]) {
      s->written[bit] = true;
      bytes_ += bytes;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TransferId> Gather(SequenceId seq, absl::Span<const ChunkRef> refs, float* dst,
                                    Priority priority) override {
    RETURN_IF_ERROR(Broken());
    std::lock_guard<std::mutex> lock(mu_);
    ASSIGN_OR_RETURN(Seq * s, Find(seq));
    TransferQueue::Job job{dst, s->layout.block_floats(), {}};
    for (const ChunkRef& r : refs) {
      RETURN_IF_ERROR(CheckChunkRef(s->layout, r));
      const int64_t bit = Bit(s->layout, r);
      if (r.chunk >= s->capacity || bit >= static_cast<int64_t>(s->written.size()) || !s->written[bit]) {
        return NeverWritten(r);
      }
      job.src.push_back(reinterpret_cast<const float*>(Block(*s, r)));
    }
    return queue_.Submit(std::move(job), priority);
  }

  absl::Status Wait(TransferId id) override {
    queue_.Wait(id);
    return absl::OkStatus();
  }

  absl::Status Release(SequenceId seq) override {
    queue_.Drain();  // queued gathers may still read the sequence's blocks
    int64_t freed = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ASSIGN_OR_RETURN(Seq * s, Find(seq));
      for (bool w : s->written) freed += w ? s->layout.block_floats() * static_cast<int64_t>(sizeof(float)) : 0;
      bytes_ -= freed;
      seqs_.erase(seq);
    }
    v1::ReleaseRequest req;
    req.set_sequence(seq);
    v1::ReleaseResponse resp;
    return Call("release", [&](grpc::ClientContext* c) { return stub_->Release(c, req, &resp); });
  }

  int64_t bytes_stored() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  int64_t wait_ns() const override { return queue_.wait_ns(); }
  void SetLink(const LinkModel& link) override { queue_.SetLink(link); }

 private:
  struct Seq {
    KvLayout layout;
    std::vector<v1::Extent> extents;
    int64_t capacity = 0;     // chunks
    std::vector<bool> written;  // per block (Bit)
  };

  template <typename F>
  absl::Status Call(absl::string_view what, F&& f) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + options_.token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(options_.rpc_timeout_ms));
    return FromGrpc(f(&ctx), what);
  }

  absl::Status Broken() const {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }
  absl::StatusOr<Seq*> Find(SequenceId seq) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    return &it->second;
  }
  void AddExtent(Seq& s, const v1::Extent& e) {
    s.extents.push_back(e);
    s.capacity = e.first_chunk() + e.chunks();
  }
  static int64_t Bit(const KvLayout& l, const ChunkRef& r) {
    return (r.chunk * l.n_layers + r.layer) * l.n_kv_heads + r.kv_head;
  }
  uint8_t* Block(const Seq& s, const ChunkRef& r) const {
    const int64_t bb = s.layout.block_floats() * static_cast<int64_t>(sizeof(float));
    for (const v1::Extent& e : s.extents) {
      if (r.chunk >= e.first_chunk() && r.chunk < e.first_chunk() + e.chunks()) {
        return base_ + e.offset() + (((r.chunk - e.first_chunk()) * s.layout.n_layers + r.layer) * s.layout.n_kv_heads + r.kv_head) * bb;
      }
    }
    return nullptr;  // unreachable: callers check capacity first
  }

  void RenewLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    const auto period = std::chrono::milliseconds(std::max<int64_t>(1, ttl_ms_ / 3));
    while (!renew_cv_.wait_for(lock, period, [&] { return stop_; })) {
      v1::RenewRequest req;
      for (const auto& [id, s] : seqs_) req.add_sequences(id);
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
  uint8_t* base_ = nullptr;
  int64_t region_bytes_ = 0, ttl_ms_ = 0, bytes_ = 0;
  std::thread renewer_;
  TransferQueue queue_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStore>> ConnectShmKvStore(const PoolClientOptions& options) {
  if (options.token.empty()) return absl::InvalidArgumentError("kv pool token is empty (set DD_KV_POOL_TOKEN)");
  auto channel = grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials());
  auto store = std::make_unique<ShmKvStore>(options, v1::KvPool::NewStub(channel));
  RETURN_IF_ERROR(store->Connect());
  return store;
}

absl::StatusOr<std::unique_ptr<KvStore>> OpenKvStore(const std::string& uri, const std::string& token,
                                                     const LinkModel& link) {
  if (uri.empty() || uri == "inproc://") return NewInProcessKvStore(link);
  if (absl::StartsWith(uri, "shm://") && uri.size() > 6) {
    return ConnectShmKvStore(PoolClientOptions{.address = uri.substr(6), .token = token, .link = link});
  }
  return absl::InvalidArgumentError(absl::StrCat("kv store '", uri, "': expected inproc:// or shm://HOST:PORT"));
}

}  // namespace dd::kvpool
