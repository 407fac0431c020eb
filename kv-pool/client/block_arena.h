// Memory for the in-process KV store's blocks: large anonymous mappings ("slabs") cut into
// slots of one block size each, reused through a free list. Slabs stay mapped until the arena
// is destroyed, so a device can register each range once (pinning it) and gather blocks from
// it itself (KvStore::MappedRanges): "KV in pinned host memory" on a GPU, with no host copy.
// A slab is reserved, not committed: pages count only once written. Freed slots return to
// their size's free list, not to the system: the arena keeps its peak. Not thread-safe (the
// store's lock guards it).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"

namespace dd::kvpool {

class BlockArena {
 public:
  static constexpr int64_t kDefaultSlabBytes = int64_t{256} << 20;
  explicit BlockArena(int64_t slab_bytes = kDefaultSlabBytes) : slab_bytes_(slab_bytes) {}
  ~BlockArena();
  BlockArena(const BlockArena&) = delete;
  BlockArena& operator=(const BlockArena&) = delete;

  // A slot of `bytes` (> 0), 64-byte aligned, contents unspecified. RESOURCE_EXHAUSTED when no
  // slab can be mapped.
  absl::StatusOr<float*> Allocate(int64_t bytes);
  // Returns a slot Allocate(bytes) gave.
  void Free(float* slot, int64_t bytes);

  struct Range {
    const void* base = nullptr;
    int64_t bytes = 0;
  };
  // Every slab, in the order mapped (only ever appended to).
  const std::vector<Range>& ranges() const { return slabs_; }
  int64_t mapped_bytes() const { return mapped_; }

 private:
  struct SizeClass {
    std::vector<float*> free;
    char* next = nullptr;  // unused tail of its newest slab
    char* end = nullptr;
  };
  static int64_t Stride(int64_t bytes) { return (bytes + 63) / 64 * 64; }
  const int64_t slab_bytes_;
  std::map<int64_t, SizeClass> classes_;  // by stride
  std::vector<Range> slabs_;
  int64_t mapped_ = 0;
};

}  // namespace dd::kvpool
