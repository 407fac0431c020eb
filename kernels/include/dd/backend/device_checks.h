// For device implementations (cpu_device.cc, sim/sim_device.cc): what every device checks the
// same way, ranges inside a buffer, a gather's blocks, and the table of registered host regions.
#pragma once

#include <cstdint>
#include <map>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"

namespace dd::backend::internal {

// [offset, offset + bytes) inside `size` bytes, without overflow; `what` names the copy.
inline absl::Status CheckRange(const char* what, int64_t offset, int64_t bytes, int64_t size) {
  if (offset < 0 || bytes < 0 || offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": bytes [", offset, ", +", bytes, ") outside a buffer of ", size, " bytes"));
  }
  return absl::OkStatus();
}

// A device-to-device copy: both ranges inside their buffers, not overlapping.
inline absl::Status CheckCopy(const DeviceBuffer& src, int64_t src_offset, const DeviceBuffer& dst,
                              int64_t dst_offset, int64_t bytes) {
  if (absl::Status s = CheckRange("copy source", src_offset, bytes, src.bytes); !s.ok()) return s;
  if (absl::Status s = CheckRange("copy destination", dst_offset, bytes, dst.bytes); !s.ok()) return s;
  const auto a = reinterpret_cast<uintptr_t>(src.data) + static_cast<uintptr_t>(src_offset);
  const auto b = reinterpret_cast<uintptr_t>(dst.data) + static_cast<uintptr_t>(dst_offset);
  const auto n = static_cast<uintptr_t>(bytes);
  if (n > 0 && a < b + n && b < a + n) {
    return absl::InvalidArgumentError(absl::StrCat("copy of ", bytes, " bytes between overlapping ranges"));
  }
  return absl::OkStatus();
}

// An allocation of `bytes` for `tag` with `in_use` of `budget` bytes taken (0 = unlimited):
// INVALID_ARGUMENT when negative, RESOURCE_EXHAUSTED with the figures when it does not fit.
inline absl::Status CheckAllocation(MemoryTag tag, int64_t bytes, int64_t in_use, int64_t budget) {
  if (bytes < 0) return absl::InvalidArgumentError(absl::StrCat("negative allocation of ", bytes, " bytes"));
  if (budget > 0 && bytes > budget - in_use) {
    return absl::ResourceExhaustedError(absl::StrCat("device memory: ", bytes, " bytes of ", MemoryTagName(tag),
                                                     " do not fit: ", in_use, " of ", budget, " bytes in use"));
  }
  return absl::OkStatus();
}

// Host regions by id. Lookup checks that a region handed back is one registered here.
class HostRegions {
 public:
  absl::StatusOr<HostRegion> Register(const void* base, int64_t bytes) {
    if (base == nullptr || bytes <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("host region of ", bytes, " bytes", base == nullptr ? " at address 0" : ""));
    }
    HostRegion r{next_++, base, bytes};
    regions_[r.id] = r;
    return r;
  }
  void Unregister(const HostRegion& region) { regions_.erase(region.id); }
  // The registered region, with every block of a gather into `dst` checked against both sides
  // (INVALID_ARGUMENT naming the block).
  absl::StatusOr<HostRegion> CheckGather(const HostRegion& region, absl::Span<const GatherBlock> blocks,
                                         int64_t block_bytes, const DeviceBuffer& dst) const {
    const auto it = regions_.find(region.id);
    if (it == regions_.end() || it->second.base != region.base) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather from host region ", region.id, ", which is not registered"));
    }
    for (size_t i = 0; i < blocks.size(); ++i) {
      absl::Status s = CheckRange("gather source", blocks[i].src, block_bytes, it->second.bytes);
      if (s.ok()) s = CheckRange("gather destination", blocks[i].dst, block_bytes, dst.bytes);
      if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("block ", i, ": ", s.message()));
    }
    return it->second;
  }

 private:
  std::map<int64_t, HostRegion> regions_;
  int64_t next_ = 0;
};

}  // namespace dd::backend::internal
