// SparseKvCache's decode rows of a sparse layer, batch-wide: one attention plan per layer for
// the whole batch (docs/architecture.md, "A decode step in each mode").
//
//   1. StartRead, per sequence: the rows' windows and selections (the real row's S, the
//      speculative row's prediction P'), hit statistics, and every transfer the rows need
//      started on the urgent path, none waited for;
//   2. FinishFetch, per sequence: wait for them and point at each selected block where it
//      landed (resident slot, prefetch buffer or urgent blocks);
//   3. AttendPlanned: every sequence's lists — sinks, selected chunks in ascending chunk order,
//      the device window, the speculative row's own KV — and one AttendGroups call;
//   4. AfterAttention, per sequence: only now may the blocks be overwritten: the ring's buffer
//      is handed back and the predictions go out in the background.
// Same keys in the same order as one sequence at a time, so the same bits.
#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/attention_ops.h"
#include "decode-worker/engine/sparse_kv_cache.h"

namespace dd::engine {
namespace {

int64_t Total(const std::vector<std::vector<int64_t>>& sel) {
  int64_t n = 0;
  for (const auto& v : sel) n += static_cast<int64_t>(v.size());
  return n;
}

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

}  // namespace

absl::Status SparseKvCache::StartRealRead(Seq& s, const model::AttentionCall& call, DecodeRead& r) {
  LayerState& st = s.layers[call.layer];
  const Selection& sel = r.sel;
  if (options_.step_cache) {
    if (st.issued) {  // how good the prediction was, and what of its transfer went unused
      for (size_t g = 0; g < sel.size(); ++g) {
        const int64_t unused =
            static_cast<int64_t>(st.prefetch_chunks[g].size()) - CountCommon(sel[g], st.prefetch_chunks[g]);
        CountPrediction(s, call.layer, CountCommon(sel[g], st.issued_sel[g]), static_cast<int64_t>(sel[g].size()),
                        unused, st.issued_seeded);
      }
    }
    const absl::Status started = StartResidentFetch(s, call.layer, /*count=*/true, r);
    st.issued = false;
    st.prefetch_chunks.clear();
    st.issued_sel.clear();
    RETURN_IF_ERROR(started);
  } else {
    const int64_t this_buffer = s.reads % static_cast<int64_t>(s.buffers.size());
    Buffer& buf = s.buffers[this_buffer];
    s.reading = -1;
    if (buf.layer == call.layer) {
      // This read's prefetch: hits come from its buffer; misses S \ P' go on the urgent path.
      s.reading = this_buffer;
      r.buffer = this_buffer;
      const Selection& predicted = buf.sel;
      r.misses.assign(sel.size(), {});
      for (size_t g = 0; g < sel.size(); ++g) {
        std::set_difference(sel[g].begin(), sel[g].end(), predicted[g].begin(), predicted[g].end(),
                            std::back_inserter(r.misses[g]));
        const int64_t hits = static_cast<int64_t>(sel[g].size() - r.misses[g].size());
        CountPrediction(s, call.layer, hits, static_cast<int64_t>(sel[g].size()),
                        static_cast<int64_t>(predicted[g].size()) - hits, buf.seeded);
      }
      RETURN_IF_ERROR(StartGather(s, call.layer, r.misses, kvpool::Priority::kUrgent, s.urgent_blocks, &r.urgent));
    } else {
      RETURN_IF_ERROR(StartGather(s, call.layer, sel, kvpool::Priority::kUrgent, s.urgent_blocks, &r.urgent));
    }
  }
  stats_[call.layer].selected += Total(sel);
  return absl::OkStatus();
}

absl::Status SparseKvCache::StartPreDecodeRead(Seq& s, const model::AttentionCall& call, DecodeRead& r) {
  // Pre-decoding (right after prefill): the speculative row attends over the committed keys
  // with its own selection; its prediction is prefetched for the next step, whose real row is
  // this same token at this same position.
  if (options_.step_cache) return StartResidentFetch(s, call.layer, /*count=*/false, r);
  return StartGather(s, call.layer, r.sel, kvpool::Priority::kUrgent, s.urgent_blocks, &r.urgent);
}

absl::Status SparseKvCache::FinishFetch(Seq& s, int64_t layer, DecodeRead& r) {
  if (options_.step_cache) return FinishResidentFetch(s, layer, r);
  if (r.buffer < 0) {
    RETURN_IF_ERROR(chunks_.FinishLanding(r.urgent, backend::Queue::kUrgent));
    r.blocks.clear();
    for (int64_t i = 0, n = Total(r.sel); i < n; ++i) r.blocks.push_back(BlockAt(s.urgent_blocks, i));
    if (r.real_row >= 0) {
      for (const auto& v : r.sel) {
        CountUrgent(s, layer, static_cast<int64_t>(v.size()));
      }
    }
    return absl::OkStatus();
  }
  Buffer& buf = s.buffers[r.buffer];
  absl::Status status = WaitBuffer(buf);
  status.Update(chunks_.FinishLanding(r.urgent, backend::Queue::kUrgent));
  RETURN_IF_ERROR(status);
  // Point at each selected block where it landed, prefetch buffer or urgent blocks (no copy).
  const Selection& predicted = buf.sel;
  r.blocks.clear();
  int64_t pi = 0, ui = 0;  // cursors in the prefetch buffer and the urgent blocks
  for (size_t g = 0; g < r.sel.size(); ++g) {
    size_t pj = 0, mj = 0;
    for (int64_t c : r.sel[g]) {
      while (pj < predicted[g].size() && predicted[g][pj] < c) ++pj;
      if (pj < predicted[g].size() && predicted[g][pj] == c) {
        r.blocks.push_back(BlockAt(buf.data, pi + static_cast<int64_t>(pj)));
      } else {
        r.blocks.push_back(BlockAt(s.urgent_blocks, ui + static_cast<int64_t>(mj++)));
      }
    }
    pi += static_cast<int64_t>(predicted[g].size());
    ui += static_cast<int64_t>(r.misses[g].size());
    CountUrgent(s, layer, static_cast<int64_t>(r.misses[g].size()));
  }
  return absl::OkStatus();
}

void SparseKvCache::AbandonReads() {
  for (size_t i = 0; i < n_reads_; ++i) {
    // Nothing may still write into its blocks (nor its staging).
    (void)chunks_.FinishLanding(reads_[i].urgent, backend::Queue::kUrgent);
  }
  n_reads_ = 0;
}

void SparseKvCache::AttendPlanned(const model::AttentionCall& call) {
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, kv_dim = n_kv * hd;
  const int64_t q_dim = config_.n_head * hd, C = options_.chunk_tokens;
  // Every read's keys per KV head in order: sinks, its selected chunks, the device window, the
  // speculative row's own KV. Sized first: the lists point into these vectors.
  int64_t all_keys = 0;
  for (size_t i = 0; i < n_reads_; ++i) {
    const DecodeRead& r = reads_[i];
    const LayerState& st = seqs_[r.seq].layers[call.layer];
    const int64_t n_dev = st.length - r.w.dense_from;
    all_keys += Total(r.sel) * C + n_kv * (r.w.sinks + n_dev + (r.spec_row >= 0 ? 1 : 0));
  }
  attend_keys_.resize(all_keys);
  attend_values_.resize(all_keys);
  attend_lists_.resize(n_reads_ * n_kv);
  attend_rows_.resize(2 * n_reads_);
  attend_groups_.resize(n_reads_);
  int64_t first = 0;
  for (size_t i = 0; i < n_reads_; ++i) {
    const DecodeRead& r = reads_[i];
    const LayerState& st = seqs_[r.seq].layers[call.layer];
    const Window& w = r.w;
    const int64_t n_dev = st.length - w.dense_from;
    const float* own_k = r.spec_row >= 0 ? call.k + r.spec_row * kv_dim : nullptr;
    const float* own_v = r.spec_row >= 0 ? call.v + r.spec_row * kv_dim : nullptr;
    int64_t block_index = 0;
    for (int64_t g = 0; g < n_kv; ++g) {
      const float** k = attend_keys_.data() + first;
      const float** v = attend_values_.data() + first;
      int64_t j = 0;
      for (int64_t t = 0; t < w.sinks; ++t, ++j) {
        k[j] = DevK(st, t) + g * hd;
        v[j] = DevV(st, t) + g * hd;
      }
      for (size_t c = 0; c < r.sel[g].size(); ++c) {
        const float* block = r.blocks[block_index + c];
        for (int64_t t = 0; t < C; ++t, ++j) {
          k[j] = block + t * hd;
          v[j] = block + (C + t) * hd;
        }
      }
      for (int64_t t = 0; t < n_dev; ++t, ++j) {
        k[j] = DevK(st, w.dense_from + t) + g * hd;
        v[j] = DevV(st, w.dense_from + t) + g * hd;
      }
      if (own_k != nullptr) {
        k[j] = own_k + g * hd;
        v[j] = own_v + g * hd;
        ++j;
      }
      attend_lists_[i * n_kv + g] = {k, v, j};
      first += j;
      block_index += static_cast<int64_t>(r.sel[g].size());
    }
    // The real row does not see the speculative row's key (hidden_tail 1); both read the
    // same blocks in one pass.
    int64_t nr = 0;
    if (r.real_row >= 0) {
      attend_rows_[2 * i + nr++] = {call.q + r.real_row * q_dim, call.out + r.real_row * q_dim,
                                    r.spec_row >= 0 ? 1 : 0};
    }
    if (r.spec_row >= 0) attend_rows_[2 * i + nr++] = {call.q + r.spec_row * q_dim, call.out + r.spec_row * q_dim, 0};
    attend_groups_[i] = {absl::MakeConstSpan(attend_rows_).subspan(2 * i, nr),
                         absl::MakeConstSpan(attend_lists_).subspan(i * n_kv, n_kv)};
  }
  ops_.AttendGroups(absl::MakeConstSpan(attend_groups_).first(n_reads_), ShapeOf(config_), call.scale);
}

absl::Status SparseKvCache::AfterAttention(Seq& s, int64_t layer, DecodeRead& r) {
  if (options_.step_cache) {
    if (r.spec_row < 0) return absl::OkStatus();
    return IssueResidentPrefetch(s, layer, std::move(r.predicted), /*seeded=*/r.real_row < 0);
  }
  // The real row's blocks are no longer read: its buffer goes to the read `buffers` later.
  if (r.real_row >= 0) RETURN_IF_ERROR(EndRingRead(s, layer));
  if (r.spec_row < 0) return absl::OkStatus();
  // The prediction goes out in the background as soon as its buffer is free; the next step's
  // real row waits for it only when it reads it.
  LayerState& st = s.layers[layer];
  st.predicted = std::move(r.predicted);
  st.has_prediction = true;
  return TryIssue(s, layer);
}

absl::Status SparseKvCache::AttendDecodeReads(const model::AttentionCall& call) {
  if (n_reads_ == 0) return absl::OkStatus();
  for (size_t i = 0; i < n_reads_; ++i) RETURN_IF_ERROR(FinishFetch(seqs_[reads_[i].seq], call.layer, reads_[i]));
  AttendPlanned(call);
  const size_t n = n_reads_;
  n_reads_ = 0;  // every transfer has been waited for
  for (size_t i = 0; i < n; ++i) RETURN_IF_ERROR(AfterAttention(seqs_[reads_[i].seq], call.layer, reads_[i]));
  return absl::OkStatus();
}

SparseKvCache::DecodeRead& SparseKvCache::AddRead(int32_t seq) {
  if (n_reads_ == reads_.size()) reads_.emplace_back();
  DecodeRead& r = reads_[n_reads_++];
  r.seq = seq;
  r.real_row = r.spec_row = -1;
  r.buffer = -1;
  r.urgent.pending = false;
  r.urgent.on_device = false;
  r.urgent.tid = 0;
  r.wait_prefetch = false;
  r.sel.clear();
  r.predicted.clear();
  r.predict_pending = false;
  r.misses.clear();
  r.blocks.clear();
  return r;
}

}  // namespace dd::engine
