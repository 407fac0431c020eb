#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kv-pool/client/kv_store.h"

namespace dd::kvpool {
namespace {

using Clock = std::chrono::steady_clock;

class InProcessKvStore : public KvStore {
 public:
  explicit InProcessKvStore(const LinkModel& link) : link_(link) {
    worker_ = std::thread([this] { TransferLoop(); });
  }

  void SetLink(const LinkModel& link) override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_.empty(); });
    link_ = link;
  }
  ~InProcessKvStore() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  absl::StatusOr<SequenceId> Open(const KvLayout& layout) override {
    if (layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0 || layout.chunk_tokens <= 0) {
      return absl::InvalidArgumentError("KvStore::Open: layout fields must be positive");
    }
    std::lock_guard<std::mutex> lock(mu_);
    const SequenceId id = ++next_id_;
    seqs_[id].layout = layout;
    return id;
  }

  absl::Status Write(SequenceId seq, const ChunkRef& ref, const float* block) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    Seq& s = it->second;
    if (absl::Status st = Check(s.layout, ref); !st.ok()) return st;
    std::vector<float>& b = s.blocks[Key(s.layout, ref)];
    if (b.empty()) bytes_ += s.layout.block_floats() * sizeof(float);
    b.assign(block, block + s.layout.block_floats());
    return absl::OkStatus();
  }

  absl::StatusOr<TransferId> Gather(SequenceId seq, absl::Span<const ChunkRef> refs, float* dst,
                                    Priority priority) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    const Seq& s = it->second;
    // Validate everything now, so a transfer never fails half-way.
    Job job;
    job.dst = dst;
    job.block_floats = s.layout.block_floats();
    for (const ChunkRef& r : refs) {
      if (absl::Status st = Check(s.layout, r); !st.ok()) return st;
      auto b = s.blocks.find(Key(s.layout, r));
      if (b == s.blocks.end()) {
        return absl::NotFoundError(absl::StrCat("KvStore: chunk ", r.chunk, " of layer ", r.layer, " head ",
                                                r.kv_head, " was never written"));
      }
      job.src.push_back(b->second.data());  // blocks are never freed while a transfer is pending
    }
    job.id = ++next_transfer_;
    if (link_.infinite()) {
      Copy(job);
      return job.id;
    }
    pending_.insert(job.id);
    (priority == Priority::kUrgent ? urgent_ : background_).push_back(std::move(job));
    cv_.notify_all();
    return next_transfer_;
  }

  absl::Status Wait(TransferId id) override {
    const auto t0 = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return pending_.count(id) == 0; });
    wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    return absl::OkStatus();
  }

  absl::Status Release(SequenceId seq) override {
    std::unique_lock<std::mutex> lock(mu_);
    // Transfers may still read this sequence's blocks: let them finish first.
    done_cv_.wait(lock, [&] { return pending_.empty(); });
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
    bytes_ -= static_cast<int64_t>(it->second.blocks.size()) * it->second.layout.block_floats() * sizeof(float);
    seqs_.erase(it);
    return absl::OkStatus();
  }

  int64_t bytes_stored() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  int64_t wait_ns() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return wait_ns_;
  }

 private:
  struct Seq {
    KvLayout layout;
    std::unordered_map<int64_t, std::vector<float>> blocks;
  };
  struct Job {
    TransferId id = 0;
    float* dst = nullptr;
    int64_t block_floats = 0;
    std::vector<const float*> src;
  };

  static void Copy(const Job& job) {
    for (size_t i = 0; i < job.src.size(); ++i) {
      std::memcpy(job.dst + i * job.block_floats, job.src[i], job.block_floats * sizeof(float));
    }
  }

  void TransferLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !urgent_.empty() || !background_.empty(); });
      if (stop_) return;
      std::deque<Job>& q = urgent_.empty() ? background_ : urgent_;
      Job job = std::move(q.front());
      q.pop_front();
      const LinkModel link = link_;
      lock.unlock();
      // The link: latency plus size over bandwidth, then the data is there.
      const double bytes = static_cast<double>(job.src.size() * job.block_floats * sizeof(float));
      const auto until = Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(
                                            link.latency_us * 1e3 + bytes / link.bandwidth_gbps));
      Copy(job);
      std::this_thread::sleep_until(until);
      lock.lock();
      pending_.erase(job.id);
      done_cv_.notify_all();
    }
  }

  static absl::Status Check(const KvLayout& l, const ChunkRef& r) {
    if (r.layer < 0 || r.layer >= l.n_layers || r.kv_head < 0 || r.kv_head >= l.n_kv_heads || r.chunk < 0 ||
        r.chunk >= (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat("KvStore: chunk ref (layer ", r.layer, ", head ", r.kv_head,
                                                     ", chunk ", r.chunk, ") outside the layout"));
    }
    return absl::OkStatus();
  }
  static int64_t Key(const KvLayout& l, const ChunkRef& r) {
    return (r.chunk * l.n_layers + r.layer) * l.n_kv_heads + r.kv_head;
  }

  LinkModel link_;
  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::unordered_map<SequenceId, Seq> seqs_;
  std::deque<Job> urgent_, background_;
  std::unordered_set<TransferId> pending_;
  SequenceId next_id_ = 0;
  TransferId next_transfer_ = 0;
  int64_t bytes_ = 0;
  int64_t wait_ns_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<KvStore> NewInProcessKvStore(const LinkModel& link) {
  return std::make_unique<InProcessKvStore>(link);
}

}  // namespace dd::kvpool
