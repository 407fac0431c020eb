#include "kv-pool/server/ucx_requests.h"

#include <cstring>

namespace dd::kvpool::ucxproto {

absl::StatusCode CheckGet(const GetRequest& req, const void* data, size_t length, int64_t region_bytes,
                          std::vector<Piece>* pieces) {
  pieces->clear();
  // In this order, so that no product overflows: count is bounded before it multiplies.
  if (req.count == 0 || req.count > kMaxBlocksPerGet || length != req.count * sizeof(int64_t) ||
      req.block_bytes <= 0 || req.block_bytes > kMaxReplyBytes / req.count || req.block_bytes > region_bytes) {
    return absl::StatusCode::kInvalidArgument;
  }
  pieces->reserve(req.count);
  const auto* offsets = static_cast<const uint8_t*>(data);
  for (uint32_t i = 0; i < req.count; ++i) {
    int64_t off;
    std::memcpy(&off, offsets + i * sizeof(int64_t), sizeof(off));
    if (off < 0 || off > region_bytes - req.block_bytes) {  // only the tenant's own region
      pieces->clear();
      return absl::StatusCode::kOutOfRange;
    }
    if (!pieces->empty() && pieces->back().offset + pieces->back().bytes == off) {
      pieces->back().bytes += req.block_bytes;  // adjacent blocks travel as one piece
    } else {
      pieces->push_back({off, req.block_bytes});
    }
  }
  return absl::StatusCode::kOk;
}

absl::StatusCode CheckPut(const PutRequest& req, size_t length, int64_t region_bytes) {
  if (req.bytes <= 0 || req.bytes > kMaxReplyBytes || static_cast<size_t>(req.bytes) != length) {
    return absl::StatusCode::kInvalidArgument;
  }
  if (req.offset < 0 || req.offset > region_bytes - req.bytes) return absl::StatusCode::kOutOfRange;
  return absl::StatusCode::kOk;
}

}  // namespace dd::kvpool::ucxproto
