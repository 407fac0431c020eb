#include "decode-worker/engine/sparse_kv_cache.h"

#include <algorithm>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "decode-worker/engine/attention_ops.h"
#include "glog/logging.h"

namespace dd::engine {

absl::Status SparseOptions::Validate(int64_t model_context) const {
  if (chunk_tokens <= 0) return absl::InvalidArgumentError(absl::StrCat("chunk size must be > 0, got ", chunk_tokens));
  if (budget_tokens < chunk_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("sparse budget ", budget_tokens, " tokens is smaller than one chunk (",
                                                   chunk_tokens, " tokens)"));
  }
  if (budget_tokens > model_context) {
    return absl::InvalidArgumentError(absl::StrCat("sparse budget ", budget_tokens, " tokens is larger than the model context (",
                                                   model_context, " tokens)"));
  }
  if (sink_tokens < 0 || sink_tokens % chunk_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sink tokens ", sink_tokens, " must be a non-negative multiple of the chunk size"));
  }
  if (window_tokens < 1) return absl::InvalidArgumentError(absl::StrCat("window tokens must be >= 1, got ", window_tokens));
  if (resident_margin_tokens < 0 || resident_margin_tokens % chunk_tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat("resident margin ", resident_margin_tokens,
                                                   " tokens must be a non-negative multiple of the chunk size"));
  }
  // Bounded before the resident sets are sized from it (budget + margin slots per head).
  if (resident_margin_tokens > model_context) {
    return absl::InvalidArgumentError(absl::StrCat("resident margin ", resident_margin_tokens,
                                                   " tokens is larger than the model context (", model_context,
                                                   " tokens)"));
  }
  if (prefetch_buffers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prefetch buffers must be >= 1, got ", prefetch_buffers));
  }
  if (spec_candidates < kAutoSpecCandidates || spec_candidates > kMaxSpecCandidates) {
    return absl::InvalidArgumentError(absl::StrCat("speculative candidates must be in [-1, ", kMaxSpecCandidates,
                                                   "] (× the budget; 0 = every chunk, -1 = by the speculative head), got ",
                                                   spec_candidates));
  }
  return absl::OkStatus();
}

SparseKvCache::SparseKvCache(const model::ModelConfig& config, const SparseOptions& options, kvpool::KvStore* store,
                             backend::Device& device)
    : config_(config), options_(options), device_(device), ops_(device.ops()),
      host_visible_(device.host_visible()), chunks_(config, options.chunk_tokens, store, device), dense_(config, device),
      stats_(config.n_layer), sparse_index_(config.n_layer, -1) {
  options_.spec_candidates = options_.SpecCandidatesFor(/*full_head=*/true);  // unless an Engine resolved it
  for (int64_t l = 0; l < config.n_layer; ++l) {
    const auto& only = options.sparse_layers;
    if (!config.layer_is_swa[l] && (only.none() || (l < SparseOptions::kMaxLayers && only.test(l)))) {
      sparse_index_[l] = static_cast<int64_t>(sparse_layers_.size());
      sparse_layers_.push_back(l);
    }
  }
}

absl::StatusOr<std::unique_ptr<SparseKvCache>> SparseKvCache::Create(const model::ModelConfig& config,
                                                                     const SparseOptions& options,
                                                                     kvpool::KvStore* store, backend::Device& device) {
  RETURN_IF_ERROR(options.Validate(config.n_ctx_train));
  if (store == nullptr) return absl::InvalidArgumentError("sparse mode needs a KV store");
  for (int64_t l = 0; l < SparseOptions::kMaxLayers; ++l) {
    if (options.sparse_layers.test(l) && (l >= config.n_layer || config.layer_is_swa[l])) {
      std::vector<int64_t> global;
      for (int64_t g = 0; g < config.n_layer; ++g) {
        if (!config.layer_is_swa[g]) global.push_back(g);
      }
      return absl::InvalidArgumentError(absl::StrCat("sparse layer ", l, " is not a global layer of this model (",
                                                     absl::StrJoin(global, ","), ")"));
    }
  }
  return std::unique_ptr<SparseKvCache>(new SparseKvCache(config, options, store, device));
}

SparseKvCache::LayerStats SparseKvCache::total_stats() const {
  LayerStats t;
  for (const LayerStats& s : stats_) {
    t.selected += s.selected;
    t.hits += s.hits;
    t.predicted_for += s.predicted_for;
    t.prefetched += s.prefetched;
    t.urgent += s.urgent;
    t.wasted += s.wasted;
    t.seeded_hits += s.seeded_hits;
    t.seeded_for += s.seeded_for;
    t.reused += s.reused;
    t.evictions += s.evictions;
  }
  return t;
}

SparseKvCache::~SparseKvCache() {
  for (Seq& s : seqs_) {
    if (s.open) WaitAll(s);
  }
  // Nothing queued may still use the buffers (or landmark_host_) when they go.
  (void)device_.Synchronize(device_.Record(backend::Queue::kCompute));
  for (Seq& s : seqs_) FreeSeq(s);
}

absl::StatusOr<SparseKvCache::Seq*> SparseKvCache::GetSeq(int32_t seq) {
  if (seq < 0) return absl::InvalidArgumentError(absl::StrCat("negative sequence slot ", seq));
  if (seq >= static_cast<int32_t>(seqs_.size())) seqs_.resize(seq + 1);
  Seq& s = seqs_[seq];
  if (!s.open) {
    ASSIGN_OR_RETURN(s.store_id, chunks_.Open());
    s.open = true;
    s.layers.assign(config_.n_layer, LayerState());
    s.buffers.assign(std::min<int64_t>(options_.prefetch_buffers, std::max<size_t>(1, sparse_layers_.size())), Buffer());
  }
  return &s;
}

void SparseKvCache::Reset(int32_t seq) {
  dense_.Reset(seq);
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return;
  if (seqs_[seq].open) {
    WaitAll(seqs_[seq]);  // no transfer may still write into buffers about to be freed
    (void)device_.Synchronize(device_.Record(backend::Queue::kCompute));  // nor queued work read them
    FreeSeq(seqs_[seq]);
    chunks_.Release(seqs_[seq].store_id);
  }
  seqs_[seq] = Seq();
}

void SparseKvCache::CountPrediction(Seq& s, int64_t layer, int64_t hits, int64_t selected, int64_t unused,
                                    bool seeded) {
  LayerStats& t = stats_[layer];
  t.hits += hits;
  t.predicted_for += selected;
  if (seeded) {  // the request's own rate leaves the seeded step out
    t.seeded_hits += hits;
    t.seeded_for += selected;
  } else {
    s.hits += hits;
    s.predicted_for += selected;
  }
  t.wasted += unused;
  s.wasted += unused;
}

void SparseKvCache::CountPrefetched(Seq& s, int64_t layer, int64_t blocks) {
  stats_[layer].prefetched += blocks;
  s.prefetched += blocks;
}

void SparseKvCache::CountUrgent(Seq& s, int64_t layer, int64_t blocks) {
  stats_[layer].urgent += blocks;
  s.urgent += blocks;
}

double SparseKvCache::SeqHitRate(int32_t seq) const {
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return 0.0;
  const Seq& s = seqs_[seq];
  return s.predicted_for ? static_cast<double>(s.hits) / s.predicted_for : 0.0;
}

SparseKvCache::SeqKvBytes SparseKvCache::SeqTransfers(int32_t seq) const {
  if (seq < 0 || seq >= static_cast<int32_t>(seqs_.size())) return {};
  const Seq& s = seqs_[seq];
  return {s.prefetched * block_bytes(), s.urgent * block_bytes(), s.wasted * block_bytes()};
}

int64_t SparseKvCache::carry_layers() const {
  if (options_.offload_sliding || sparse_layers_.empty()) return 0;
  return sparse_layers_.front();
}

absl::Status SparseKvCache::KeepSpeculative(int32_t seq, int64_t layers) {
  if (layers > carry_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("keep speculative KV in ", layers, " layers: only the first ",
                                                   carry_layers(), " attend densely"));
  }
  return dense_.KeepSpeculative(seq, layers);
}

int64_t SparseKvCache::Length(int32_t seq) const {
  int64_t n = dense_.Length(seq);
  if (seq >= 0 && seq < static_cast<int32_t>(seqs_.size())) {
    for (const auto& st : seqs_[seq].layers) n = std::max(n, st.length);
  }
  return n;
}

int64_t SparseKvCache::device_bytes() const {
  int64_t total = dense_.device_bytes();
  for (const Seq& s : seqs_) {
    for (const LayerState& st : s.layers) {
      total += st.sink_k.bytes + st.sink_v.bytes + st.k.bytes + st.v.bytes + st.landmarks.bytes + st.slots.bytes;
    }
    for (const Buffer& b : s.buffers) total += b.data.bytes;
    total += s.urgent_blocks.bytes + s.scores.bytes;
  }
  return total;
}

absl::Status SparseKvCache::Copy(int32_t src, int32_t dst) {
  if (src == dst) return absl::OkStatus();
  Reset(dst);
  RETURN_IF_ERROR(dense_.Copy(src, dst));
  ASSIGN_OR_RETURN(Seq * from, GetSeq(src));
  WaitAll(*from);
  ASSIGN_OR_RETURN(Seq * to, GetSeq(dst));
  from = &seqs_[src];  // GetSeq(dst) may have grown the vector
  const kvpool::SequenceId to_id = to->store_id;
  // The bookkeeping as it is; every device buffer duplicated (none shared).
  Seq copy = *from;
  for (LayerState& st : copy.layers) {
    st.sink_k = st.sink_v = st.k = st.v = st.landmarks = st.slots = backend::DeviceBuffer{};
    st.prefetch = Landing();
  }
  for (Buffer& b : copy.buffers) {
    b.data = backend::DeviceBuffer{};
    b.landing = Landing();
  }
  copy.urgent_blocks = copy.scores = backend::DeviceBuffer{};
  copy.store_id = to_id;
  *to = std::move(copy);
  absl::Status dup;
  for (int64_t l = 0; l < config_.n_layer && dup.ok(); ++l) dup = DuplicateLayer(from->layers[l], to->layers[l]);
  for (size_t i = 0; i < from->buffers.size() && dup.ok(); ++i) {
    dup = Duplicate(from->buffers[i].data, /*contents=*/true, &to->buffers[i].data);
  }
  // Scratch: the size, not the contents.
  if (dup.ok()) dup = Duplicate(from->urgent_blocks, /*contents=*/false, &to->urgent_blocks);
  if (dup.ok()) dup = Duplicate(from->scores, /*contents=*/false, &to->scores);
  if (!dup.ok()) {
    Reset(dst);
    return dup;
  }
  // The offloaded blocks, duplicated under the new store sequence.
  std::vector<int64_t> chunks(config_.n_layer);
  for (int64_t l = 0; l < config_.n_layer; ++l) chunks[l] = from->layers[l].length / options_.chunk_tokens;
  return chunks_.CopyBlocks(from->store_id, to_id, chunks);
}

absl::Status SparseKvCache::AppendRows(Seq& s, int64_t layer, const backend::DeviceBuffer& src_buf, const float* k,
                                       const float* v, int64_t pos, int64_t n) {
  LayerState& st = s.layers[layer];
  const int64_t hd = config_.head_dim, n_kv = config_.n_head_kv, kv_dim = n_kv * hd, C = options_.chunk_tokens;
  if (pos != st.length) {
    return absl::InvalidArgumentError(absl::StrCat("row position ", pos, " does not continue the cache (expected ",
                                                   st.length, ")"));
  }
  RETURN_IF_ERROR(EnsureRows(st, pos + n));
  RETURN_IF_ERROR(StoreRows(st, pos, pos + n, src_buf, k, v));
  const int64_t c0 = st.length / C;
  st.length += n;
  const int64_t c1 = st.length / C;
  if (c1 == c0) {
    // Rows from host memory: copied before the caller may reuse it.
    return src_buf ? absl::OkStatus() : device_.Synchronize(device_.Record(backend::Queue::kCompute));
  }
  // Chunks full: their rows on the host, a landmark (mean of the chunk's post-RoPE keys) per
  // KV head, and one [K | V] block per KV head offloaded.
  RETURN_IF_ERROR(EnsureLandmarks(st, c1));
  const int64_t rows = (c1 - c0) * C;
  // The chunks' rows on the host: the caller's, when they are host rows starting at a chunk
  // (a restored prefix, random KV), else copied back from the device.
  const float *hk = k, *hv = v;
  if (src_buf || c0 * C != pos) {
    host_k_.resize(rows * kv_dim);
    host_v_.resize(rows * kv_dim);
    RETURN_IF_ERROR(RowsToHost(st, c0 * C, c1 * C, host_k_.data(), host_v_.data()));
    hk = host_k_.data(), hv = host_v_.data();
  }
  // Also the last upload from landmark_host_ (same queue), and the rows' copy from host memory,
  // are done after this.
  RETURN_IF_ERROR(device_.Synchronize(device_.Record(backend::Queue::kCompute)));
  landmark_host_.resize((c1 - c0) * kv_dim);
  RETURN_IF_ERROR(chunks_.WriteChunks(s.store_id, layer, c0, c1, hk, hv, landmark_host_.data()));
  // landmark_host_ stays unchanged until the next sync of the compute queue (above, or the
  // cache's Reset and destructor).
  const int64_t per_chunk = kv_dim * static_cast<int64_t>(sizeof(float));
  return device_.CopyToDevice(backend::Queue::kCompute, landmark_host_.data(), st.landmarks, c0 * per_chunk,
                              (c1 - c0) * per_chunk);
}

absl::Status SparseKvCache::OffloadSlidingChunks(const model::AttentionCall& call) {
  const int64_t C = options_.chunk_tokens, kv_dim = config_.n_head_kv * config_.head_dim;
  host_k_.resize(C * kv_dim);
  host_v_.resize(C * kv_dim);
  for (const model::BatchRow& row : call.rows) {
    if (row.speculative || (row.pos + 1) % C != 0) continue;
    ASSIGN_OR_RETURN(Seq * s, GetSeq(row.seq));
    const int64_t c = (row.pos + 1) / C - 1;
    // The ring holds the chunk's first row, hence the rest (a chunk is shorter than the window).
    if (absl::Status st = dense_.ReadRows(row.seq, call.layer, c * C, (c + 1) * C, host_k_.data(), host_v_.data());
        !st.ok()) {
      return absl::InternalError(absl::StrCat("sliding chunk left the ring before its offload: ", st.message()));
    }
    RETURN_IF_ERROR(chunks_.WriteChunks(s->store_id, call.layer, c, c + 1, host_k_.data(), host_v_.data(), nullptr));
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::RestorePrefix(int32_t seq, kvpool::SequenceId handle, int64_t tokens) {
  const int64_t C = options_.chunk_tokens, kv_dim = config_.n_head_kv * config_.head_dim;
  if (tokens <= 0 || tokens % C != 0) {
    return absl::InvalidArgumentError(absl::StrCat("prefix of ", tokens, " tokens is not a positive multiple of ", C));
  }
  if (Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  ASSIGN_OR_RETURN(Seq * s, GetSeq(seq));
  const int64_t chunks = tokens / C, batch = 64;  // chunks per gather
  std::vector<float> k, v, krows, vrows;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    const bool sliding = config_.layer_is_swa[l];
    // Sliding layers keep the last window + 1 positions on the device.
    const int64_t keep_from = sliding ? std::max<int64_t>(0, tokens - config_.sliding_window - 1) : 0;
    if (sliding) {
      krows.assign((tokens - keep_from) * kv_dim, 0.0f);
      vrows.assign((tokens - keep_from) * kv_dim, 0.0f);
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += batch) {
      const int64_t c1 = std::min(chunks, c0 + batch);
      RETURN_IF_ERROR(chunks_.ReadRows(handle, l, c0, c1, &k, &v));
      if (sliding) {
        // The slot's own store sequence gets the blocks; the device the rows it keeps.
        RETURN_IF_ERROR(chunks_.WriteChunks(s->store_id, l, c0, c1, k.data(), v.data(), nullptr));
        for (int64_t pos = std::max(keep_from, c0 * C); pos < c1 * C; ++pos) {
          std::memcpy(&krows[(pos - keep_from) * kv_dim], &k[(pos - c0 * C) * kv_dim], kv_dim * sizeof(float));
          std::memcpy(&vrows[(pos - keep_from) * kv_dim], &v[(pos - c0 * C) * kv_dim], kv_dim * sizeof(float));
        }
      } else {  // landmarks and offload as in prefill
        RETURN_IF_ERROR(AppendRows(*s, l, backend::DeviceBuffer{}, k.data(), v.data(), c0 * C, (c1 - c0) * C));
      }
    }
    if (sliding) RETURN_IF_ERROR(dense_.LoadRows(seq, l, tokens, krows.data(), vrows.data(), tokens - keep_from));
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::FillRandom(int32_t seq, int64_t tokens, uint64_t seed) {
  if (tokens <= 0) return absl::InvalidArgumentError(absl::StrCat("random KV of ", tokens, " tokens"));
  if (Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  ASSIGN_OR_RETURN(Seq * s, GetSeq(seq));
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim, C = options_.chunk_tokens;
  const RandomKv rows(seed, kv_dim);
  // Pieces of about 4 MiB of keys, whole chunks: each goes through AppendRows as a prefill's
  // rows do (device rows, landmarks, blocks to the store).
  const int64_t piece = std::max<int64_t>(1, (int64_t{1} << 20) / kv_dim / C) * C;
  std::vector<float> k, v;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (sparse_index_[l] < 0) {  // sliding, or a global layer kept dense (not offloaded)
      RETURN_IF_ERROR(dense_.FillRandomLayer(seq, l, tokens, rows));
      continue;
    }
    for (int64_t p0 = 0; p0 < tokens; p0 += piece) {
      const int64_t p1 = std::min(tokens, p0 + piece);
      k.resize((p1 - p0) * kv_dim);
      v.resize(k.size());
      rows.Rows(l, /*values=*/false, p0, p1, k.data());
      rows.Rows(l, /*values=*/true, p0, p1, v.data());
      RETURN_IF_ERROR(AppendRows(*s, l, backend::DeviceBuffer{}, k.data(), v.data(), p0, p1 - p0));
    }
  }
  return absl::OkStatus();
}

absl::Status SparseKvCache::CommitPrefix(int32_t seq, absl::Span<const uint64_t> keys, uint64_t owner) {
  ASSIGN_OR_RETURN(Seq * s, GetSeq(seq));
  return chunks_.CommitPrefix(s->store_id, keys, owner);
}

absl::Status SparseKvCache::Attend(const model::AttentionCall& call) {
  if (config_.layer_is_swa[call.layer]) {
    RETURN_IF_ERROR(dense_.Attend(call));
    return options_.offload_sliding ? OffloadSlidingChunks(call) : absl::OkStatus();
  }
  if (sparse_index_[call.layer] < 0) return dense_.Attend(call);  // a global layer kept dense (sparse_layers)
  // Pass 1 per sequence: KV appended, prompt rows attended densely, decode reads started.
  // Then every read at once (sparse_kv_cache_decode.cc).
  absl::Status status = StartReads(call);
  if (status.ok()) status = AttendDecodeReads(call);
  if (!status.ok()) AbandonReads();
  return status;
}

absl::Status SparseKvCache::StartReads(const model::AttentionCall& call) {
  const int64_t n = static_cast<int64_t>(call.rows.size());
  const int64_t kv_dim = config_.n_head_kv * config_.head_dim;
  n_reads_ = 0;
  for (int64_t r0 = 0; r0 < n;) {
    int64_t r1 = r0 + 1;
    while (r1 < n && call.rows[r1].seq == call.rows[r0].seq) ++r1;
    ASSIGN_OR_RETURN(Seq * s, GetSeq(call.rows[r0].seq));
    LayerState& st = s->layers[call.layer];
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
      RETURN_IF_ERROR(AppendRows(*s, call.layer, call.buffer, call.k + r0 * kv_dim, call.v + r0 * kv_dim,
                                 call.rows[r0].pos, real_end - r0));
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
      RETURN_IF_ERROR(StartDecoding(*s, st));
      RETURN_IF_ERROR(EnsureSeqBuffers(*s));
      DecodeRead& read = AddRead(call.rows[r0].seq);
      read.real_row = decode_row ? r0 : -1;
      read.spec_row = spec_last ? r1 - 1 : -1;
      // The rows' own selection, scored now, chosen once every sequence's scores are in: the
      // real row's, or a lone speculative row's (pre-decoding, over the committed keys).
      const int64_t row = decode_row ? r0 : r1 - 1;
      read.w = WindowFor(decode_row ? call.rows[r0].pos + 1 : call.rows[row].pos);
      ScoreOwnSelection(*s, st, call.q + row * config_.n_head * config_.head_dim, read);
    }
    r0 = r1;
  }
  return SelectAndStart(call);
}

void SparseKvCache::AttendPrefillRows(Seq& s, const model::AttentionCall& call, int64_t r0, int64_t r1) {
  // Dense over the device copy of the whole prefix: sinks then [dev_base = sinks, length).
  const LayerState& st = s.layers[call.layer];
  const int64_t n_keys = call.rows[r1 - 1].pos + 1;
  const int64_t n_sink = std::min(n_keys, options_.sink_tokens);
  const backend::KvRun runs[2] = {{static_cast<const float*>(st.sink_k.data), static_cast<const float*>(st.sink_v.data), n_sink},
                                  {static_cast<const float*>(st.k.data), static_cast<const float*>(st.v.data), n_keys - n_sink}};
  ops_.AttendCausal(CausalRows(call, config_, r0, r1, /*lo=*/0, runs, &prefill_positions_));
}

SparseKvCache::Window SparseKvCache::WindowFor(int64_t n) const {
  const int64_t C = options_.chunk_tokens;
  Window w;
  w.sinks = std::min(n, options_.sink_tokens);
  const int64_t window_start = std::max(w.sinks, n - options_.window_tokens);
  const int64_t first_window_chunk = window_start / C;
  w.dense_from = std::max(w.sinks, first_window_chunk * C);
  w.sel_begin = options_.sink_tokens / C;
  w.sel_end = std::max(w.sel_begin, first_window_chunk);
  return w;
}

absl::StatusOr<Predictor> ParsePredictor(absl::string_view name) {
  for (Predictor p : {Predictor::kSpeculative, Predictor::kPrevious, Predictor::kUnion, Predictor::kRandomToken,
                      Predictor::kOracleToken}) {
    if (name == PredictorName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown predictor '", name, "' (speculative, previous, union, random, oracle)"));
}

absl::string_view PredictorName(Predictor p) {
  switch (p) {
    case Predictor::kSpeculative: return "speculative";
    case Predictor::kPrevious: return "previous";
    case Predictor::kUnion: return "union";
    case Predictor::kRandomToken: return "random";
    case Predictor::kOracleToken: return "oracle";
  }
  return "unknown";
}

absl::Status SparseKvCache::WaitBuffer(Buffer& b) { return chunks_.FinishLanding(b.landing, backend::Queue::kPrefetch); }

int64_t SparseKvCache::NextRead(const Seq& s, int64_t sparse_index) const {
  // Reads go through the sparse layers in order, one per layer per step; the next read of
  // layer j is the first read index >= s.reads that falls on j.
  const int64_t L = static_cast<int64_t>(sparse_layers_.size());
  const int64_t now = s.reads % L;
  return s.reads + (sparse_index - now + L) % L;
}

absl::Status SparseKvCache::TryIssue(Seq& s, int64_t layer) {
  LayerState& st = s.layers[layer];
  if (!st.has_prediction) return absl::OkStatus();
  const int64_t d = static_cast<int64_t>(s.buffers.size());
  const int64_t k = NextRead(s, sparse_index_[layer]);
  if (k - d >= s.reads) return absl::OkStatus();  // its buffer still serves an earlier read
  Buffer& b = s.buffers[k % d];
  if (b.layer >= 0 || b.landing.pending) return absl::OkStatus();  // not yet handed back
  if (!b.data) {  // an unreserved slot
    ASSIGN_OR_RETURN(b.data, device_.Allocate(backend::MemoryTag::kPrefetchRing, BudgetBlocks() * block_bytes()));
  }
  RETURN_IF_ERROR(StartGather(s, layer, st.predicted, kvpool::Priority::kBackground, b.data, &b.landing));
  b.layer = layer;
  b.seeded = st.seeded;
  for (const auto& v : st.predicted) CountPrefetched(s, layer, static_cast<int64_t>(v.size()));
  b.sel = std::move(st.predicted);
  st.predicted.clear();
  st.has_prediction = false;
  return absl::OkStatus();
}

absl::Status SparseKvCache::EndRingRead(Seq& s, int64_t layer) {
  const int64_t d = static_cast<int64_t>(s.buffers.size());
  if (s.reading >= 0) {
    Buffer& b = s.buffers[s.reading];
    b.layer = -1;  // its blocks are no longer read: free for the next read that uses it
    b.sel.clear();
    s.reading = -1;
  }
  ++s.reads;
  // The read `d` after this one uses the buffer just freed.
  const int64_t L = static_cast<int64_t>(sparse_layers_.size());
  const int64_t next_layer = sparse_layers_[(sparse_index_[layer] + d) % L];
  return TryIssue(s, next_layer);
}

void SparseKvCache::WaitAll(Seq& s) {
  for (Buffer& b : s.buffers) (void)WaitBuffer(b);
  for (LayerState& st : s.layers) (void)WaitPrefetch(st);
}

absl::Status SparseKvCache::StartGather(Seq& s, int64_t layer, const Selection& sel, kvpool::Priority priority,
                                        const backend::DeviceBuffer& buf, Landing* l) {
  std::vector<kvpool::ChunkRef> refs;
  std::vector<BlockDst> dsts;
  for (size_t g = 0; g < sel.size(); ++g) {
    for (int64_t c : sel[g]) {
      dsts.push_back(DstAt(buf, static_cast<int64_t>(refs.size())));
      refs.push_back({static_cast<int32_t>(layer), static_cast<int32_t>(g), c});
    }
  }
  if (static_cast<int64_t>(refs.size()) > BudgetBlocks()) {
    return absl::InternalError(absl::StrCat("a gather of ", refs.size(), " blocks exceeds the budget's ", BudgetBlocks()));
  }
  return chunks_.StartLanding(s.store_id, refs, std::move(dsts), priority, l);
}

}  // namespace dd::engine
