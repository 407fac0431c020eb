// SparseKvCache's attention calls on a sparse layer, batch-wide (docs/architecture.md, "A decode
// step in each mode"):
//   1. StartReads, per sequence: KV appended, prompt rows attended densely, and each decode
//      read's own selection scored (ChunkSelector::ScoreOwn);
//   2. SelectAndStart: the selections chosen, every read's transfers started by the fetch
//      policy (none waited), then the speculative rows' predictions scored and chosen;
//   3. AttendDecodeReads: each read's transfers waited for (FetchPolicy::Finish), every read's
//      lists — sinks, selected chunks in ascending chunk order, the device window, the
//      speculative row's own KV — in one AttentionPlan and one attention call; only then the
//      predictions' prefetches, which may overwrite what attention read.
// Same keys in the same order as one sequence at a time, so the same bits.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/engine/attention_ops.h"
#include "decode-worker/engine/sparse_kv_cache.h"

namespace dd::engine {

absl::Status SparseKvCache::Attend(const model::AttentionCall& call) {
  if (!Holds(call.layer)) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", call.layer, " is not a sparse layer (KvCache routes it)"));
  }
  // The previous pass's completed chunks to the store (their copies long done; WriteBack).
  if (call.layer == map_.layers.front()) RETURN_IF_ERROR(writer_.Flush());
  absl::Status status = StartReads(call);
  // A window shorter than a chunk lets a prediction name the chunk just completed: written first.
  if (status.ok() && options_.window_tokens <= options_.chunk_tokens) status = writer_.Flush();
  if (status.ok()) status = SelectAndStart(call);
  if (status.ok()) status = AttendDecodeReads(call);
  if (!status.ok()) AbandonReads();
  return status;
}

absl::Status SparseKvCache::StartReads(const model::AttentionCall& call) {
  const int64_t n = static_cast<int64_t>(call.rows.size());
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  reads_.n = 0;
  for (int64_t r0 = 0; r0 < n;) {
    int64_t r1 = r0 + 1;
    while (r1 < n && call.rows[r1].seq == call.rows[r0].seq) ++r1;
    ASSIGN_OR_RETURN(Seq * s, GetSeq(call.rows[r0].seq));
    LayerRows& st = s->layers[call.layer];
    const bool spec_last = call.rows[r1 - 1].speculative;
    const int64_t real_end = spec_last ? r1 - 1 : r1;
    // Prompt rows attend densely, however few a piece holds (a one-token piece mid-prompt
    // is not a decode row); a lone unflagged row is a decode row.
    const bool prompt = real_end - r0 > 1 || (real_end > r0 && call.rows[r0].prefill);
    if (prompt && st.decoded) {
      return absl::UnimplementedError("sparse mode: prefill rows after decode rows in one sequence");
    }
    for (int64_t r = r0; r < real_end; ++r) {
      if (call.rows[r].speculative) return absl::InvalidArgumentError("a speculative row must be the last");
      if (call.rows[r].pos != call.rows[r0].pos + (r - r0)) {
        return absl::InvalidArgumentError(absl::StrCat("row position ", call.rows[r].pos, " does not continue the cache (expected ",
                                                       call.rows[r0].pos + (r - r0), ")"));
      }
    }
    if (real_end > r0) {
      RETURN_IF_ERROR(writer_.Append(st, s->store_id, call.layer, call.buffer, call.k + r0 * kv_dim,
                                     call.v + r0 * kv_dim, call.rows[r0].pos, real_end - r0));
      // Chunks completed while decoding get their coefficients (their rows still held).
      if (!s->low_rank.empty()) RETURN_IF_ERROR(low_rank_.Project(s->low_rank[call.layer], st));
    }
    if (prompt) {
      if (spec_last) return absl::UnimplementedError("sparse mode: a speculative row after prefill rows");
      AttendPrefillRows(*s, call, r0, real_end);
    }
    if (spec_last && call.rows[r1 - 1].pos != st.length) {
      return absl::InvalidArgumentError(absl::StrCat("speculative row position ", call.rows[r1 - 1].pos,
                                                     " does not follow the cache (", st.length, ")"));
    }
    const bool decode_row = real_end - r0 == 1 && !prompt;
    if (decode_row || spec_last) {
      RETURN_IF_ERROR(BuildLowRank(*s, call.layer));
      RETURN_IF_ERROR(rows_.StartDecoding(st, s->reserved ? s->total : 0));
      RETURN_IF_ERROR(selector_.EnsureScores(s->scores, s->reserved ? s->total : config_.n_ctx_train));
      if (spec_last) RETURN_IF_ERROR(EnsureOwnRows(*s));
      DecodeRead& read = AddRead(call.rows[r0].seq);
      read.real_row = decode_row ? r0 : -1;
      read.spec_row = spec_last ? r1 - 1 : -1;
      // The rows' own selection, scored now, chosen once every sequence's scores are in: the
      // real row's, or a lone speculative row's (pre-decoding, over the committed keys).
      const int64_t row = decode_row ? r0 : r1 - 1;
      read.pick.w = selector_.WindowFor(decode_row ? call.rows[r0].pos + 1 : call.rows[row].pos);
      selector_.ScoreOwn(s->scores, st, call.q + row * config_.n_head * config_.head_dim, decode_row && spec_last,
                         read.pick);
    }
    r0 = r1;
  }
  return absl::OkStatus();
}

void SparseKvCache::AttendPrefillRows(Seq& s, const model::AttentionCall& call, int64_t r0, int64_t r1) {
  // Dense over the device copy of the whole prefix: sinks then [sinks, length).
  const LayerRows& st = s.layers[call.layer];
  const int64_t n_keys = call.rows[r1 - 1].pos + 1;
  const int64_t n_sink = std::min(n_keys, options_.sink_tokens);
  const backend::KvRun runs[2] = {{st.sink_k.data, st.sink_v.data, n_sink}, {st.k.data, st.v.data, n_keys - n_sink}};
  device_.ops().AttendCausal(
      CausalRows(call, config_, chunks_.kv_dtype(), r0, r1, /*lo=*/0, runs, &prefill_positions_));
}

absl::Status SparseKvCache::SelectAndStart(const model::AttentionCall& call) {
  const int64_t layer = call.layer, q_dim = config_.n_head * config_.head_dim;
  // The layer's choice for this step, the same for every sequence of the batch.
  bool real_step = false;
  for (const DecodeRead& r : reads_.used()) real_step = real_step || r.real_row >= 0;
  step_rebuilds_keys_ = reads_.n > 0 && recon_.enabled() && recon_.Step(layer, stats_.layers()[layer], real_step);
  if (step_rebuilds_keys_ && real_step) stats_.ReconstructingStep(layer);
  RETURN_IF_ERROR(selector_.IdsToHost(reads_.used(), /*predictions=*/false));
  bool predictions = false;
  for (DecodeRead& r : reads_.used()) {
    Seq& s = seqs_[r.seq];
    const bool real = r.real_row >= 0, spec_follows = real && r.spec_row >= 0;
    selector_.ChooseOwn(spec_follows, r.pick);
    if (selector_.model_enabled()) {
      const int64_t pos = call.rows[real ? r.real_row : r.spec_row].pos;
      selector_.ModelSelection(s.draws[layer], r.seq, layer, pos, real, spec_follows, r.pick);
    }
    RETURN_IF_ERROR(fetch_->Start(FetchOf(r.seq, layer), layer, real, r));
    if (real) {
      int64_t selected = 0;
      for (const auto& v : r.pick.sel) selected += static_cast<int64_t>(v.size());
      stats_.Selected(layer, selected);
    }
    if (r.spec_row >= 0) {
      selector_.ScorePrediction(s.layers[layer], real, call.rows[r.spec_row].pos, call.q + r.spec_row * q_dim, r.pick);
    }
    predictions = predictions || r.pick.predict_pending;
  }
  if (predictions) {
    RETURN_IF_ERROR(selector_.IdsToHost(reads_.used(), /*predictions=*/true));
    for (DecodeRead& r : reads_.used()) {
      if (r.pick.predict_pending) selector_.FinishPrediction(r.real_row >= 0, r.pick);
    }
  }
  if (selector_.model_enabled()) {
    for (DecodeRead& r : reads_.used()) {
      if (r.spec_row >= 0) r.pick.predicted = std::move(r.pick.model_predicted);
    }
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::AttendDecodeReads(const model::AttentionCall& call) {
  if (reads_.n == 0) return absl::OkStatus();
  const int64_t layer = call.layer;
  for (DecodeRead& r : reads_.used()) {
    const FetchSeq fs = FetchOf(r.seq, layer);
    RETURN_IF_ERROR(fetch_->Finish(fs, layer, r.real_row >= 0, r));
    if (fs.values_only) RebuildKeys(layer, r);
  }
  PlanAttention(call);
  plan_.Run(device_.ops(), ShapeOf(config_, chunks_.kv_dtype()), call.scale);
  const absl::Span<DecodeRead> done = reads_.used();
  reads_.n = 0;  // every transfer has been waited for
  for (DecodeRead& r : done) {
    if (r.spec_row < 0) continue;
    RETURN_IF_ERROR(
        fetch_->Prefetch(FetchOf(r.seq, layer), layer, std::move(r.pick.predicted), /*seeded=*/r.real_row < 0));
  }
  return absl::OkStatus();
}

void SparseKvCache::PlanAttention(const model::AttentionCall& call) {
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, kv_dim = n_kv * hd;
  const int64_t q_dim = config_.n_head * hd, C = options_.chunk_tokens;
  const KvDtype kv = chunks_.kv_dtype();
  const int64_t hb = hd * KvDtypeBytes(kv);  // one head's row of a key or value
  // Every read's keys per KV head in order: sinks, its selected chunks, the device window, the
  // speculative row's own KV.
  int64_t all_keys = 0;
  for (const DecodeRead& r : reads_.used()) {
    const int64_t n_dev = seqs_[r.seq].layers[call.layer].length - r.pick.w.dense_from, extra = r.spec_row >= 0;
    for (const auto& v : r.pick.sel) all_keys += static_cast<int64_t>(v.size()) * C;
    all_keys += n_kv * (r.pick.w.sinks + n_dev + extra);
  }
  plan_.Begin(all_keys, static_cast<int64_t>(reads_.n), n_kv);
  for (const DecodeRead& r : reads_.used()) {
    const LayerRows& st = seqs_[r.seq].layers[call.layer];
    const Window& w = r.pick.w;
    // The speculative row's own K and V: the forward pass's f32 rows, or narrowed to the KV
    // type into the sequence's own rows (as a real row's are when they are stored).
    const char* own_k = nullptr;
    const char* own_v = nullptr;
    if (r.spec_row >= 0 && kv == KvDtype::kF32) {
      own_k = reinterpret_cast<const char*>(call.k + r.spec_row * kv_dim);
      own_v = reinterpret_cast<const char*>(call.v + r.spec_row * kv_dim);
    } else if (r.spec_row >= 0) {
      char* own = static_cast<char*>(seqs_[r.seq].own.data);
      device_.ops().StoreKv(call.k + r.spec_row * kv_dim, kv_dim, kv, own);
      device_.ops().StoreKv(call.v + r.spec_row * kv_dim, kv_dim, kv, own + rows_.RowBytes());
      own_k = own;
      own_v = own + rows_.RowBytes();
    }
    const uint8_t* const* block = r.fetch.blocks.data();
    const auto at = [&](const void* row, int64_t g) { return static_cast<const char*>(row) + g * hb; };
    for (int64_t g = 0; g < n_kv; ++g) {
      for (int64_t t = 0; t < w.sinks; ++t) plan_.Add(at(rows_.K(st, t), g), at(rows_.V(st, t), g));
      for (size_t c = 0; c < r.pick.sel[g].size(); ++c, ++block) {
        for (int64_t t = 0; t < C; ++t) plan_.Add(*block + t * hb, *block + (C + t) * hb);
      }
      for (int64_t p = w.dense_from; p < st.length; ++p) plan_.Add(at(rows_.K(st, p), g), at(rows_.V(st, p), g));
      if (own_k != nullptr) plan_.Add(own_k + g * hb, own_v + g * hb);
      plan_.EndList();
    }
    // The real row does not see the speculative row's key (hidden_tail 1); both read the
    // same blocks in one pass.
    backend::ListQuery rows[2];
    size_t nr = 0;
    if (r.real_row >= 0) {
      rows[nr++] = {call.q + r.real_row * q_dim, call.out + r.real_row * q_dim, r.spec_row >= 0 ? 1 : 0};
    }
    if (r.spec_row >= 0) rows[nr++] = {call.q + r.spec_row * q_dim, call.out + r.spec_row * q_dim, 0};
    plan_.EndGroup(absl::MakeConstSpan(rows, nr));
  }
}

void SparseKvCache::RebuildKeys(int64_t layer, const DecodeRead& r) {
  rebuild_chunks_.clear();
  rebuild_heads_.clear();
  rebuild_dst_.clear();
  size_t i = 0;  // the read's blocks, in selection order
  for (size_t g = 0; g < r.pick.sel.size(); ++g) {
    for (int64_t c : r.pick.sel[g]) {
      const uint8_t* block = r.fetch.blocks[i];
      if (r.fetch.rebuild.empty() || r.fetch.rebuild[i]) {
        rebuild_chunks_.push_back(c);
        rebuild_heads_.push_back(static_cast<int32_t>(g));
        rebuild_dst_.push_back(const_cast<uint8_t*>(block));  // the K half: the block's first bytes
      }
      ++i;
    }
  }
  Seq& s = seqs_[r.seq];
  if (!rebuild_chunks_.empty()) low_rank_.Reconstruct(s.low_rank[layer], rebuild_chunks_, rebuild_heads_, rebuild_dst_);
  stats_.Rebuilt(s.counts, layer, static_cast<int64_t>(rebuild_chunks_.size()));
  if (r.real_row >= 0) stats_.Reconstructed(s.counts, layer, static_cast<int64_t>(i));
}

void SparseKvCache::AbandonReads() {
  for (DecodeRead& r : reads_.used()) {
    // Nothing may still write into its blocks (nor its staging).
    (void)chunks_.FinishLanding(r.fetch.urgent, backend::Queue::kUrgent);
  }
  reads_.n = 0;
}

DecodeRead& SparseKvCache::AddRead(int32_t seq) {
  if (reads_.n == reads_.all.size()) reads_.all.emplace_back();
  DecodeRead& r = reads_.all[reads_.n++];
  r.seq = seq;
  r.real_row = r.spec_row = -1;
  r.fetch.urgent.pending = false;
  r.fetch.urgent.on_device = false;
  r.fetch.urgent.tid = 0;
  r.fetch.wait_prefetch = false;
  r.pick.sel.clear();
  r.pick.predicted.clear();
  r.pick.predict_pending = false;
  r.fetch.blocks.clear();
  return r;
}

}  // namespace dd::engine
