// KvStore: the decode worker's view of where offloaded KV chunks live (docs/architecture.md,
// "KV store and pool").
//
// A sequence is opened with a layout; full chunks are written as one contiguous block per
// (layer, KV head, chunk): [K (chunk_tokens × head_dim) | V (chunk_tokens × head_dim)] in the
// layout's KV type (f32 or f16; the store moves bytes and never reads them).
// Gather copies a list of blocks into caller memory at a priority and returns a transfer id;
// Wait blocks until that transfer is complete. The caller owns `dst` and must keep it alive
// and untouched until Wait returns. Backends: in-process (this file's NewInProcessKvStore);
// shared memory and UCX come with the KV-pool service behind the same interface.
// Implementations are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/kv_dtype.h"

namespace dd::kvpool {

struct KvLayout {
  int64_t n_layers = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t chunk_tokens = 8;
  // The type of the blocks' elements (docs/decisions/0049-kv-storage-type.md): part of the
  // layout, so a pool keeps, and a prefix is found for, one type only.
  KvDtype dtype = KvDtype::kF32;
  int64_t block_bytes() const { return 2 * chunk_tokens * head_dim * KvDtypeBytes(dtype); }
};

struct ChunkRef {
  int32_t layer = 0;
  int32_t kv_head = 0;
  int64_t chunk = 0;
};

// Blocks are numbered chunk-major: all (layer, KV head) blocks of chunk 0, then chunk 1, ...
// (the pool stores them at this index within an extent,
// docs/decisions/0014-kvstore-and-block-layout.md).
inline int64_t BlockIndex(const KvLayout& l, const ChunkRef& r) {
  return (r.chunk * l.n_layers + r.layer) * l.n_kv_heads + r.kv_head;
}

enum class Priority { kUrgent, kBackground };

// A link between the store and the device: each gather takes latency + bytes / bandwidth.
// bandwidth_gbps <= 0 means an infinitely fast link (gathers complete inside Gather()).
// CPU runs use it to reproduce a GPU's ratio of transfer time to compute time
// (docs/decisions/0016-link-model.md: the `pcie5` preset).
struct LinkModel {
  double bandwidth_gbps = 0;  // GB/s (1e9 bytes per second)
  double latency_us = 0;
  bool infinite() const { return bandwidth_gbps <= 0; }
};

using SequenceId = uint64_t;
using TransferId = uint64_t;

// What a gather's destinations are: host memory, or device memory that the store's transport
// writes itself (KvStore::WritesDeviceMemory; the transport is told so: UCX cannot tell device
// pointers from host ones by itself).
enum class DstMemory { kHost, kDevice };

// Which bytes of each block a gather moves: the whole [K | V] block, or its V half alone (a
// layer whose keys the device reconstructs from its low-rank key cache:
// docs/decisions/0052-low-rank-key-reconstruction.md). A part lands at the gather's
// destination as it is, part_bytes() bytes.
enum class BlockPart { kWhole, kValues };
inline int64_t PartOffset(const KvLayout& l, BlockPart p) { return p == BlockPart::kValues ? l.block_bytes() / 2 : 0; }
inline int64_t PartBytes(const KvLayout& l, BlockPart p) {
  return p == BlockPart::kValues ? l.block_bytes() / 2 : l.block_bytes();
}

// Where a pool is now, as a store URI of its scheme ("shm://HOST:PORT"), asked again each time
// a lost pool is recovered: a pool found in a registry may come back at another address.
using PoolLocate = std::function<absl::StatusOr<std::string>()>;

class KvStore {
 public:
  virtual ~KvStore() = default;
  // InvalidArgument for a layout with a non-positive field.
  virtual absl::StatusOr<SequenceId> Open(const KvLayout& layout) = 0;
  // Stores one block (block_bytes() bytes). InvalidArgument for an out-of-range ref.
  virtual absl::Status Write(SequenceId seq, const ChunkRef& ref, const void* block) = 0;
  // Copies `part` of block i of refs into dsts[i] (PartBytes bytes each; the caller's memory,
  // e.g. a slot of the engine's resident set), which are `memory`: with kDevice the store never
  // touches the bytes on the host, and UNIMPLEMENTED where WritesDeviceMemory is false.
  // NotFound for a chunk never written; InvalidArgument when the sizes differ.
  virtual absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs,
                                              absl::Span<void* const> dsts, Priority priority, DstMemory memory,
                                              BlockPart part) = 0;
  // Whole blocks.
  absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts,
                                      Priority priority, DstMemory memory) {
    return GatherTo(seq, refs, dsts, priority, memory, BlockPart::kWhole);
  }
  // Into host memory.
  absl::StatusOr<TransferId> GatherTo(SequenceId seq, absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts,
                                      Priority priority) {
    return GatherTo(seq, refs, dsts, priority, DstMemory::kHost);
  }
  // Copies refs.size() blocks into dst in order (GatherTo with consecutive destinations).
  absl::StatusOr<TransferId> Gather(SequenceId seq, absl::Span<const ChunkRef> refs, void* dst, Priority priority);
  // The layout the sequence was opened with. NotFound for an unknown sequence.
  virtual absl::StatusOr<KvLayout> Layout(SequenceId seq) const = 0;
  virtual absl::Status Wait(TransferId id) = 0;
  // Frees the sequence's blocks. NotFound for an unknown sequence.
  virtual absl::Status Release(SequenceId seq) = 0;
  virtual int64_t bytes_stored() const = 0;
  // The most bytes the store may hold for this client (a pool tenant's quota); 0: no bound
  // known (the in-process store).
  virtual int64_t capacity_bytes() const { return 0; }
  // What a sequence of this layout that grows to `chunks` chunks is charged against that bound
  // (a pool reserves extents: a first one at Open, then doubling).
  virtual int64_t ReservedBytes(const KvLayout& layout, int64_t chunks) const {
    return chunks * layout.n_layers * layout.n_kv_heads * layout.block_bytes();
  }
  // Nanoseconds callers spent blocked in Wait() or running a transfer themselves (an urgent
  // gather on a real transport, any gather of an in-process store), since construction.
  virtual int64_t wait_ns() const = 0;
  // Changes the link model for transfers issued from now on.
  virtual void SetLink(const LinkModel& link) = 0;

  // After the store failed with UNAVAILABLE (its pool was lost): connects again (a fresh
  // handshake at the same address, or where its PoolLocate says the pool is now). Every
  // sequence of the old connection is gone; callers release theirs first and rebuild them. OK
  // at once when the store is healthy; an error (the pool is not back yet) leaves it broken, to
  // be tried again. Call with no transfer in flight from the caller.
  virtual absl::Status Recover() { return absl::OkStatus(); }

  // Host memory mapped into this process that holds the store's blocks (a shm:// pool's
  // region, the in-process store's arena): a device may register it and gather blocks from it
  // itself, at the addresses BlockAddresses gives, with no copy by the host. Empty for stores
  // whose blocks are elsewhere (a UCX pool). Ranges are only ever added (the in-process store's
  // arena grows), each time MappingGeneration changes, except in Recover, which may replace
  // them (a user that registered them forgets them before calling it).
  struct MappedRange {
    const void* base = nullptr;
    int64_t bytes = 0;
  };
  virtual std::vector<MappedRange> MappedRanges() const { return {}; }
  // Changes whenever MappedRanges gains a range (cheap: one atomic load, no lock).
  virtual int64_t MappingGeneration() const { return 0; }
  // The address of each of `refs`' blocks in those ranges, into *out (cleared first): each
  // holds the block's bytes until the sequence is released. Errors as GatherTo's for refs it
  // could not gather; UNIMPLEMENTED where MappedRanges() is empty.
  virtual absl::Status BlockAddresses(SequenceId seq, absl::Span<const ChunkRef> refs,
                                      std::vector<const void*>* out) {
    return absl::UnimplementedError("this KV store maps no blocks into the process");
  }
  // Whether GatherTo takes DstMemory::kDevice: the store's transport writes device memory
  // itself (a ucx:// pool over one-sided gets whose UCX reports CUDA memory, with
  // $DD_UCX_GPUDIRECT=on: GPUDirect RDMA where the NIC can, else UCX's CUDA copy).
  virtual bool WritesDeviceMemory() const { return false; }

  // Prefix reuse (docs/prefix-keys.md). `keys` are the chained keys of the sequence's first
  // keys.size() blocks, whose chunks are all written: they become findable and outlive the
  // sequence's lease until evicted. `owner` is the namespace the keys were made in (its tenant
  // salt): a store that caches prefixes evicts an owner's only to make room for that owner's.
  // Stores without reuse ignore it.
  virtual absl::Status CommitPrefix(SequenceId seq, absl::Span<const uint64_t> keys, uint64_t owner = 0) {
    return absl::OkStatus();
  }
  struct PrefixMatch {
    int64_t blocks = 0;  // leading keys found (0: none)
    SequenceId seq = 0;  // a read-only handle on the stored sequence: Gather from it, then Release
  };
  // The longest stored prefix among `keys` with this layout.
  virtual absl::StatusOr<PrefixMatch> LookupPrefix(absl::Span<const uint64_t> keys, const KvLayout& layout,
                                                   int64_t block_chunks) {
    return PrefixMatch{};
  }
};

// Blocks held in this process's heap. With an infinite link Gather copies synchronously;
// otherwise one transfer thread serves gathers through the link model, urgent ones before
// any queued background one (a transfer in progress is not interrupted), and Wait blocks
// until the data is in `dst`.
// Prefix reuse: with `prefix_cache_bytes` > 0 a released sequence whose prefix was committed
// stays findable (LookupPrefix) while the released sequences together hold at most that many
// bytes, and those of one owner (CommitPrefix) at most `owner_bytes` (0: prefix_cache_bytes);
// 0 keeps no prefixes. Eviction takes the least recently committed or looked up of the owner
// whose release made the cache too full, never another owner's: one tenant's prompts can
// neither evict another's prefixes nor learn from their eviction when the other was active.
std::unique_ptr<KvStore> NewInProcessKvStore(const LinkModel& link = {}, int64_t prefix_cache_bytes = 0,
                                             int64_t owner_bytes = 0);

// Stripes layers over `shards` (layer l → shard l % N); each shard is a store of its own.
std::unique_ptr<KvStore> NewShardedKvStore(std::vector<std::unique_ptr<KvStore>> shards);

// Shared by the backends: InvalidArgument for a ref outside the layout; NotFound for a block
// never written.
absl::Status CheckChunkRef(const KvLayout& layout, const ChunkRef& ref);
absl::Status NeverWritten(const ChunkRef& ref);
absl::Status UnknownSequence(SequenceId seq);
absl::Status DestinationsMatch(absl::Span<const ChunkRef> refs, absl::Span<void* const> dsts);
// UNIMPLEMENTED: a gather into device memory from a store whose transport cannot write it.
absl::Status NoDeviceWrites();

}  // namespace dd::kvpool
