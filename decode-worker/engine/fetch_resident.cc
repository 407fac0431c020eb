// The resident fetch strategy (`sparse-cached`, `dualdecoder`): chunks stay resident across
// decode steps in a ResidentSet per (sequence, sparse layer); only what is not resident moves.
// docs/decisions/0012-resident-set.md.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/fetch_policy.h"
#include "decode-worker/engine/resident_set.h"
#include "decode-worker/engine/sparse_rows.h"

namespace dd::engine {
namespace {

int64_t CountCommon(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {  // both ascending
  int64_t n = 0;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    if (a[i] < b[j]) {
      ++i;
    } else if (b[j] < a[i]) {
      ++j;
    } else {
      ++n, ++i, ++j;
    }
  }
  return n;
}

// One (sequence, sparse layer): the resident chunks and their slots, the background gather
// writing its in-flight slots, the prediction last issued (P', for hit statistics) and the part
// of it that was actually fetched (P' \ resident).
struct LayerResidents {
  backend::DeviceBuffer slots;  // the resident set's blocks
  ResidentSet set;
  int64_t stamp = 0;  // real reads so far (least-recently-used clock)
  ChunkStore::Landing prefetch;
  bool issued = false, issued_seeded = false;
  bool prefetch_values_only = false;  // the prefetch moved V halves alone
  Selection issued_sel, prefetch_chunks;
};

class ResidentFetch final : public FetchPolicy {
 public:
  explicit ResidentFetch(const FetchContext& ctx) : ctx_(ctx) {}
  ~ResidentFetch() override {
    for (size_t slot = 0; slot < seqs_.size(); ++slot) Release(static_cast<int32_t>(slot));
  }

  absl::Status Reserve(int32_t slot, absl::Span<const int64_t> layers) override {
    for (int64_t l : layers) RETURN_IF_ERROR(EnsureSlots(Layer(slot, l)));
    return absl::OkStatus();
  }
  absl::Status Start(const FetchSeq& s, int64_t layer, bool real, DecodeRead& r) override;
  absl::Status Finish(const FetchSeq& s, int64_t layer, bool real, DecodeRead& r) override;
  absl::Status Prefetch(const FetchSeq& s, int64_t layer, Selection predicted, bool seeded) override;
  void WaitAll(int32_t slot) override {
    if (slot < static_cast<int32_t>(seqs_.size())) {
      for (LayerResidents& st : seqs_[slot]) (void)WaitPrefetch(st);
    }
  }
  void Release(int32_t slot) override {
    if (slot < 0 || slot >= static_cast<int32_t>(seqs_.size())) return;
    for (LayerResidents& st : seqs_[slot]) ctx_.device.Free(st.slots);
    seqs_[slot].clear();
  }
  absl::Status Copy(int32_t src, int32_t dst) override;
  int64_t device_bytes() const override {
    int64_t n = 0;
    for (const auto& seq : seqs_) {
      for (const LayerResidents& st : seq) n += st.slots.bytes;
    }
    return n;
  }

 private:
  LayerResidents& Layer(int32_t slot, int64_t layer) {
    if (slot >= static_cast<int32_t>(seqs_.size())) seqs_.resize(slot + 1);
    if (seqs_[slot].empty()) seqs_[slot].resize(ctx_.config.n_layer);
    return seqs_[slot][layer];
  }
  // Makes every chunk of r's selection resident, the missing ones on the urgent path (started,
  // not waited); `real`: counted once landed.
  absl::Status StartMisses(const FetchSeq& s, int64_t layer, bool real, LayerResidents& st, DecodeRead& r);
  absl::Status EnsureSlots(LayerResidents& st) {
    if (st.set.initialized()) return absl::OkStatus();
    const int64_t slots = (ctx_.options.budget_tokens + ctx_.options.resident_margin_tokens) / ctx_.options.chunk_tokens;
    ASSIGN_OR_RETURN(st.slots, AllocateOrEmpty(ctx_.device, backend::MemoryTag::kResidentSlots,
                                               ctx_.config.n_head_kv * slots * ctx_.chunks.block_bytes()));
    st.set.Init(ctx_.config.n_head_kv, slots);
    return absl::OkStatus();
  }
  ChunkStore::BlockDst DstAt(const LayerResidents& st, int64_t block) const {
    return {st.slots, block * ctx_.chunks.block_bytes()};
  }
  absl::Status WaitPrefetch(LayerResidents& st) {
    if (!st.prefetch.pending) return absl::OkStatus();
    const absl::Status status = ctx_.chunks.FinishLanding(st.prefetch, backend::Queue::kPrefetch);
    st.set.Landed();
    if (!status.ok()) st.set.Clear();  // the slots it was writing hold nothing usable
    return status;
  }

  FetchContext ctx_;
  std::vector<std::vector<LayerResidents>> seqs_;  // per slot, per model layer
};

absl::Status ResidentFetch::Start(const FetchSeq& s, int64_t layer, bool real, DecodeRead& r) {
  LayerResidents& st = Layer(s.slot, layer);
  const Selection& sel = r.pick.sel;
  if (real && st.issued) {  // how good the prediction was, and what of its transfer went unused
    for (size_t g = 0; g < sel.size(); ++g) {
      const int64_t unused =
          static_cast<int64_t>(st.prefetch_chunks[g].size()) - CountCommon(sel[g], st.prefetch_chunks[g]);
      ctx_.stats.Prediction(*s.counts, layer, CountCommon(sel[g], st.issued_sel[g]),
                            static_cast<int64_t>(sel[g].size()), unused, st.issued_seeded, st.prefetch_values_only);
    }
  }
  absl::Status started = StartMisses(s, layer, real, st, r);
  if (real) {  // the prediction is consumed, whatever happened
    st.issued = false;
    st.prefetch_chunks.clear();
    st.issued_sel.clear();
  }
  return started;
}

absl::Status ResidentFetch::StartMisses(const FetchSeq& s, int64_t layer, bool real, LayerResidents& st,
                                        DecodeRead& r) {
  const Selection& sel = r.pick.sel;
  RETURN_IF_ERROR(EnsureSlots(st));
  ResidentSet& res = st.set;
  const int64_t heads = static_cast<int64_t>(sel.size());
  Selection misses(heads);
  int64_t reused = 0;
  bool reads_inflight = false;
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t c : sel[g]) {
      int32_t slot = res.Find(g, c);
      if (slot >= 0 && !s.values_only && res.keys(g, slot) != ResidentSet::KeyState::kStored) {
        // Its K half holds rebuilt keys (or none) and this step reads the stored ones: fetched again.
        if (res.inflight(g, slot)) RETURN_IF_ERROR(WaitPrefetch(st));
        res.Drop(g, c);
        slot = -1;
      }
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
  std::vector<ChunkStore::BlockDst> dsts;
  int64_t evicted = 0;
  for (int64_t g = 0; g < heads; ++g) {
    std::vector<int32_t> slots;
    // Misses go only into slots no transfer is writing: when too few are free, the layer's
    // prefetch is waited first (it has landed by now in the common case), then every slot is.
    bool assigned = res.Assign(g, misses[g], sel[g], /*allow_inflight=*/false, /*inflight=*/false, &slots, &evicted,
                               s.values_only);
    if (!assigned && st.prefetch.pending) {
      RETURN_IF_ERROR(WaitPrefetch(st));
      assigned = res.Assign(g, misses[g], sel[g], /*allow_inflight=*/false, /*inflight=*/false, &slots, &evicted,
                            s.values_only);
    }
    if (!assigned) {
      res.Clear();
      return absl::InternalError(absl::StrCat("resident set of layer ", layer, " has ", res.slots_per_head(),
                                              " slots per head, fewer than the selection needs"));
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      refs.push_back({static_cast<int32_t>(layer), static_cast<int32_t>(g), misses[g][i]});
      dsts.push_back(DstAt(st, res.BlockIndex(g, slots[i])));
    }
  }
  if (absl::Status started = ctx_.chunks.StartLanding(s.store_id, refs, std::move(dsts), kvpool::Priority::kUrgent,
                                                      &r.fetch.urgent, s.part());
      !started.ok()) {
    res.Clear();
    return started;
  }
  r.fetch.wait_prefetch = reads_inflight;
  // Counted once the fetch has landed (Finish).
  r.fetch.count_urgent = real ? static_cast<int64_t>(refs.size()) : 0;
  r.fetch.count_reused = real ? reused : 0;
  r.fetch.count_evicted = real ? evicted : 0;
  return absl::OkStatus();
}

absl::Status ResidentFetch::Finish(const FetchSeq& s, int64_t layer, bool, DecodeRead& r) {
  LayerResidents& st = Layer(s.slot, layer);
  ResidentSet& res = st.set;
  absl::Status status = r.fetch.wait_prefetch ? WaitPrefetch(st) : absl::OkStatus();
  r.fetch.wait_prefetch = false;
  if (r.fetch.urgent.pending) {
    absl::Status urgent = ctx_.chunks.FinishLanding(r.fetch.urgent, backend::Queue::kUrgent);
    if (!urgent.ok()) res.Clear();
    status.Update(urgent);
  }
  RETURN_IF_ERROR(status);
  const int64_t stamp = ++st.stamp;
  const uint8_t* base = static_cast<const uint8_t*>(st.slots.data);
  const int64_t block_bytes = ctx_.chunks.block_bytes();
  r.fetch.blocks.clear();
  r.fetch.rebuild.clear();
  for (size_t g = 0; g < r.pick.sel.size(); ++g) {
    for (int64_t c : r.pick.sel[g]) {
      const int32_t slot = res.Find(static_cast<int64_t>(g), c);
      res.Touch(static_cast<int64_t>(g), slot, stamp);
      if (s.values_only) {  // the caller rebuilds the keys of the slots not holding rebuilt keys yet
        r.fetch.rebuild.push_back(res.keys(static_cast<int64_t>(g), slot) != ResidentSet::KeyState::kRebuilt);
        res.set_keys(static_cast<int64_t>(g), slot, ResidentSet::KeyState::kRebuilt);
      }
      r.fetch.blocks.push_back(base + res.BlockIndex(static_cast<int64_t>(g), slot) * block_bytes);
    }
  }
  ctx_.stats.Urgent(*s.counts, layer, r.fetch.count_urgent, s.values_only);
  ctx_.stats.Reused(layer, r.fetch.count_reused);
  ctx_.stats.Evicted(layer, r.fetch.count_evicted);
  return absl::OkStatus();
}

absl::Status ResidentFetch::Prefetch(const FetchSeq& s, int64_t layer, Selection predicted, bool seeded) {
  LayerResidents& st = Layer(s.slot, layer);
  RETURN_IF_ERROR(EnsureSlots(st));
  RETURN_IF_ERROR(WaitPrefetch(st));  // an earlier prediction no real row read
  ResidentSet& res = st.set;
  const int64_t heads = static_cast<int64_t>(predicted.size());
  Selection incoming(heads);
  std::vector<kvpool::ChunkRef> refs;
  std::vector<ChunkStore::BlockDst> dsts;
  int64_t evicted = 0;
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t c : predicted[g]) {
      const int32_t slot = res.Find(g, c);
      // Rebuilt keys (or none) where the stored ones will be read: fetched again (nothing is in
      // flight).
      if (slot >= 0 && !s.values_only && res.keys(g, slot) != ResidentSet::KeyState::kStored) res.Drop(g, c);
      if (res.Find(g, c) < 0) incoming[g].push_back(c);
    }
    // Never more than the slots outside P' (only with a budget above the slots; kept safe).
    const int64_t room = res.Available(g, predicted[g], /*allow_inflight=*/false);
    if (static_cast<int64_t>(incoming[g].size()) > room) incoming[g].resize(room);
    std::vector<int32_t> slots;
    (void)res.Assign(g, incoming[g], predicted[g], /*allow_inflight=*/false, /*inflight=*/true, &slots, &evicted,
                     s.values_only);
    for (size_t i = 0; i < slots.size(); ++i) {
      refs.push_back({static_cast<int32_t>(layer), static_cast<int32_t>(g), incoming[g][i]});
      dsts.push_back(DstAt(st, res.BlockIndex(g, slots[i])));
    }
  }
  // One background job: the store serves it in pieces and lets urgent misses go between them
  // (TransferQueue), so an urgent miss waits for at most one piece.
  const bool none = refs.empty();
  if (absl::Status started = ctx_.chunks.StartLanding(s.store_id, refs, std::move(dsts), kvpool::Priority::kBackground,
                                                      &st.prefetch, s.part());
      !started.ok()) {
    res.Clear();
    return started;
  }
  if (none) res.Landed();
  ctx_.stats.Prefetched(*s.counts, layer, static_cast<int64_t>(refs.size()), s.values_only);
  st.prefetch_values_only = s.values_only;
  ctx_.stats.Evicted(layer, evicted);
  st.issued = true;
  st.issued_seeded = seeded;
  st.issued_sel = std::move(predicted);
  st.prefetch_chunks = std::move(incoming);
  return absl::OkStatus();
}

absl::Status ResidentFetch::Copy(int32_t src, int32_t dst) {
  Layer(src, 0);
  Layer(dst, 0);
  std::vector<LayerResidents>& to = seqs_[dst];
  const std::vector<LayerResidents>& from = seqs_[src];
  for (size_t l = 0; l < from.size(); ++l) {
    to[l] = from[l];  // the bookkeeping as it is (src's prefetch has landed: WaitAll)
    to[l].prefetch = ChunkStore::Landing();
    RETURN_IF_ERROR(DuplicateBuffer(ctx_.device, from[l].slots, /*contents=*/true, &to[l].slots));
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<FetchPolicy> NewResidentFetch(const FetchContext& ctx) { return std::make_unique<ResidentFetch>(ctx); }

}  // namespace dd::engine
