#include "decode-worker/engine/dense_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "decode-worker/engine/attention_ops.h"

namespace dd::engine {

DenseKvCache::DenseKvCache(const model::ModelConfig& config, backend::Ops& ops) : config_(config), ops_(ops) {}

DenseKvCache::Slot& DenseKvCache::GetSlot(int32_t seq) {
  if (seq >= static_cast<int32_t>(slots_.size())) slots_.resize(seq + 1);
  Slot& s = slots_[seq];
  if (s.k.empty()) {
    s.k.resize(config_.n_layer);
    s.v.resize(config_.n_layer);
    s.ring.assign(config_.n_layer, 0);
    s.length.assign(config_.n_layer, 0);
    s.spec_pos.assign(config_.n_layer, -1);
  }
  return s;
}

absl::Status DenseKvCache::KeepSpeculative(int32_t seq, int64_t layers) {
  if (seq < 0 || layers < 0 || layers > config_.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("keep speculative KV: slot ", seq, ", layers ", layers));
  }
  Slot& slot = GetSlot(seq);
  for (int64_t l = 0; l < layers; ++l) {
    if (slot.spec_pos[l] < 0 || slot.spec_pos[l] != slot.length[l]) {
      return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " layer ", l, ": no speculative row at position ",
                                                        slot.length[l], " to keep"));
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    ++slot.length[l];
    slot.spec_pos[l] = -1;
  }
  return absl::OkStatus();
}

void DenseKvCache::Reset(int32_t seq) {
  if (seq < static_cast<int32_t>(slots_.size())) slots_[seq] = Slot();
}

absl::Status DenseKvCache::Copy(int32_t src, int32_t dst) {
  if (src == dst) return absl::OkStatus();
  GetSlot(src);
  GetSlot(dst);
  slots_[dst] = slots_[src];
  return absl::OkStatus();
}

int64_t DenseKvCache::Length(int32_t seq) const {
  if (seq >= static_cast<int32_t>(slots_.size()) || slots_[seq].length.empty()) return 0;
  int64_t n = 0;
  for (int64_t l : slots_[seq].length) n = std::max(n, l);
  return n;
}

int64_t DenseKvCache::device_bytes() const {
  int64_t total = 0;
  for (const Slot& s : slots_) {
    for (const auto& k : s.k) total += k.size() * sizeof(float);
    for (const auto& v : s.v) total += v.size() * sizeof(float);
  }
  return total;
}

const float* DenseKvCache::KRow(int32_t seq, int64_t layer, int64_t pos) const {
  if (seq < 0 || seq >= static_cast<int32_t>(slots_.size()) || slots_[seq].k.empty()) return nullptr;
  const Slot& s = slots_[seq];
  const int64_t ring = s.ring[layer];
  if (pos < 0 || pos >= s.length[layer] || (ring > 0 && pos < s.length[layer] - ring)) return nullptr;
  return &s.k[layer][RowOf(s, layer, pos) * config_.n_head_kv * config_.head_dim];
}

const float* DenseKvCache::VRow(int32_t seq, int64_t layer, int64_t pos) const {
  const float* k = KRow(seq, layer, pos);
  if (k == nullptr) return nullptr;
  const Slot& s = slots_[seq];
  return &s.v[layer][RowOf(s, layer, pos) * config_.n_head_kv * config_.head_dim];
}

void DenseKvCache::LoadRows(int32_t seq, int64_t layer, int64_t length, const float* k, const float* v, int64_t n) {
  Slot& slot = GetSlot(seq);
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  const bool sliding = config_.layer_is_swa[layer];
  // A sliding layer gets the decode-time ring of window + 1 rows; the next prefill chunk
  // grows it (Reserve re-homes what it keeps). A global layer holds every position.
  const int64_t ring = sliding ? config_.sliding_window + 1 : 0;
  slot.ring[layer] = ring;
  slot.k[layer].assign((sliding ? ring : length) * kv_dim, 0.0f);
  slot.v[layer].assign((sliding ? ring : length) * kv_dim, 0.0f);
  slot.length[layer] = length;
  slot.spec_pos[layer] = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = length - n + i;
    if (sliding && pos < length - ring) continue;
    const int64_t row = RowOf(slot, layer, pos);
    std::memcpy(&slot.k[layer][row * kv_dim], k + i * kv_dim, kv_dim * sizeof(float));
    std::memcpy(&slot.v[layer][row * kv_dim], v + i * kv_dim, kv_dim * sizeof(float));
  }
}

absl::Status DenseKvCache::Attend(const model::AttentionCall& call) {
  const int64_t n = static_cast<int64_t>(call.rows.size());
  int64_t r0 = 0;
  while (r0 < n) {
    int64_t r1 = r0 + 1;
    while (r1 < n && call.rows[r1].seq == call.rows[r0].seq) ++r1;
    const int32_t seq = call.rows[r0].seq;
    if (seq < 0) return absl::InvalidArgumentError(absl::StrCat("negative sequence slot ", seq));
    Slot& slot = GetSlot(seq);
    // Rows must continue the sequence in this layer: positions length, length+1, ...
    const int64_t base = slot.length[call.layer];
    for (int64_t r = r0; r < r1; ++r) {
      if (call.rows[r].pos != base + (r - r0)) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, ": row position ", call.rows[r].pos,
                                                       " does not continue the cache (expected ", base + (r - r0), ")"));
      }
      if (call.rows[r].speculative && r != r1 - 1) {
        return absl::InvalidArgumentError(absl::StrCat("sequence ", seq, ": a speculative row must be the last"));
      }
    }
    // A speculative row's KV is written at its position (so it can see itself) but not
    // counted: the next row at that position overwrites it, unless KeepSpeculative keeps it.
    AttendGroup(call, slot, r0, r1);
    const bool spec = call.rows[r1 - 1].speculative;
    slot.length[call.layer] += (r1 - r0) - (spec ? 1 : 0);
    slot.spec_pos[call.layer] = spec ? call.rows[r1 - 1].pos : -1;
    r0 = r1;
  }
  return absl::OkStatus();
}

void DenseKvCache::Reserve(Slot& slot, int64_t layer, bool sliding, int64_t window, int64_t p0, int64_t p1) {
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  std::vector<float>& K = slot.k[layer];
  std::vector<float>& V = slot.v[layer];
  const int64_t ring = slot.ring[layer];
  if (!sliding) {
    const size_t need = static_cast<size_t>((p1 + 1) * kv_dim);
    if (K.capacity() < need) {
      const size_t cap = std::max(need, K.capacity() * 2);
      K.reserve(cap);
      V.reserve(cap);
    }
    K.resize(std::max(K.size(), need));
    V.resize(std::max(V.size(), need));
    return;
  }
  // A ring of R rows holds the last R positions. Writing [p0, p1] must not overwrite a
  // position some row still sees (the oldest is p0 - window + 1): R >= window - 1 + rows.
  // A ring grown for prefill chunks shrinks back to window + 1 rows once decoding starts.
  const int64_t rows = p1 - p0 + 1;
  const int64_t need_rows = window - 1 + rows;
  const bool shrink = rows <= 2 && ring > window + 1;
  if (ring >= need_rows && !shrink) return;
  const int64_t new_ring = shrink ? window + 1 : std::max<int64_t>(need_rows, ring * 2);
  std::vector<float> nk(new_ring * kv_dim), nv(new_ring * kv_dim);
  const int64_t keep = std::min(ring, new_ring - rows);  // stored positions the new ring keeps
  for (int64_t pos = std::max<int64_t>(0, p0 - keep); pos < p0; ++pos) {  // re-home them
    const int64_t from = pos % ring;
    std::memcpy(&nk[(pos % new_ring) * kv_dim], &K[from * kv_dim], kv_dim * sizeof(float));
    std::memcpy(&nv[(pos % new_ring) * kv_dim], &V[from * kv_dim], kv_dim * sizeof(float));
  }
  K.swap(nk);
  V.swap(nv);
  slot.ring[layer] = new_ring;
}

void DenseKvCache::AttendGroup(const model::AttentionCall& call, Slot& slot, int64_t r0, int64_t r1) {
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  const int64_t nr = r1 - r0;
  const int64_t p0 = call.rows[r0].pos, p1 = call.rows[r1 - 1].pos;
  const int64_t layer = call.layer;
  Reserve(slot, layer, call.sliding, call.window, p0, p1);
  std::vector<float>& K = slot.k[layer];
  std::vector<float>& V = slot.v[layer];
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t row = RowOf(slot, layer, p0 + r);
    std::memcpy(&K[row * kv_dim], call.k + (r0 + r) * kv_dim, kv_dim * sizeof(float));
    std::memcpy(&V[row * kv_dim], call.v + (r0 + r) * kv_dim, kv_dim * sizeof(float));
  }

  // Keys any row of the group may see: [lo, p1], at most two runs of storage rows (the ring
  // may wrap).
  const int64_t lo = call.sliding ? std::max<int64_t>(0, p0 - call.window + 1) : 0;
  const int64_t n_keys = p1 + 1 - lo;
  const int64_t a0 = RowOf(slot, layer, lo);
  const int64_t ring = slot.ring[layer];
  const int64_t len_a = ring > 0 ? std::min(n_keys, ring - a0) : n_keys;
  const backend::KvRun runs[2] = {{&K[a0 * kv_dim], &V[a0 * kv_dim], len_a}, {K.data(), V.data(), n_keys - len_a}};
  ops_.AttendCausal(CausalRows(call, config_, r0, r1, lo, runs, &positions_));
}

}  // namespace dd::engine
