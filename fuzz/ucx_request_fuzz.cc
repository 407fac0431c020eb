// A ucx:// get or put request (kv-pool/client/ucx_protocol.h) as any UCX peer can send it, checked
// by the pool against a region of any size (kv-pool/server/ucx_requests.h). What must hold: the
// pool's answer is the one a plain reference computes in 128-bit arithmetic, and a get it accepts
// is exactly the requested blocks, each wholly inside the region, at most kMaxReplyBytes in all.
//
// Input: kind (1 byte: even get, odd put), the region's size (8 bytes, the sign bit dropped), a
// put's data length (8 bytes; a get's data is the rest of the input), the 48-byte header, then
// the data.
#include <cstring>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kv-pool/server/ucx_requests.h"

namespace {

namespace wire = dd::kvpool::ucxproto;
using absl::StatusCode;
using dd::fuzz::Require;
using Wide = __int128;

int64_t Read64(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void Get(const wire::GetRequest& req, const uint8_t* data, size_t length, int64_t region) {
  std::vector<wire::Piece> pieces{{1, 1}};  // not empty: the check must clear it
  const StatusCode got = wire::CheckGet(req, data, length, region, &pieces);
  // The reference: sizes first, then every block inside the region.
  StatusCode want = StatusCode::kOk;
  const Wide total = Wide{req.count} * req.block_bytes;
  if (req.count == 0 || req.count > wire::kMaxBlocksPerGet || Wide{length} != Wide{req.count} * 8 ||
      req.block_bytes <= 0 || req.block_bytes > region || total > wire::kMaxReplyBytes) {
    want = StatusCode::kInvalidArgument;
  } else {
    for (uint32_t i = 0; i < req.count && want == StatusCode::kOk; ++i) {
      const Wide off = Read64(data + i * 8);
      if (off < 0 || off + req.block_bytes > region) want = StatusCode::kOutOfRange;
    }
  }
  Require(got == want, "a get's answer is the reference's");
  if (got != StatusCode::kOk) {
    Require(pieces.empty(), "a refused get yields no pieces");
    return;
  }
  // The pieces, in order, are the requested blocks: walk both.
  size_t p = 0;
  Wide at = pieces.empty() ? 0 : pieces[0].offset, sum = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const wire::Piece& piece = pieces[k];
    Require(piece.offset >= 0 && Wide{piece.offset} + piece.bytes <= region && piece.bytes > 0,
            "every piece lies inside the region");
    Require(k == 0 || Wide{pieces[k - 1].offset} + pieces[k - 1].bytes != piece.offset,
            "adjacent blocks are merged into one piece");
    sum += piece.bytes;
  }
  Require(sum == total && total <= wire::kMaxReplyBytes, "the pieces carry the blocks and no more");
  for (uint32_t i = 0; i < req.count; ++i) {
    const int64_t off = Read64(data + i * 8);
    Require(p < pieces.size(), "a block beyond the pieces");
    if (at == Wide{pieces[p].offset} + pieces[p].bytes) {  // this piece is used up: the next one starts here
      ++p;
      Require(p < pieces.size(), "a block beyond the pieces");
      at = pieces[p].offset;
    }
    Require(Wide{off} == at, "the pieces follow the requested blocks in order");
    at += req.block_bytes;
  }
  Require(p + 1 == pieces.size() && at == Wide{pieces[p].offset} + pieces[p].bytes, "no piece left over");
}

void Put(const wire::PutRequest& req, size_t length, int64_t region) {
  const StatusCode got = wire::CheckPut(req, length, region);
  StatusCode want = StatusCode::kOk;
  if (req.bytes <= 0 || req.bytes > wire::kMaxReplyBytes || Wide{req.bytes} != Wide{length}) {
    want = StatusCode::kInvalidArgument;
  } else if (req.offset < 0 || Wide{req.offset} + req.bytes > region) {
    want = StatusCode::kOutOfRange;
  }
  Require(got == want, "a put's answer is the reference's");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static_assert(sizeof(wire::GetRequest) == 48 && sizeof(wire::PutRequest) == 48, "the corpus's layout");
  constexpr size_t kPrefix = 1 + 8 + 8 + 48;
  if (size < kPrefix) return 0;
  const bool get = data[0] % 2 == 0;
  const int64_t region = Read64(data + 1) & INT64_MAX;
  const auto put_length = static_cast<size_t>(Read64(data + 9));
  const uint8_t* rest = data + kPrefix;
  const size_t rest_size = size - kPrefix;
  if (get) {
    wire::GetRequest req;
    std::memcpy(&req, data + 17, sizeof(req));
    // The data in a buffer of its own, so that ASan sees any read past it.
    std::vector<uint8_t> offsets(rest, rest + rest_size);
    Get(req, offsets.data(), offsets.size(), region);
  } else {
    wire::PutRequest req;
    std::memcpy(&req, data + 17, sizeof(req));
    Put(req, put_length, region);
  }
  return 0;
}
