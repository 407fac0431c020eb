// One layer's landmarks (one vector per full chunk and KV head) in segments that never move.
// A std::vector that doubled when a chunk completed copied every landmark into fresh pages in
// the middle of a decode step: after a fork (whose copy has no spare capacity) that was a
// 60-370 ms stall at 7K tokens on SmolLM2 (batch 1-4), and for any sequence a stall at each
// doubling, growing with the context (docs/decisions.md "Landmarks in segments").
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dd::engine {

class ChunkLandmarks {
 public:
  static constexpr int64_t kSegmentFloats = int64_t{1} << 16;  // 256 KiB per segment

  // Appends one chunk's landmarks: `n` floats, the same n on every call.
  void Append(const float* src, int64_t n) {
    if (per_chunk_ == 0) per_chunk_ = n;
    const int64_t per_segment = ChunksPerSegment();
    if (chunks_ % per_segment == 0) {
      segments_.emplace_back();
      segments_.back().reserve(per_segment * per_chunk_);
    }
    segments_.back().insert(segments_.back().end(), src, src + n);
    ++chunks_;
  }
  // Chunk c's landmarks, from `offset` floats into them.
  const float* At(int64_t c, int64_t offset) const {
    const int64_t per_segment = ChunksPerSegment();
    return &segments_[c / per_segment][(c % per_segment) * per_chunk_ + offset];
  }
  int64_t chunks() const { return chunks_; }
  int64_t floats() const { return chunks_ * per_chunk_; }

 private:
  int64_t ChunksPerSegment() const { return std::max<int64_t>(1, kSegmentFloats / per_chunk_); }
  int64_t per_chunk_ = 0;
  int64_t chunks_ = 0;
  std::vector<std::vector<float>> segments_;
};

}  // namespace dd::engine
