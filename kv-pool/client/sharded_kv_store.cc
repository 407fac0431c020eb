// Layers striped over several stores (docs/architecture.md, "KV store and pool"): layer l of every
// sequence lives in shard l % N. A gather is split into runs of consecutive refs on the same shard,
// each issued to its shard with its own destinations; Wait waits for all of them.
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv-pool/client/kv_store.h"

namespace dd::kvpool {
namespace {

class ShardedKvStore : public KvStore {
 public:
  explicit ShardedKvStore(std::vector<std::unique_ptr<KvStore>> shards) : shards_(std::move(shards)) {}

  absl::StatusOr<SequenceId> Open(const KvLayout& layout) override {
    std::vector<SequenceId> ids;
    for (auto& s : shards_) {
      auto id = s->Open(layout);
      if (!id.ok()) {
        for (size_t i = 0; i < ids.size(); ++i) (void)shards_[i]->Release(ids[i]);
        return id.status();
      }
      ids.push_back(*id);
    }
    std::lock_guard<std::mutex> lock(mu_);
    const SequenceId id = ++next_seq_;
    seqs_[id] = {layout, std::move(ids)};
    return id;
  }

  absl::Status Write(SequenceId seq, const ChunkRef& ref, const void* block) override {
    ASSIGN_OR_RETURN(const Seq s, Find(seq));
    RETURN_IF_ERROR(CheckChunkRef(s.layout, ref));
    const size_t k = ref.layer % shards_.size();
    return shards_[k]->Write(s.ids[k], ref, block);
  }

  absl::StatusOr<KvLayout> Layout(SequenceId seq) const override {
    ASSIGN_OR_RETURN(const Seq s, Find(seq));
    return s.layout;
  }

  using KvStore::GatherTo;
  absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts,
                                      Priority priority, DstMemory memory, BlockPart part) override {
    if (memory == DstMemory::kDevice && !WritesDeviceMemory()) return NoDeviceWrites();
    RETURN_IF_ERROR(DestinationsMatch(refs, dsts));
    ASSIGN_OR_RETURN(const Seq s, Find(seq));
    for (const ChunkRef& r : refs) RETURN_IF_ERROR(CheckChunkRef(s.layout, r));
    std::vector<std::pair<size_t, TransferId>> parts;
    const absl::Status st = ForEachShardRun(refs, [&](size_t k, size_t i, size_t j) -> absl::Status {
      const auto part_refs = refs.subspan(i, j - i);
      const auto part_dsts = dsts.subspan(i, j - i);
      ASSIGN_OR_RETURN(TransferId id, shards_[k]->GatherTo(s.ids[k], part_refs, part_dsts, priority, memory, part));
      parts.emplace_back(k, id);
      return absl::OkStatus();
    });
    if (!st.ok()) {
      for (auto [shard, tid] : parts) (void)shards_[shard]->Wait(tid);  // nothing left writing dst
      return st;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const TransferId id = ++next_transfer_;
    transfers_[id] = std::move(parts);
    return id;
  }

 public:
  absl::Status Wait(TransferId id) override {
    std::vector<std::pair<size_t, TransferId>> parts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = transfers_.find(id);
      if (it == transfers_.end()) return absl::OkStatus();
      parts = std::move(it->second);
      transfers_.erase(it);
    }
    absl::Status result;
    for (auto [shard, tid] : parts) {
      absl::Status st = shards_[shard]->Wait(tid);
      if (result.ok()) result = st;
    }
    return result;
  }

  // Every shard's ranges; a block's address from its shard. All or nothing: a shard that maps
  // nothing (a UCX pool among shm ones) makes the store map nothing.
  std::vector<MappedRange> MappedRanges() const override {
    std::vector<MappedRange> out;
    for (const auto& s : shards_) {
      std::vector<MappedRange> r = s->MappedRanges();
      if (r.empty()) return {};
      out.insert(out.end(), r.begin(), r.end());
    }
    return out;
  }

  // All or nothing, as the mapped ranges.
  bool WritesDeviceMemory() const override {
    for (const auto& s : shards_) {
      if (!s->WritesDeviceMemory()) return false;
    }
    return !shards_.empty();
  }

  int64_t MappingGeneration() const override {
    int64_t g = 0;
    for (const auto& s : shards_) g += s->MappingGeneration();
    return g;
  }

  absl::Status BlockAddresses(SequenceId seq, absl::Span<const ChunkRef> refs, std::vector<const void*>* out) override {
    out->clear();
    ASSIGN_OR_RETURN(const Seq s, Find(seq));
    for (const ChunkRef& r : refs) RETURN_IF_ERROR(CheckChunkRef(s.layout, r));
    std::vector<const void*> part;
    const absl::Status st = ForEachShardRun(refs, [&](size_t k, size_t i, size_t j) -> absl::Status {
      RETURN_IF_ERROR(shards_[k]->BlockAddresses(s.ids[k], refs.subspan(i, j - i), &part));
      out->insert(out->end(), part.begin(), part.end());
      return absl::OkStatus();
    });
    if (!st.ok()) out->clear();  // nothing half-answered
    return st;
  }

  absl::Status Release(SequenceId seq) override {
    Seq s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = seqs_.find(seq);
      if (it == seqs_.end()) return UnknownSequence(seq);
      s = std::move(it->second);
      seqs_.erase(it);
    }
    absl::Status result;
    for (size_t k = 0; k < shards_.size(); ++k) {
      absl::Status st = shards_[k]->Release(s.ids[k]);
      if (result.ok()) result = st;
    }
    return result;
  }

  absl::Status Recover() override {
    for (auto& s : shards_) RETURN_IF_ERROR(s->Recover());  // the caller released its sequences first
    return absl::OkStatus();
  }

  int64_t ReservedBytes(const KvLayout& layout, int64_t chunks) const override {  // each shard holds a sequence
    int64_t n = 0;
    for (const auto& s : shards_) n += s->ReservedBytes(layout, chunks);
    return n;
  }
  int64_t capacity_bytes() const override {  // bounded only when every shard is
    int64_t n = 0;
    for (const auto& s : shards_) {
      if (s->capacity_bytes() <= 0) return 0;
      n += s->capacity_bytes();
    }
    return n;
  }
  int64_t bytes_stored() const override {
    int64_t n = 0;
    for (const auto& s : shards_) n += s->bytes_stored();
    return n;
  }
  int64_t wait_ns() const override {
    int64_t n = 0;
    for (const auto& s : shards_) n += s->wait_ns();
    return n;
  }
  void SetLink(const LinkModel& link) override {
    for (auto& s : shards_) s->SetLink(link);
  }

 private:
  // Calls fn(shard, i, j) for each run refs[i, j) of consecutive refs on one shard, in order;
  // stops at the first error.
  template <typename Fn>
  absl::Status ForEachShardRun(absl::Span<const ChunkRef> refs, Fn fn) const {
    for (size_t i = 0; i < refs.size();) {
      const size_t k = refs[i].layer % shards_.size();
      size_t j = i + 1;
      while (j < refs.size() && refs[j].layer % shards_.size() == k) ++j;
      RETURN_IF_ERROR(fn(k, i, j));
      i = j;
    }
    return absl::OkStatus();
  }

  struct Seq {
    KvLayout layout;
    std::vector<SequenceId> ids;  // per shard
  };
  absl::StatusOr<Seq> Find(SequenceId seq) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return UnknownSequence(seq);
    return it->second;
  }

  std::vector<std::unique_ptr<KvStore>> shards_;
  mutable std::mutex mu_;
  std::unordered_map<SequenceId, Seq> seqs_;
  std::unordered_map<TransferId, std::vector<std::pair<size_t, TransferId>>> transfers_;
  SequenceId next_seq_ = 0;
  TransferId next_transfer_ = 0;
};

}  // namespace

std::unique_ptr<KvStore> NewShardedKvStore(std::vector<std::unique_ptr<KvStore>> shards) {
  return std::make_unique<ShardedKvStore>(std::move(shards));
}

}  // namespace dd::kvpool
