// ResidentSet: the chunks one (sequence, sparse layer) keeps on the device across decode steps
// (docs/decisions/0012-resident-set.md). Each KV head has a fixed number of block slots
// ([K | V], one chunk each). A step looks its selection up here, fetches only the chunks that
// are not resident, straight into slots freed for them, and reads every selected block where
// it sits. Slots are recycled by one stated policy: a slot whose chunk the caller still
// needs (`keep`) is never taken; among the others, empty slots first, then the least recently
// used (lowest stamp), lower slot index on ties. A slot can be "in flight" (a background
// prefetch is still writing it); such a slot is taken only when the caller allows it (after
// waiting for that transfer). Chunks are immutable once offloaded, so a resident block never
// goes stale — but a slot's K half may hold keys rebuilt from the low-rank key cache, or
// nothing yet (a layer whose keys are rebuilt lands the V half alone, then rebuilds the K half:
// KeyState). A step that reads stored keys drops such a chunk and fetches it again; a step that
// rebuilds keys rebuilds only the slots not holding rebuilt keys already (rebuilding is
// deterministic: the same bits again). The set keeps the bookkeeping only: the blocks live in device memory the caller
// owns (one buffer per (sequence, layer), block BlockIndex(g, slot) of it). Not thread-safe
// (the engine's compute thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dd::engine {

class ResidentSet {
 public:
  // What a slot's K half holds: the stored keys, keys rebuilt on the device, or nothing yet.
  enum class KeyState : uint8_t { kStored, kRebuilt, kMissing };
  // `heads` KV heads of `slots_per_head` slots each; empties the set.
  void Init(int64_t heads, int64_t slots_per_head);
  bool initialized() const { return slots_per_head_ > 0; }
  int64_t heads() const { return static_cast<int64_t>(heads_.size()); }
  int64_t slots_per_head() const { return slots_per_head_; }
  // Blocks in all (heads × slots per head): the device buffer holds this many.
  int64_t blocks() const { return heads() * slots_per_head_; }

  // The slot holding chunk `c` of head `g`, or -1.
  int32_t Find(int64_t g, int64_t c) const;
  // Where slot `slot` of head g sits in the caller's buffer, in blocks.
  int64_t BlockIndex(int64_t g, int32_t slot) const { return g * slots_per_head_ + slot; }
  bool inflight(int64_t g, int32_t slot) const { return heads_[g].inflight[slot]; }
  // The slot's K half (set by Assign: kStored, or kMissing for a values-only landing).
  KeyState keys(int64_t g, int32_t slot) const { return heads_[g].keys[slot]; }
  void set_keys(int64_t g, int32_t slot, KeyState k) { heads_[g].keys[slot] = k; }
  // Forgets chunk c of head g (its slot becomes empty; not one in flight).
  void Drop(int64_t g, int64_t c);

  // Gives each chunk of `incoming` (head g, none of them resident) a slot, in order, evicting
  // by the policy above; slots holding a chunk of `keep` (ascending) are never taken, in-flight
  // slots only if `allow_inflight`. Returns false and changes nothing when there are not enough
  // slots; else appends the slots to *slots, marks them in flight if `inflight` and their keys
  // kStored, or kMissing when `values_only`, and adds the number of resident chunks it evicted
  // to *evicted.
  bool Assign(int64_t g, const std::vector<int64_t>& incoming, const std::vector<int64_t>& keep,
              bool allow_inflight, bool inflight, std::vector<int32_t>* slots, int64_t* evicted,
              bool values_only = false);
  // How many slots of head g Assign could take with these arguments.
  int64_t Available(int64_t g, const std::vector<int64_t>& keep, bool allow_inflight) const;
  // Marks the slot used at `stamp` (for least-recently-used eviction).
  void Touch(int64_t g, int32_t slot, int64_t stamp) { heads_[g].last_use[slot] = stamp; }
  // Every in-flight slot has landed (the caller waited for the transfer writing them).
  void Landed();
  // Forgets every chunk (slots become empty).
  void Clear();

 private:
  struct Head {
    std::vector<int64_t> chunk;     // per slot: the chunk it holds, -1 = empty
    std::vector<int64_t> last_use;  // per slot
    std::vector<bool> inflight;     // per slot
    std::vector<KeyState> keys;     // per slot: what its K half holds
    std::vector<int32_t> slot_of;   // per chunk index: its slot, -1 = not resident
  };
  // Candidates for eviction; the first `first` of them in policy order.
  void Victims(int64_t g, const std::vector<int64_t>& keep, bool allow_inflight, size_t first,
               std::vector<int32_t>* out) const;
  // Calls fn(slot) for each slot that may be reused: not holding a chunk of `keep`, not in
  // flight unless allowed. The kept slots are found through slot_of (|keep| lookups, not a
  // search of `keep` per slot: this ran once per KV head per layer per step).
  template <typename Fn>
  void ForEachVictim(int64_t g, const std::vector<int64_t>& keep, bool allow_inflight, Fn fn) const {
    const Head& h = heads_[g];
    thread_local std::vector<uint8_t> kept;
    kept.assign(slots_per_head_, 0);
    for (int64_t c : keep) {
      if (c >= 0 && c < static_cast<int64_t>(h.slot_of.size()) && h.slot_of[c] >= 0) kept[h.slot_of[c]] = 1;
    }
    for (int32_t s = 0; s < slots_per_head_; ++s) {
      if (!kept[s] && (allow_inflight || !h.inflight[s])) fn(s);
    }
  }

  std::vector<Head> heads_;
  int64_t slots_per_head_ = 0;
  bool any_inflight_ = false;
};

}  // namespace dd::engine
