// SparseKvCache with the step cache: chunks stay resident across decode steps in a ResidentSet
// per (sequence, sparse layer); only what is not resident moves. See the class comment in
// sparse_kv_cache.h and docs/decisions/0012-resident-set.md.
#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/sparse_kv_cache.h"

namespace dd::engine {

absl::Status SparseKvCache::WaitPrefetch(LayerState& st) {
  if (!st.prefetch.pending) return absl::OkStatus();
  const absl::Status status = chunks_.FinishLanding(st.prefetch, backend::Queue::kPrefetch);
  st.resident.Landed();
  if (!status.ok()) st.resident.Clear();  // the slots it was writing hold nothing usable
  return status;
}

absl::Status SparseKvCache::StartResidentFetch(Seq& s, int64_t layer, bool count, DecodeRead& r) {
  LayerState& st = s.layers[layer];
  RETURN_IF_ERROR(EnsureSlots(st));
  ResidentSet& res = st.resident;
  const Selection& sel = r.sel;
  const int64_t heads = static_cast<int64_t>(sel.size());
  Selection misses(heads);
  int64_t reused = 0;
  bool reads_inflight = false;
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t c : sel[g]) {
      const int32_t slot = res.Find(g, c);
      if (slot < 0) {
        misses[g].push_back(c);
        continue;
      }
      reads_inflight = reads_inflight || res.inflight(g, slot);
      const bool prefetched = g < static_cast<int64_t>(st.prefetch_chunks.size()) &&
                              std::binary_search(st.prefetch_chunks[g].begin(), st.prefetch_chunks[g].end(), c);
      reused += prefetched ? 0 : 1;
    }
  }
  std::vector<kvpool::ChunkRef> refs;
  std::vector<BlockDst> dsts;
  int64_t evicted = 0;
  for (int64_t g = 0; g < heads; ++g) {
    std::vector<int32_t> slots;
    // Misses go only into slots no transfer is writing: when too few are free, the layer's
    // prefetch is waited first (it has landed by now in the common case), then every slot is.
    bool assigned = res.Assign(g, misses[g], sel[g], /*allow_inflight=*/false, /*inflight=*/false, &slots, &evicted);
    if (!assigned && st.prefetch.pending) {
      RETURN_IF_ERROR(WaitPrefetch(st));
      assigned = res.Assign(g, misses[g], sel[g], /*allow_inflight=*/false, /*inflight=*/false, &slots, &evicted);
    }
    if (!assigned) {
      res.Clear();
      return absl::InternalError(absl::StrCat("resident set of layer ", layer, " has ", res.slots_per_head(),
                                              " slots per head, fewer than the selection needs"));
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      refs.push_back({static_cast<int32_t>(layer), static_cast<int32_t>(g), misses[g][i]});
      dsts.push_back(DstAt(st.slots, res.BlockIndex(g, slots[i])));
    }
  }
  if (absl::Status started = chunks_.StartLanding(s.store_id, refs, std::move(dsts), kvpool::Priority::kUrgent, &r.urgent);
      !started.ok()) {
    res.Clear();
    return started;
  }
  r.wait_prefetch = reads_inflight;
  if (count) {  // counted once the fetch has landed (FinishResidentFetch)
    r.count_urgent = static_cast<int64_t>(refs.size());
    r.count_reused = reused;
    r.count_evicted = evicted;
  } else {
    r.count_urgent = r.count_reused = r.count_evicted = 0;
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::FinishResidentFetch(Seq& s, int64_t layer, DecodeRead& r) {
  LayerState& st = s.layers[layer];
  ResidentSet& res = st.resident;
  absl::Status status = r.wait_prefetch ? WaitPrefetch(st) : absl::OkStatus();
  r.wait_prefetch = false;
  if (r.urgent.pending) {
    absl::Status st_urgent = chunks_.FinishLanding(r.urgent, backend::Queue::kUrgent);
    if (!st_urgent.ok()) res.Clear();
    status.Update(st_urgent);
  }
  RETURN_IF_ERROR(status);
  const int64_t stamp = ++st.stamp;
  r.blocks.clear();
  for (size_t g = 0; g < r.sel.size(); ++g) {
    for (int64_t c : r.sel[g]) {
      const int32_t slot = res.Find(static_cast<int64_t>(g), c);
      res.Touch(static_cast<int64_t>(g), slot, stamp);
      r.blocks.push_back(BlockAt(st.slots, res.BlockIndex(static_cast<int64_t>(g), slot)));
    }
  }
  CountUrgent(s, layer, r.count_urgent);
  LayerStats& stats = stats_[layer];
  stats.reused += r.count_reused;
  stats.evictions += r.count_evicted;
  return absl::OkStatus();
}

absl::Status SparseKvCache::IssueResidentPrefetch(Seq& s, int64_t layer, Selection predicted, bool seeded) {
  LayerState& st = s.layers[layer];
  RETURN_IF_ERROR(EnsureSlots(st));
  RETURN_IF_ERROR(WaitPrefetch(st));  // an earlier prediction no real row read
  ResidentSet& res = st.resident;
  const int64_t heads = static_cast<int64_t>(predicted.size());
  Selection incoming(heads);
  std::vector<kvpool::ChunkRef> refs;
  std::vector<BlockDst> dsts;
  int64_t evicted = 0;
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t c : predicted[g]) {
      if (res.Find(g, c) < 0) incoming[g].push_back(c);
    }
    // Never more than the slots outside P' (only with a budget above the slots; kept safe).
    const int64_t room = res.Available(g, predicted[g], /*allow_inflight=*/false);
    if (static_cast<int64_t>(incoming[g].size()) > room) incoming[g].resize(room);
    std::vector<int32_t> slots;
    (void)res.Assign(g, incoming[g], predicted[g], /*allow_inflight=*/false, /*inflight=*/true, &slots, &evicted);
    for (size_t i = 0; i < slots.size(); ++i) {
      refs.push_back({static_cast<int32_t>(layer), static_cast<int32_t>(g), incoming[g][i]});
      dsts.push_back(DstAt(st.slots, res.BlockIndex(g, slots[i])));
    }
  }
  // One background job: the store serves it in pieces and lets urgent misses go between them
  // (TransferQueue), so an urgent miss waits for at most one piece.
  const bool none = refs.empty();
  if (absl::Status started = chunks_.StartLanding(s.store_id, refs, std::move(dsts), kvpool::Priority::kBackground, &st.prefetch);
      !started.ok()) {
    res.Clear();
    return started;
  }
  if (none) res.Landed();
  CountPrefetched(s, layer, static_cast<int64_t>(refs.size()));
  stats_[layer].evictions += evicted;
  st.issued = true;
  st.issued_seeded = seeded;
  st.issued_sel = std::move(predicted);
  st.prefetch_chunks = std::move(incoming);
  return absl::OkStatus();
}

}  // namespace dd::engine
