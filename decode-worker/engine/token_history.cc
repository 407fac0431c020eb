#include "decode-worker/engine/token_history.h"

namespace dd::engine {

void TokenHistory::Note(int32_t seq, absl::Span<const int32_t> tokens) {
  if (seq < 0) return;
  if (seq >= static_cast<int32_t>(slots_.size())) slots_.resize(seq + 1);
  slots_[seq].insert(slots_[seq].end(), tokens.begin(), tokens.end());
}

void TokenHistory::Copy(int32_t src, int32_t dst) {
  if (src < 0 || dst < 0 || src == dst) return;
  const int32_t hi = src > dst ? src : dst;
  if (hi >= static_cast<int32_t>(slots_.size())) slots_.resize(hi + 1);
  slots_[dst] = slots_[src];
}

void TokenHistory::Reset(int32_t seq) {
  if (seq >= 0 && seq < static_cast<int32_t>(slots_.size())) slots_[seq] = std::vector<int32_t>();
}

int64_t TokenHistory::size(int32_t seq) const {
  return seq >= 0 && seq < static_cast<int32_t>(slots_.size()) ? static_cast<int64_t>(slots_[seq].size()) : 0;
}

int32_t TokenHistory::Continuation(int32_t seq) const {
  if (size(seq) < 3) return -1;
  const std::vector<int32_t>& h = slots_[seq];
  const int64_t n = static_cast<int64_t>(h.size());
  const int32_t a = h[n - 2], b = h[n - 1];
  // Latest j < n - 1 with (h[j - 1], h[j]) == (a, b); its follower h[j + 1] exists. Failing
  // that, the latest j with h[j] == b (seen first on the way back).
  int32_t one = -1;
  for (int64_t j = n - 2; j >= 1; --j) {
    if (h[j] == b && h[j - 1] == a) return h[j + 1];
    if (h[j] == b && one < 0) one = h[j + 1];
  }
  return one;
}

}  // namespace dd::engine
