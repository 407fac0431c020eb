// The pool's checks of a ucx:// request (ucx_protocol.h) against the region of the tenant that
// sent it, apart from UCX so that they can be fuzzed (fuzz/ucx_request_fuzz.cc). Every field is
// the peer's, unchecked: any process that reaches the pool's UCX worker can send these. The
// caller has checked the header's length, its magic and the session (the tenant), and passes a
// get's data only when it came eager (`length` readable bytes at `data`; a rendezvous get's data
// is a UCX descriptor, refused before this). `region_bytes` >= 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kv-pool/client/ucx_protocol.h"

namespace dd::kvpool::ucxproto {

// Bytes of a region, from `offset`.
struct Piece {
  int64_t offset = 0;
  int64_t bytes = 0;
};

// A get with `length` bytes of offsets at `data`: OK with the blocks as pieces of the region in
// request order (adjacent blocks merged into one piece); INVALID_ARGUMENT when the sizes are out
// of bounds (count 0 or over kMaxBlocksPerGet, data not count offsets, blocks not in
// (0, region_bytes] or together over kMaxReplyBytes); OUT_OF_RANGE when a block is not wholly in
// the region. `pieces` is cleared first, and left empty unless OK.
absl::StatusCode CheckGet(const GetRequest& req, const void* data, size_t length, int64_t region_bytes,
                          std::vector<Piece>* pieces);

// A put of `length` bytes: OK; INVALID_ARGUMENT when `bytes` is not in (0, kMaxReplyBytes] or not
// the data's length; OUT_OF_RANGE when [offset, offset + bytes) is not in the region.
absl::StatusCode CheckPut(const PutRequest& req, size_t length, int64_t region_bytes);

}  // namespace dd::kvpool::ucxproto
