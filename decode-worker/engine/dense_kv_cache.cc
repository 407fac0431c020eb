#include "decode-worker/engine/dense_kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/attention_ops.h"
#include "decode-worker/engine/kv_block.h"
#include "glog/logging.h"

namespace dd::engine {

using backend::MemoryTag;
using backend::Queue;

DenseKvCache::DenseKvCache(const model::ModelConfig& config, backend::Device& device, KvDtype kv)
    : config_(config), device_(device), kv_(kv) {}

DenseKvCache::~DenseKvCache() {
  for (size_t s = 0; s < slots_.size(); ++s) Reset(static_cast<int32_t>(s));
}

DenseKvCache::Slot& DenseKvCache::GetSlot(int32_t seq) {
  if (seq >= static_cast<int32_t>(slots_.size())) slots_.resize(seq + 1);
  Slot& s = slots_[seq];
  if (s.layers.empty()) s.layers.resize(config_.n_layer);
  return s;
}

void DenseKvCache::FreeLayer(Layer& L) {
  device_.Free(L.k);
  device_.Free(L.v);
  L = Layer();
}

void DenseKvCache::Reset(int32_t seq) {
  if (seq < 0 || seq >= static_cast<int32_t>(slots_.size()) || slots_[seq].layers.empty()) return;
  // Attention still queued may read the buffers: the queue finishes before they are freed.
  const absl::Status st = device_.Synchronize(device_.Record(Queue::kCompute));
  LOG_IF(ERROR, !st.ok()) << "dense KV: compute queue failed before freeing slot " << seq << ": " << st;
  for (Layer& L : slots_[seq].layers) FreeLayer(L);
  slots_[seq] = Slot();
}

absl::Status DenseKvCache::ReserveLayers(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows,
                                         const std::vector<bool>* only) {
  if (seq < 0 || prompt_tokens <= 0 || total_tokens < prompt_tokens || pass_rows <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("dense KV reservation: slot ", seq, ", ", prompt_tokens,
                                                   " prompt tokens, ", total_tokens, " in all, passes of ", pass_rows));
  }
  Slot& slot = GetSlot(seq);
  for (const Layer& L : slot.layers) {
    if (L.cap > 0 || L.length > 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is in use"));
  }
  const int64_t window = config_.sliding_window;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (only != nullptr && !(*only)[l]) continue;
    const bool sliding = config_.layer_is_swa[l];
    const int64_t cap = sliding ? std::max(window + 1, window - 1 + std::min(prompt_tokens, pass_rows)) : total_tokens;
    if (absl::Status st = Resize(slot.layers[l], cap, sliding, 0); !st.ok()) {
      Reset(seq);
      return st;
    }
  }
  return absl::OkStatus();
}

absl::Status DenseKvCache::FinishPrefill(int32_t seq) {
  if (seq < 0 || seq >= static_cast<int32_t>(slots_.size())) return absl::OkStatus();
  const int64_t ring = config_.sliding_window + 1;
  for (Layer& L : slots_[seq].layers) {
    if (L.ring > ring) RETURN_IF_ERROR(Resize(L, ring, true, 0));
  }
  return absl::OkStatus();
}

absl::Status DenseKvCache::Resize(Layer& L, int64_t cap, bool ring, int64_t keep_from) {
  const int64_t row = RowBytes();
  Layer N;
  N.cap = cap;
  N.ring = ring ? cap : 0;
  N.length = L.length;
  N.spec_pos = L.spec_pos;
  ASSIGN_OR_RETURN(N.k, device_.Allocate(MemoryTag::kKv, cap * row));
  auto v = device_.Allocate(MemoryTag::kKv, cap * row);
  if (!v.ok()) {
    device_.Free(N.k);
    return v.status();
  }
  N.v = *v;
  // What L stores: [.., end), the last speculative row included; N keeps what fits of it.
  const int64_t end = L.length + (L.spec_pos == L.length ? 1 : 0);
  int64_t from = std::max<int64_t>(keep_from, 0);
  if (L.ring > 0) from = std::max(from, end - L.ring);
  if (N.ring > 0) from = std::max(from, end - N.ring);
  for (int64_t a = from; a < end && L.cap > 0;) {
    // A run of positions contiguous in both layouts.
    int64_t len = end - a;
    if (L.ring > 0) len = std::min(len, L.ring - a % L.ring);
    if (N.ring > 0) len = std::min(len, N.ring - a % N.ring);
    RETURN_IF_ERROR(device_.Copy(Queue::kCompute, L.k, RowOf(L, a) * row, N.k, RowOf(N, a) * row, len * row));
    RETURN_IF_ERROR(device_.Copy(Queue::kCompute, L.v, RowOf(L, a) * row, N.v, RowOf(N, a) * row, len * row));
    a += len;
  }
  if (L.cap > 0) {
    RETURN_IF_ERROR(device_.Synchronize(device_.Record(Queue::kCompute)));
    FreeLayer(L);
  }
  L = N;
  return absl::OkStatus();
}

absl::Status DenseKvCache::StoreRows(Layer& L, int64_t p0, int64_t p1, const backend::DeviceBuffer& src_buf,
                                     const float* k, const float* v) {
  const int64_t row = RowBytes(), kv_dim = config_.n_head_kv * config_.head_dim;
  for (int64_t a = p0; a < p1;) {
    int64_t len = p1 - a;
    if (L.ring > 0) len = std::min(len, L.ring - a % L.ring);
    const int64_t dst = RowOf(L, a) * row, i = (a - p0) * kv_dim;
    if (kv_ != KvDtype::kF32) {  // narrowed on the compute queue, straight into the rows
      device_.ops().StoreKv(k + i, len * kv_dim, kv_, static_cast<char*>(L.k.data) + dst);
      device_.ops().StoreKv(v + i, len * kv_dim, kv_, static_cast<char*>(L.v.data) + dst);
    } else if (src_buf) {
      const auto offset = [&](const float* p) {
        return static_cast<int64_t>(reinterpret_cast<const char*>(p) - static_cast<const char*>(src_buf.data));
      };
      RETURN_IF_ERROR(device_.Copy(Queue::kCompute, src_buf, offset(k + i), L.k, dst, len * row));
      RETURN_IF_ERROR(device_.Copy(Queue::kCompute, src_buf, offset(v + i), L.v, dst, len * row));
    } else {
      RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, k + i, L.k, dst, len * row));
      RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, v + i, L.v, dst, len * row));
    }
    a += len;
  }
  return absl::OkStatus();
}

absl::Status DenseKvCache::CopyRowsIn(Layer& L, int64_t p0, int64_t p1, const void* k, const void* v) {
  const int64_t row = RowBytes();
  for (int64_t a = p0; a < p1;) {
    int64_t len = p1 - a;
    if (L.ring > 0) len = std::min(len, L.ring - a % L.ring);
    const int64_t dst = RowOf(L, a) * row, i = (a - p0) * row;
    RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, static_cast<const char*>(k) + i, L.k, dst, len * row));
    RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, static_cast<const char*>(v) + i, L.v, dst, len * row));
    a += len;
  }
  return absl::OkStatus();
}

absl::Status DenseKvCache::KeepSpeculative(int32_t seq, int64_t layers) {
  if (seq < 0 || layers < 0 || layers > config_.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("keep speculative KV: slot ", seq, ", layers ", layers));
  }
  Slot& slot = GetSlot(seq);
  for (int64_t l = 0; l < layers; ++l) {
    const Layer& L = slot.layers[l];
    if (L.spec_pos < 0 || L.spec_pos != L.length) {
      return absl::FailedPreconditionError(
          absl::StrCat("slot ", seq, " layer ", l, ": no speculative row at position ", L.length, " to keep"));
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    ++slot.layers[l].length;
    slot.layers[l].spec_pos = -1;
  }
  return absl::OkStatus();
}

absl::Status DenseKvCache::Copy(int32_t src, int32_t dst) {
  if (src == dst) return absl::OkStatus();
  if (src < 0 || dst < 0) return absl::InvalidArgumentError(absl::StrCat("copy of slot ", src, " to ", dst));
  Reset(dst);
  GetSlot(src);
  Slot& to = GetSlot(dst);
  const Slot& from = slots_[src];  // after GetSlot(dst): slots_ may have moved
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    const Layer& F = from.layers[l];
    Layer& T = to.layers[l];
    T = Layer();
    if (F.cap == 0) {
      T = F;
      continue;
    }
    absl::Status st = Resize(T, F.cap, F.ring > 0, 0);
    // The rows in use: a whole ring, or a linear layer's stored positions.
    const int64_t used = (F.ring > 0 ? F.cap : std::min(F.cap, F.length + 1)) * RowBytes();
    if (st.ok()) st = device_.Copy(Queue::kCompute, F.k, 0, T.k, 0, used);
    if (st.ok()) st = device_.Copy(Queue::kCompute, F.v, 0, T.v, 0, used);
    if (!st.ok()) {
      Reset(dst);
      return st;
    }
    T.length = F.length;
    T.spec_pos = F.spec_pos;
  }
  return absl::OkStatus();
}

int64_t DenseKvCache::Length(int32_t seq) const {
  if (seq < 0 || seq >= static_cast<int32_t>(slots_.size())) return 0;
  int64_t n = 0;
  for (const Layer& L : slots_[seq].layers) n = std::max(n, L.length);
  return n;
}

int64_t DenseKvCache::device_bytes() const {
  int64_t total = 0;
  for (const Slot& s : slots_) {
    for (const Layer& L : s.layers) total += L.k.bytes + L.v.bytes;
  }
  return total;
}

const void* DenseKvCache::KRow(int32_t seq, int64_t layer, int64_t pos) const {
  if (seq < 0 || seq >= static_cast<int32_t>(slots_.size()) || slots_[seq].layers.empty()) return nullptr;
  const Layer& L = slots_[seq].layers[layer];
  if (L.cap == 0 || pos < 0 || pos >= L.length || (L.ring > 0 && pos < L.length - L.ring)) return nullptr;
  return static_cast<const char*>(L.k.data) + RowOf(L, pos) * RowBytes();
}

const void* DenseKvCache::VRow(int32_t seq, int64_t layer, int64_t pos) const {
  if (KRow(seq, layer, pos) == nullptr) return nullptr;
  const Layer& L = slots_[seq].layers[layer];
  return static_cast<const char*>(L.v.data) + RowOf(L, pos) * RowBytes();
}

absl::Status DenseKvCache::LoadRows(int32_t seq, int64_t layer, int64_t length, const void* k, const void* v,
                                    int64_t n) {
  if (seq < 0 || layer < 0 || layer >= config_.n_layer || n < 0 || n > length) {
    return absl::InvalidArgumentError(
        absl::StrCat("load KV rows: slot ", seq, " layer ", layer, ", ", n, " of ", length, " positions"));
  }
  Layer& L = GetSlot(seq).layers[layer];
  const bool sliding = config_.layer_is_swa[layer];
  // A sliding layer gets at least the decode-time ring of window + 1 rows (or keeps a larger
  // reserved one); a global layer holds every position.
  const int64_t need = sliding ? config_.sliding_window + 1 : length;
  L.length = 0;
  L.spec_pos = -1;
  if (L.cap < need || (L.ring > 0) != sliding) RETURN_IF_ERROR(Resize(L, std::max(need, L.cap), sliding, length));
  L.length = length;
  const int64_t first = std::max(length - n, sliding ? length - L.ring : 0);
  const int64_t skip = (first - (length - n)) * RowBytes();
  RETURN_IF_ERROR(CopyRowsIn(L, first, length, static_cast<const char*>(k) + skip, static_cast<const char*>(v) + skip));
  return device_.Synchronize(device_.Record(Queue::kCompute));  // the host rows may change after
}

absl::Status DenseKvCache::FillRandom(int32_t seq, int64_t tokens, uint64_t seed) {
  if (tokens <= 0) return absl::InvalidArgumentError(absl::StrCat("random KV of ", tokens, " tokens"));
  if (Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  const RandomKv rows(seed, config_.n_head_kv * config_.head_dim);
  for (int64_t l = 0; l < config_.n_layer; ++l) RETURN_IF_ERROR(FillRandomLayer(seq, l, tokens, rows));
  return absl::OkStatus();
}

absl::Status DenseKvCache::FillRandomLayer(int32_t seq, int64_t layer, int64_t tokens, const RandomKv& rows) {
  // A sliding layer keeps the last window + 1 positions; a global one every position.
  const int64_t n = config_.layer_is_swa[layer] ? std::min(tokens, config_.sliding_window + 1) : tokens;
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  std::vector<float> k(n * kv_dim), v(n * kv_dim);
  rows.Rows(layer, /*values=*/false, tokens - n, tokens, k.data());
  rows.Rows(layer, /*values=*/true, tokens - n, tokens, v.data());
  const KvRows kr = NarrowRows(k.data(), n * kv_dim, kv_), vr = NarrowRows(v.data(), n * kv_dim, kv_);
  return LoadRows(seq, layer, tokens, kr.data(), vr.data(), n);
}

absl::Status DenseKvCache::ReadRows(int32_t seq, int64_t layer, int64_t p0, int64_t p1, void* k, void* v) {
  if (seq < 0 || seq >= static_cast<int32_t>(slots_.size()) || layer < 0 || layer >= config_.n_layer ||
      slots_[seq].layers.empty() || p0 > p1 || KRow(seq, layer, p0) == nullptr ||
      (p1 > p0 && KRow(seq, layer, p1 - 1) == nullptr)) {
    return absl::OutOfRangeError(absl::StrCat("read KV rows: slot ", seq, " layer ", layer, " does not hold positions [",
                                              p0, ", ", p1, ")"));
  }
  const Layer& L = slots_[seq].layers[layer];
  const int64_t row = RowBytes();
  for (int64_t a = p0; a < p1;) {
    int64_t len = p1 - a;
    if (L.ring > 0) len = std::min(len, L.ring - a % L.ring);
    const int64_t at = (a - p0) * row;
    RETURN_IF_ERROR(device_.CopyToHost(Queue::kCompute, L.k, RowOf(L, a) * row, static_cast<char*>(k) + at, len * row));
    RETURN_IF_ERROR(device_.CopyToHost(Queue::kCompute, L.v, RowOf(L, a) * row, static_cast<char*>(v) + at, len * row));
    a += len;
  }
  return device_.Synchronize(device_.Record(Queue::kCompute));
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
    Layer& L = slot.layers[call.layer];
    // Rows must continue the sequence in this layer: positions length, length+1, ...
    const int64_t base = L.length;
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
    const bool spec = call.rows[r1 - 1].speculative;
    // A sliding layer's real and speculative rows see windows that start one apart: they keep
    // their one causal call (as two groups, Gemma's dualdecoder ran at a median 0.83-0.89x:
    // bench/results/kv-manager-parts.md).
    const bool decode = !call.rows[r0].prefill && (r1 - r0 == 1 || (r1 - r0 == 2 && spec && !call.sliding));
    if (decode) {
      // A sequence given twice in one call: its earlier rows attend before these are stored.
      for (const DecodeRows& d : decode_) {
        if (d.seq == seq) {
          AttendDecodeRows(call);
          break;
        }
      }
      const int64_t p0 = call.rows[r0].pos, p1 = call.rows[r1 - 1].pos, kv_dim = config_.n_head_kv * config_.head_dim;
      RETURN_IF_ERROR(MakeRoom(L, call.sliding, call.window, p0, p1));
      RETURN_IF_ERROR(StoreRows(L, p0, p1 + 1, call.buffer, call.k + r0 * kv_dim, call.v + r0 * kv_dim));
      decode_.push_back({seq, r0, r1});
    } else {
      RETURN_IF_ERROR(AttendGroup(call, slot, r0, r1));
    }
    L.length += (r1 - r0) - (spec ? 1 : 0);
    L.spec_pos = spec ? call.rows[r1 - 1].pos : -1;
    r0 = r1;
  }
  AttendDecodeRows(call);
  return absl::OkStatus();
}

void DenseKvCache::AttendDecodeRows(const model::AttentionCall& call) {
  if (decode_.empty()) return;
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, kv_dim = n_kv * hd, q_dim = config_.n_head * hd;
  // A group's rows see keys from the window's start (0 unless sliding) to the last row's position.
  const auto lo_of = [&](const DecodeRows& d) {
    const int64_t p = call.rows[d.r1 - 1].pos;
    return call.sliding ? std::max<int64_t>(0, p - call.window + 1) : 0;
  };
  int64_t keys = 0;
  for (const DecodeRows& d : decode_) keys += n_kv * (call.rows[d.r1 - 1].pos + 1 - lo_of(d));
  plan_.Begin(keys, static_cast<int64_t>(decode_.size()), n_kv);
  for (const DecodeRows& d : decode_) {
    const Layer& L = slots_[d.seq].layers[call.layer];
    const char* K = static_cast<const char*>(L.k.data);
    const char* V = static_cast<const char*>(L.v.data);
    const int64_t lo = lo_of(d), hi = call.rows[d.r1 - 1].pos, eb = KvDtypeBytes(kv_);
    for (int64_t g = 0; g < n_kv; ++g) {
      for (int64_t p = lo; p <= hi; ++p) {
        const int64_t row = (RowOf(L, p) * kv_dim + g * hd) * eb;
        plan_.Add(K + row, V + row);
      }
      plan_.EndList();
    }
    // A row before the last does not see the keys after its own position.
    backend::ListQuery rows[2];
    for (int64_t r = d.r0; r < d.r1; ++r) rows[r - d.r0] = {call.q + r * q_dim, call.out + r * q_dim, hi - call.rows[r].pos};
    plan_.EndGroup(absl::MakeConstSpan(rows, d.r1 - d.r0));
  }
  decode_.clear();
  plan_.Run(device_.ops(), ShapeOf(config_, kv_), call.scale);
}

absl::Status DenseKvCache::MakeRoom(Layer& L, bool sliding, int64_t window, int64_t p0, int64_t p1) {
  if (!sliding) {
    if (p1 + 1 <= L.cap) return absl::OkStatus();
    return Resize(L, std::max(p1 + 1, 2 * L.cap), false, 0);
  }
  // A ring of R rows holds the last R positions. Writing [p0, p1] must not overwrite a
  // position some row still sees (the oldest is p0 - window + 1): R >= window - 1 + rows.
  // A ring grown for prefill chunks shrinks back to window + 1 rows once decoding starts.
  const int64_t rows = p1 - p0 + 1;
  const int64_t need_rows = window - 1 + rows;
  const bool shrink = rows <= 2 && L.ring > window + 1;
  if (L.ring >= need_rows && !shrink) return absl::OkStatus();
  const int64_t new_ring = shrink ? window + 1 : std::max<int64_t>(need_rows, L.ring * 2);
  const int64_t keep = std::min(L.ring, new_ring - rows);  // stored positions the new ring keeps
  return Resize(L, new_ring, true, p0 - keep);
}

absl::Status DenseKvCache::AttendGroup(const model::AttentionCall& call, Slot& slot, int64_t r0, int64_t r1) {
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  const int64_t p0 = call.rows[r0].pos, p1 = call.rows[r1 - 1].pos;
  Layer& L = slot.layers[call.layer];
  RETURN_IF_ERROR(MakeRoom(L, call.sliding, call.window, p0, p1));
  RETURN_IF_ERROR(StoreRows(L, p0, p1 + 1, call.buffer, call.k + r0 * kv_dim, call.v + r0 * kv_dim));

  // Keys any row of the group may see: [lo, p1], at most two runs of storage rows (the ring
  // may wrap).
  const int64_t lo = call.sliding ? std::max<int64_t>(0, p0 - call.window + 1) : 0;
  const int64_t n_keys = p1 + 1 - lo;
  const int64_t a0 = RowOf(L, lo);
  const int64_t len_a = L.ring > 0 ? std::min(n_keys, L.ring - a0) : n_keys;
  const char* K = static_cast<const char*>(L.k.data);
  const char* V = static_cast<const char*>(L.v.data);
  const int64_t at = a0 * RowBytes();
  const backend::KvRun runs[2] = {{K + at, V + at, len_a}, {K, V, n_keys - len_a}};
  device_.ops().AttendCausal(CausalRows(call, config_, kv_, r0, r1, lo, runs, &positions_));
  return absl::OkStatus();
}

}  // namespace dd::engine
