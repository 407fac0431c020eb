#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv-pool/client/block_arena.h"
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

absl::StatusOr<TransferId> KvStore::Gather(SequenceId seq, absl::Span<const ChunkRef> refs, void* dst,
                                           Priority priority) {
  ASSIGN_OR_RETURN(const KvLayout layout, Layout(seq));
  std::vector<void*> dsts(refs.size());
  for (size_t i = 0; i < refs.size(); ++i) dsts[i] = static_cast<char*>(dst) + static_cast<int64_t>(i) * layout.block_bytes();
  return GatherTo(seq, refs, dsts, priority);
}

absl::Status NoDeviceWrites() {
  return absl::UnimplementedError("this KV store cannot write device memory (KvStore::WritesDeviceMemory)");
}

absl::Status DestinationsMatch(absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts) {
  if (refs.size() == dsts.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("KvStore: ", refs.size(), " chunk refs but ", dsts.size(), " destinations"));
}

namespace {

class InProcessKvStore : public KvStore {
 public:
  InProcessKvStore(const LinkModel& link, int64_t cache_bytes, int64_t owner_bytes)
      : cache_bytes_(cache_bytes), owner_bytes_(owner_bytes > 0 ? std::min(owner_bytes, cache_bytes) : cache_bytes),
        queue_(link) {}
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

  absl::Status Write(SequenceId seq, const ChunkRef& ref, const void* block) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end() || it->second.released) return UnknownSequence(seq);
    Seq& s = it->second;
    RETURN_IF_ERROR(CheckChunkRef(s.layout, ref));
    const int64_t bytes = s.layout.block_bytes();
    auto [b, added] = s.blocks.try_emplace(BlockIndex(s.layout, ref), nullptr);
    if (added) {
      auto slot = arena_.Allocate(bytes);
      if (!slot.ok()) {
        s.blocks.erase(b);
        return slot.status();
      }
      b->second = *slot;
      bytes_ += bytes;
      generation_.store(static_cast<int64_t>(arena_.ranges().size()), std::memory_order_release);
    }
    std::memcpy(b->second, block, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }

  absl::StatusOr<KvLayout> Layout(SequenceId seq) const override {
    std::lock_guard<std::mutex> lock(mu_);
    const Seq* s = Find(seq);
    if (s == nullptr) return UnknownSequence(seq);
    return s->layout;
  }

  using KvStore::GatherTo;
  absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts,
                                      Priority priority, DstMemory memory, BlockPart part) override {
    if (memory == DstMemory::kDevice) return NoDeviceWrites();
    RETURN_IF_ERROR(DestinationsMatch(refs, dsts));
    std::unique_lock<std::mutex> lock(mu_);
    const Seq* found = Find(seq);
    if (found == nullptr) return UnknownSequence(seq);
    const Seq& s = *found;
    // Validate everything now, so a transfer never fails half-way. Blocks are not freed while a
    // transfer is pending.
    TransferQueue::Job job{{dsts.begin(), dsts.end()}, PartBytes(s.layout, part), {}, nullptr};
    RETURN_IF_ERROR(BlocksOf(s, refs, &job.src));
    for (const void*& src : job.src) src = static_cast<const char*>(src) + PartOffset(s.layout, part);
    // Copy outside the lock so concurrent gatherers do not serialize. The blocks stay put: a
    // Write replaces a block's contents in place, and Release drains the queue first.
    lock.unlock();
    return queue_.Submit(std::move(job), priority);
  }

  absl::Status Wait(TransferId id) override { return queue_.Wait(id); }

  // The arena's slabs: a device registers them and gathers blocks from them itself.
  std::vector<MappedRange> MappedRanges() const override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<MappedRange> out;
    for (const BlockArena::Range& r : arena_.ranges()) out.push_back({r.base, r.bytes});
    return out;
  }
  int64_t MappingGeneration() const override { return generation_.load(std::memory_order_acquire); }
  absl::Status BlockAddresses(SequenceId seq, absl::Span<const ChunkRef> refs, std::vector<const void*>* out) override {
    out->clear();
    std::lock_guard<std::mutex> lock(mu_);
    const Seq* s = Find(seq);
    if (s == nullptr) return UnknownSequence(seq);
    const absl::Status st = BlocksOf(*s, refs, out);
    if (!st.ok()) out->clear();  // nothing half-answered
    return st;
  }

  absl::Status Release(SequenceId seq) override {
    queue_.Drain();  // transfers may still read this sequence's blocks
    std::lock_guard<std::mutex> lock(mu_);
    if (auto h = handles_.find(seq); h != handles_.end()) {  // a prefix handle
      Seq& read = seqs_[h->second];
      --read.pins;
      handles_.erase(h);
      Evict(read.owner);
      return absl::OkStatus();
    }
    auto it = seqs_.find(seq);
    if (it == seqs_.end() || it->second.released) return UnknownSequence(seq);
    Seq& s = it->second;
    if (cache_bytes_ > 0 && !s.keys.empty()) {  // its committed prefix stays findable until evicted
      s.released = true;
      s.last_use = ++clock_;
      cached_bytes_ += Bytes(s);
      owner_cached_[s.owner] += Bytes(s);
      Evict(s.owner);
      return absl::OkStatus();
    }
    Erase(it);
    return absl::OkStatus();
  }

  absl::Status CommitPrefix(SequenceId seq, absl::Span<const uint64_t> keys, uint64_t owner) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end() || it->second.released) return UnknownSequence(seq);
    if (cache_bytes_ <= 0) return absl::OkStatus();
    Seq& s = it->second;
    s.owner = owner;
    for (size_t i = s.keys.size(); i < keys.size(); ++i) {
      // A key already held elsewhere stays there (the same tokens, the same KV).
      if (prefix_.emplace(keys[i], seq).second) s.keys.push_back(keys[i]);
    }
    s.last_use = ++clock_;
    return absl::OkStatus();
  }

  absl::StatusOr<PrefixMatch> LookupPrefix(absl::Span<const uint64_t> keys, const KvLayout& layout,
                                           int64_t block_chunks) override {
    std::lock_guard<std::mutex> lock(mu_);
    // Keys are chained: block i's key names every token before it, so the longest match is
    // the last key found. Its sequence holds every block up to it (it wrote them to commit).
    for (size_t i = keys.size(); i-- > 0;) {
      auto p = prefix_.find(keys[i]);
      if (p == prefix_.end()) continue;
      Seq& s = seqs_[p->second];
      const KvLayout& l = s.layout;
      if (l.n_layers != layout.n_layers || l.n_kv_heads != layout.n_kv_heads || l.head_dim != layout.head_dim ||
          l.chunk_tokens != layout.chunk_tokens || l.dtype != layout.dtype || block_chunks <= 0) {
        continue;
      }
      const SequenceId handle = ++next_id_;
      handles_[handle] = p->second;
      ++s.pins;
      s.last_use = ++clock_;
      return PrefixMatch{static_cast<int64_t>(i) + 1, handle};
    }
    return PrefixMatch{};
  }

  int64_t bytes_stored() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  int64_t wait_ns() const override { return queue_.wait_ns(); }

 private:
  struct Seq {
    KvLayout layout;
    std::unordered_map<int64_t, float*> blocks;  // slots of arena_
    std::vector<uint64_t> keys;  // prefix keys that name this sequence
    bool released = false;       // only its committed prefix is of use: read through handles
    int pins = 0;                // open handles
    uint64_t last_use = 0;
    uint64_t owner = 0;          // CommitPrefix's: whose share of the cache it counts against
  };
  static int64_t Bytes(const Seq& s) {
    return static_cast<int64_t>(s.blocks.size()) * s.layout.block_bytes();
  }
  // Appends where each of `refs`' blocks lies in the arena: INVALID_ARGUMENT for a ref outside
  // the layout, NOT_FOUND for a block never written (call with mu_ held).
  template <typename Ptr>
  static absl::Status BlocksOf(const Seq& s, absl::Span<const ChunkRef> refs, std::vector<Ptr>* out) {
    for (const ChunkRef& r : refs) {
      RETURN_IF_ERROR(CheckChunkRef(s.layout, r));
      auto b = s.blocks.find(BlockIndex(s.layout, r));
      if (b == s.blocks.end()) return NeverWritten(r);
      out->push_back(b->second);
    }
    return absl::OkStatus();
  }
  // A live sequence, or the one a prefix handle reads (released or not); nullptr otherwise.
  const Seq* Find(SequenceId id) const {
    bool via_handle = false;
    if (auto h = handles_.find(id); h != handles_.end()) {
      id = h->second;
      via_handle = true;
    }
    auto it = seqs_.find(id);
    if (it == seqs_.end() || (it->second.released && !via_handle)) return nullptr;
    return &it->second;
  }
  void Erase(std::unordered_map<SequenceId, Seq>::iterator it) {
    for (uint64_t k : it->second.keys) prefix_.erase(k);
    const int64_t block_bytes = it->second.layout.block_bytes();
    for (const auto& [index, slot] : it->second.blocks) arena_.Free(slot, block_bytes);
    bytes_ -= Bytes(it->second);
    if (it->second.released) {
      cached_bytes_ -= Bytes(it->second);
      auto o = owner_cached_.find(it->second.owner);
      if ((o->second -= Bytes(it->second)) <= 0) owner_cached_.erase(o);
    }
    seqs_.erase(it);
  }
  // Drops `owner`'s released, unpinned sequences, least recently used first, until its share
  // and the whole cache fit (or nothing of its is left to drop). Other owners' are never
  // touched: what one tenant does cannot evict, or be timed through, another's prefixes.
  void Evict(uint64_t owner) {
    for (;;) {
      const auto held = owner_cached_.find(owner);
      if (held == owner_cached_.end() || (held->second <= owner_bytes_ && cached_bytes_ <= cache_bytes_)) return;
      auto victim = seqs_.end();
      for (auto it = seqs_.begin(); it != seqs_.end(); ++it) {
        if (it->second.released && it->second.pins == 0 && it->second.owner == owner &&
            (victim == seqs_.end() || it->second.last_use < victim->second.last_use)) {
          victim = it;
        }
      }
      if (victim == seqs_.end()) return;  // everything of its cached is being read
      Erase(victim);
    }
  }

  const int64_t cache_bytes_;
  const int64_t owner_bytes_;  // one owner's share of cache_bytes_
  mutable std::mutex mu_;
  std::unordered_map<SequenceId, Seq> seqs_;
  std::unordered_map<uint64_t, SequenceId> prefix_;      // committed key → its sequence
  std::unordered_map<SequenceId, SequenceId> handles_;   // prefix handle → sequence
  SequenceId next_id_ = 0;
  uint64_t clock_ = 0;
  int64_t bytes_ = 0;
  int64_t cached_bytes_ = 0;  // of released sequences
  std::unordered_map<uint64_t, int64_t> owner_cached_;  // cached_bytes_ by owner
  BlockArena arena_;
  std::atomic<int64_t> generation_{0};  // slabs mapped: MappingGeneration
  TransferQueue queue_;  // last: destroyed first
};

}  // namespace

std::unique_ptr<KvStore> NewInProcessKvStore(const LinkModel& link, int64_t prefix_cache_bytes, int64_t owner_bytes) {
  return std::make_unique<InProcessKvStore>(link, prefix_cache_bytes, owner_bytes);
}

}  // namespace dd::kvpool
