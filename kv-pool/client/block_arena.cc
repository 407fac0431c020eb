#include "kv-pool/client/block_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dd::kvpool {

BlockArena::~BlockArena() {
  for (const Range& r : slabs_) munmap(const_cast<void*>(r.base), static_cast<size_t>(r.bytes));
}

absl::StatusOr<float*> BlockArena::Allocate(int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("block arena: a slot of ", bytes, " bytes"));
  const int64_t stride = Stride(bytes);
  SizeClass& c = classes_[stride];
  if (!c.free.empty()) {
    float* p = c.free.back();
    c.free.pop_back();
    return p;
  }
  if (c.next == nullptr || c.end - c.next < stride) {
    const int64_t page = sysconf(_SC_PAGESIZE);
    const int64_t size = (std::max(slab_bytes_, stride) + page - 1) / page * page;
    void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("in-process KV store: cannot map another ", size, " bytes for blocks (", mapped_, " mapped)"));
    }
    slabs_.push_back({p, size});
    mapped_ += size;
    c.next = static_cast<char*>(p);
    c.end = c.next + size;
  }
  float* p = reinterpret_cast<float*>(c.next);
  c.next += stride;
  return p;
}

void BlockArena::Free(float* slot, int64_t bytes) { classes_[Stride(bytes)].free.push_back(slot); }

}  // namespace dd::kvpool
