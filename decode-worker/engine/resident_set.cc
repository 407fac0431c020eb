#include "decode-worker/engine/resident_set.h"

#include <algorithm>

namespace dd::engine {

void ResidentSet::Init(int64_t heads, int64_t slots_per_head) {
  slots_per_head_ = slots_per_head;
  heads_.assign(heads, Head());
  for (Head& h : heads_) {
    h.chunk.assign(slots_per_head, -1);
    h.last_use.assign(slots_per_head, -1);
    h.inflight.assign(slots_per_head, false);
    h.keys.assign(slots_per_head, KeyState::kStored);
  }
  any_inflight_ = false;
}

void ResidentSet::Drop(int64_t g, int64_t c) {
  Head& h = heads_[g];
  const int32_t s = Find(g, c);
  if (s < 0 || h.inflight[s]) return;
  h.slot_of[c] = -1;
  h.chunk[s] = -1;
  h.last_use[s] = -1;
  h.keys[s] = KeyState::kStored;
}

void ResidentSet::Clear() {
  for (Head& h : heads_) {
    std::fill(h.chunk.begin(), h.chunk.end(), -1);
    std::fill(h.last_use.begin(), h.last_use.end(), -1);
    std::fill(h.inflight.begin(), h.inflight.end(), false);
    std::fill(h.keys.begin(), h.keys.end(), KeyState::kStored);
    h.slot_of.clear();
  }
  any_inflight_ = false;
}

int32_t ResidentSet::Find(int64_t g, int64_t c) const {
  const Head& h = heads_[g];
  return c >= 0 && c < static_cast<int64_t>(h.slot_of.size()) ? h.slot_of[c] : -1;
}

void ResidentSet::Victims(int64_t g, const std::vector<int64_t>& keep, bool allow_inflight,
                          size_t first, std::vector<int32_t>* out) const {
  const Head& h = heads_[g];
  out->clear();
  ForEachVictim(g, keep, allow_inflight, [out](int32_t s) { out->push_back(s); });
  // Only the first `first` are ordered (all a caller takes): empty slots first (an empty slot
  // may have been used before), then least recently used, then lower slot.
  const auto mid = out->begin() + static_cast<std::ptrdiff_t>(std::min(first, out->size()));
  std::partial_sort(out->begin(), mid, out->end(), [&h](int32_t a, int32_t b) {
    const bool ea = h.chunk[a] < 0, eb = h.chunk[b] < 0;
    if (ea != eb) return ea;
    if (h.last_use[a] != h.last_use[b]) return h.last_use[a] < h.last_use[b];
    return a < b;
  });
}

int64_t ResidentSet::Available(int64_t g, const std::vector<int64_t>& keep, bool allow_inflight) const {
  int64_t n = 0;
  ForEachVictim(g, keep, allow_inflight, [&n](int32_t) { ++n; });
  return n;
}

bool ResidentSet::Assign(int64_t g, const std::vector<int64_t>& incoming, const std::vector<int64_t>& keep,
                         bool allow_inflight, bool inflight, std::vector<int32_t>* slots, int64_t* evicted,
                         bool values_only) {
  if (incoming.empty()) return true;
  std::vector<int32_t> victims;
  Victims(g, keep, allow_inflight, incoming.size(), &victims);
  if (victims.size() < incoming.size()) return false;
  Head& h = heads_[g];
  for (size_t i = 0; i < incoming.size(); ++i) {
    const int32_t s = victims[i];
    if (h.chunk[s] >= 0) {
      h.slot_of[h.chunk[s]] = -1;
      ++*evicted;
    }
    const int64_t c = incoming[i];
    if (c >= static_cast<int64_t>(h.slot_of.size())) h.slot_of.resize(c + 1, -1);
    h.slot_of[c] = s;
    h.chunk[s] = c;
    h.inflight[s] = inflight;
    h.keys[s] = values_only ? KeyState::kMissing : KeyState::kStored;
    any_inflight_ = any_inflight_ || inflight;
    slots->push_back(s);
  }
  return true;
}

void ResidentSet::Landed() {
  if (!any_inflight_) return;
  for (Head& h : heads_) std::fill(h.inflight.begin(), h.inflight.end(), false);
  any_inflight_ = false;
}

}  // namespace dd::engine
