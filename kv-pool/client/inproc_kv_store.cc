#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv-pool/client/kv_store.h"
#include "kv-pool/client/transfer_queue.h"

namespace dd::kvpool {

absl::Status CheckChunkRef(const KvLayout& l, const ChunkRef& r) {
  if (r.layer < 0 || r.layer >= l.n_layers || r.kv_head < 0 || r.kv_head >= l.n_kv_heads || r.chunk < 0 ||
      r.chunk >= (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat("KvStore: chunk ref (layer ", r.layer, ", head ", r.kv_head,
                                                   ", chunk ", r.chunk, ") outside the layout"));
  }
  return absl::OkStatus();
}

absl::Status NeverWritten(const ChunkRef& r) {
  return absl::NotFoundError(absl::StrCat("KvStore: chunk ", r.chunk, " of layer ", r.layer, " head ", r.kv_head,
                                          " was never written"));
}

absl::Status UnknownSequence(SequenceId seq) {
  return absl::NotFoundError(absl::StrCat("KvStore: unknown sequence ", seq));
}

absl::StatusOr<TransferId> KvStore::Gather(SequenceId seq, absl::Span<const ChunkRef> refs, float* dst,
                                           Priority priority) {
  ASSIGN_OR_RETURN(const KvLayout layout, Layout(seq));
  std::vector<float*> dsts(refs.size());
  for (size_t i = 0; i < refs.size(); ++i) dsts[i] = dst + static_cast<int64_t>(i) * layout.block_floats();
  return GatherTo(seq, refs, dsts, priority);
}

absl::Status DestinationsMatch(absl::Span<const ChunkRef> refs, absl::Span<float* const> dsts) {
  if (refs.size() == dsts.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("KvStore: ", refs.size(), " chunk refs but ", dsts.size(), " destinations"));
}

namespace {

class InProcessKvStore : public KvStore {
 public:
  explicit InProcessKvStore(const LinkModel& link) : queue_(link) {}
  ~InProcessKvStore() override { queue_.Drain(); }

  void SetLink(const LinkModel& link) override { queue_.SetLink(link); }

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
    if (it == seqs_.end()) return UnknownSequence(seq);
    Seq& s = it->second;
    RETURN_IF_ERROR(CheckChunkRef(s.layout, ref));
    std::vector<float>& b = s.blocks[BlockIndex(s.layout, ref)];
    if (b.empty()) bytes_ += s.layout.block_floats() * sizeof(float);
    b.assign(block, block + s.layout.block_floats());
    return absl::OkStatus();
  }

  absl::StatusOr<KvLayout> Layout(SequenceId seq) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return UnknownSequence(seq);
    return it->second.layout;
  }

  absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs, absl::Span<float* const> dsts,
                                      Priority priority) override {
    RETURN_IF_ERROR(DestinationsMatch(refs, dsts));
    std::unique_lock<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return UnknownSequence(seq);
    const Seq& s = it->second;
    // Validate everything now, so a transfer never fails half-way.
    TransferQueue::Job job{{dsts.begin(), dsts.end()}, s.layout.block_floats(), {}, nullptr};
    for (const ChunkRef& r : refs) {
      RETURN_IF_ERROR(CheckChunkRef(s.layout, r));
      auto b = s.blocks.find(BlockIndex(s.layout, r));
      if (b == s.blocks.end()) return NeverWritten(r);
      job.src.push_back(b->second.data());  // blocks are not freed while a transfer is pending
    }
    // Copy outside the lock so concurrent gatherers do not serialize. The blocks stay put: a
    // Write replaces a block's contents in place, and Release drains the queue first.
    lock.unlock();
    return queue_.Submit(std::move(job), priority);
  }

  absl::Status Wait(TransferId id) override { return queue_.Wait(id); }

  absl::Status Release(SequenceId seq) override {
    queue_.Drain();  // transfers may still read this sequence's blocks
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return UnknownSequence(seq);
    bytes_ -= static_cast<int64_t>(it->second.blocks.size()) * it->second.layout.block_floats() * sizeof(float);
    seqs_.erase(it);
    return absl::OkStatus();
  }

  int64_t bytes_stored() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  int64_t wait_ns() const override { return queue_.wait_ns(); }

 private:
  struct Seq {
    KvLayout layout;
    std::unordered_map<int64_t, std::vector<float>> blocks;
  };

  mutable std::mutex mu_;
  std::unordered_map<SequenceId, Seq> seqs_;
  SequenceId next_id_ = 0;
  int64_t bytes_ = 0;
  TransferQueue queue_;  // last: destroyed first
};

}  // namespace

std::unique_ptr<KvStore> NewInProcessKvStore(const LinkModel& link) {
  return std::make_unique<InProcessKvStore>(link);
}

}  // namespace dd::kvpool
