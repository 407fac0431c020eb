#include "decode-worker/engine/random_kv.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace dd::engine {
namespace {

constexpr int64_t kTableFloats = int64_t{1} << 21;  // 8 MiB

uint64_t Mix(uint64_t z) {  // splitmix64's finalizer
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

RandomKv::RandomKv(uint64_t seed, int64_t kv_dim)
    : seed_(seed), kv_dim_(std::max<int64_t>(1, kv_dim)), table_(std::max(kTableFloats, 4 * kv_dim_)) {
  // Segments of at most a quarter of the table, so offsets spread over the rest.
  const int64_t table = static_cast<int64_t>(table_.size());
  seg_rows_ = std::max<int64_t>(1, table / 4 / kv_dim_);
  // Uniform in [-sqrt(3), sqrt(3)): unit RMS.
  const float scale = std::sqrt(3.0f) / static_cast<float>(int64_t{1} << 23);
  uint64_t state = Mix(seed ^ 0x3c6ef372fe94f82bULL);
  for (float& f : table_) {
    state = Mix(state);
    f = static_cast<float>(static_cast<int64_t>(state >> 40) - (int64_t{1} << 23)) * scale;
  }
}

const float* RandomKv::Segment(int64_t layer, bool values, int64_t segment) const {
  const uint64_t h = Mix(Mix(Mix(seed_ ^ static_cast<uint64_t>(layer)) ^ (values ? 1u : 2u)) ^
                         static_cast<uint64_t>(segment));
  const uint64_t room = static_cast<uint64_t>(static_cast<int64_t>(table_.size()) - seg_rows_ * kv_dim_ + 1);
  return table_.data() + h % room;
}

void RandomKv::Rows(int64_t layer, bool values, int64_t p0, int64_t p1, float* out) const {
  for (int64_t p = p0; p < p1;) {
    const int64_t seg = p / seg_rows_, in = p - seg * seg_rows_;
    const int64_t n = std::min(p1, (seg + 1) * seg_rows_) - p;
    std::memcpy(out + (p - p0) * kv_dim_, Segment(layer, values, seg) + in * kv_dim_,
                static_cast<size_t>(n * kv_dim_) * sizeof(float));
    p += n;
  }
}

}  // namespace dd::engine
