// One layer's landmarks (one vector per full chunk and KV head) in segments that never move.
// A std::vector that doubled when a chunk completed copied every landmark into fresh pages in
// the middle of a decode step: after a fork (whose copy has no spare capacity) that was a
// 60-370 ms stall at 7K tokens on SmolLM2 (batch 1-4), and for any sequence a stall at each
// doubling, growing with the context (docs/decisions/0007-chunks-landmarks-selection.md).
#pragma once

#include <cstdint>
#include <vector>

namespace dd::engine {

class ChunkLandmarks {
 public:
  static constexpr int64_t kSegmentFloats = int64_t{1} << 16;  // 256 KiB per segment

  // Appends one chunk's landmarks: `n` floats, the same n on every call.
  void Append(const float* src, int64_t n) {
    if (per_chunk_ == 0) {
      per_chunk_ = n;
      while ((int64_t{2} << shift_) * n <= kSegmentFloats) ++shift_;  // 2^shift chunks per segment
    }
    if ((chunks_ & Mask()) == 0) {
      segments_.emplace_back();
      segments_.back().reserve((int64_t{1} << shift_) * per_chunk_);
    }
    segments_.back().insert(segments_.back().end(), src, src + n);
    ++chunks_;
  }
  // Chunk c's landmarks, from `offset` floats into them (a shift and a mask: Select calls this
  // for every candidate chunk, head and row).
  const float* At(int64_t c, int64_t offset) const {
    return &segments_[c >> shift_][(c & Mask()) * per_chunk_ + offset];
  }
  int64_t chunks() const { return chunks_; }
  int64_t floats() const { return chunks_ * per_chunk_; }

 private:
  int64_t Mask() const { return (int64_t{1} << shift_) - 1; }
  int64_t per_chunk_ = 0;
  int shift_ = 0;  // log2 of the chunks per segment (at least one chunk per segment)
  int64_t chunks_ = 0;
  std::vector<std::vector<float>> segments_;
};

}  // namespace dd::engine
