// A tenant's host-memory region: one anonymous memory file (memfd), mapped here, that same-host
// workers map too (the shm:// data path), plus a first-fit allocator of byte ranges in it.
// Each tenant gets its own file; it has no name anyone could open: a worker receives its
// descriptor over the pool's Unix-domain socket after showing the tenant's token (kv-pool/client/fd_passing.h),
// and the memory goes away with the pool and the last mapping
// (docs/decisions/0017-pool-regions-memfd.md). Not thread-safe: the pool serializes access.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace dd::kvpool {

class ShmRegion {
 public:
  struct Options {
    bool huge_pages = false;   // MAP_HUGETLB; fails clearly if none are reserved
    bool lock_memory = false;  // mlock the region (needs RLIMIT_MEMLOCK)
  };
  // Creates and maps `bytes` (rounded up to 2 MiB); `prefix` labels it in /proc/PID/fd.
  static absl::StatusOr<ShmRegion> Create(const std::string& prefix, int64_t bytes, const Options& options);
  ShmRegion(ShmRegion&& other) noexcept;
  ShmRegion& operator=(ShmRegion&& other) noexcept;
  ~ShmRegion();  // unmaps and closes

  const std::string& name() const { return name_; }  // a label, not a path
  int fd() const { return fd_; }                      // what the fd server hands out
  int64_t size() const { return size_; }
  uint8_t* data() const { return data_; }

 private:
  ShmRegion() = default;
  std::string name_;
  int fd_ = -1;
  int64_t size_ = 0;
  uint8_t* data_ = nullptr;
};

// First-fit allocator over [0, size) in units of `align` bytes; merges freed neighbours.
class RangeAllocator {
 public:
  explicit RangeAllocator(int64_t size, int64_t align = 4096);
  // Offset of a free range of at least `bytes`, or -1 when none is large enough.
  int64_t Allocate(int64_t bytes);
  void Free(int64_t offset);
  int64_t used() const { return used_; }
  int64_t size() const { return size_; }

 private:
  int64_t size_, align_, used_ = 0;
  std::map<int64_t, int64_t> free_;       // offset → length
  std::map<int64_t, int64_t> allocated_;  // offset → length
};

}  // namespace dd::kvpool
