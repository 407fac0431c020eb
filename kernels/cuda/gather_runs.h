// A gather's blocks as copies for the copy engines (CudaDevice::Gather on the background
// queues with copy-engine prefetches): blocks adjacent in both the source and the destination
// merge into one copy. Host-only, tested without a device.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "dd/backend/device.h"

namespace dd::kernels::cuda {

struct GatherRun {
  int64_t src = 0, dst = 0, bytes = 0;
  bool operator==(const GatherRun& o) const { return src == o.src && dst == o.dst && bytes == o.bytes; }
};

// Appends `blocks` (each `block_bytes`) to *runs (cleared first) as maximal runs, in order.
inline void MergeGatherRuns(absl::Span<const backend::GatherBlock> blocks, int64_t block_bytes,
                            std::vector<GatherRun>* runs) {
  runs->clear();
  for (const backend::GatherBlock& b : blocks) {
    if (!runs->empty() && runs->back().src + runs->back().bytes == b.src && runs->back().dst + runs->back().bytes == b.dst) {
      runs->back().bytes += block_bytes;
      continue;
    }
    runs->push_back({b.src, b.dst, block_bytes});
  }
}

}  // namespace dd::kernels::cuda
