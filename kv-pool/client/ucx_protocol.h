// Wire format of the ucx:// active-message data path (docs/architecture.md, "KV store and pool";
// docs/decisions/0019-ucx-active-messages.md). A worker names its session (16 random bytes the
// tenant's authenticated Handshake returned) and region-relative offsets; the pool's progress
// thread maps the session to the tenant, bounds every offset by that tenant's region and answers
// on the same endpoint. No address of the pool's memory crosses the wire, so a tenant can reach
// nothing but its own region, whatever transport UCX picked. (Below this protocol, UCX's tcp
// transport itself lets any peer write anywhere in the process: the pool serves tcp only with
// --ucx_tcp, ucx_config.h.)
//
//   kGetId:   GetRequest header, data = count little-endian int64 offsets (sent eager)
//   kPutId:   PutRequest header, data = `bytes` bytes to store at `offset`
//   kReplyId: Reply header; for a get that succeeded, data = the blocks in request order
//             (the receiver scatters them straight into its destinations, or copies them out
//             of UCX's receive buffer when the reply came eager)
#pragma once

#include <cstdint>

namespace dd::kvpool::ucxproto {

inline constexpr unsigned kGetId = 0x4444;    // worker → pool
inline constexpr unsigned kPutId = 0x4445;    // worker → pool
inline constexpr unsigned kReplyId = 0x4446;  // pool → worker
inline constexpr uint32_t kMagic = 0x44445531;  // "DDU1"
inline constexpr int kSessionBytes = 16;
inline constexpr uint32_t kMaxBlocksPerGet = 4096;
inline constexpr int64_t kMaxReplyBytes = int64_t{64} << 20;  // one get's reply, and one put

// GetRequest.flags
inline constexpr uint32_t kPackReply = 1;  // send the blocks as one contiguous buffer (the pool
                                           // copies them together): the zero-copy rendezvous of
                                           // tcp and RDMA needs contiguous memory; over shared
                                           // memory an iov of the region's blocks is one copy less
inline constexpr uint32_t kEagerReply = 2;  // over tcp: pack the blocks and send them as one eager
                                            // message (no rendezvous round trip); the worker asks
                                            // only when the reply fits its tcp receive segment, and
                                            // the pool sends a larger one (or any, without tcp) by
                                            // rendezvous (UcxEagerReplyBytes)

struct GetRequest {
  uint32_t magic = kMagic;
  uint32_t count = 0;           // offsets in the data, 1..kMaxBlocksPerGet
  uint32_t flags = 0;
  uint32_t reserved = 0;
  uint8_t session[kSessionBytes] = {};
  uint64_t id = 0;              // echoed in the reply
  int64_t block_bytes = 0;      // every block's size; count * block_bytes <= kMaxReplyBytes
};

struct PutRequest {
  uint32_t magic = kMagic;
  uint32_t reserved = 0;
  uint8_t session[kSessionBytes] = {};
  uint64_t id = 0;
  int64_t offset = 0;           // into the tenant's region
  int64_t bytes = 0;            // == the data's length, <= kMaxReplyBytes
};

// Status codes in a reply: the absl::StatusCode the pool decided (0 = OK).
struct Reply {
  uint32_t magic = kMagic;
  int32_t code = 0;
  uint64_t id = 0;
};

}  // namespace dd::kvpool::ucxproto
