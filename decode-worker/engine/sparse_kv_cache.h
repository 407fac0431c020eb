// Sparse KV cache, `sparse` decode mode (ShadowKV-style on-demand retrieval; docs/architecture.md,
// "KV caches, landmarks and selection" and "A decode step in each mode").
//
// For each sparse layer (global-attention layers; sliding-window layers stay dense) and each
// sequence, the device keeps: the attention sinks (first `sink_tokens`), the local window
// (chunks overlapping the last `window_tokens` positions) including the unfilled tail chunk,
// and one landmark per full chunk per KV head (the mean of the chunk's post-RoPE keys). Full
// chunks are written to the KvStore as they fill. A decode row's query scores the selectable
// chunks (neither sinks nor window) per KV head — score = max over the group's query heads of
// q · landmark, ties to the lower chunk — takes the top budget/chunk, fetches them from the
// store on the critical path (urgent priority) and attends exactly over sinks ∪ selected ∪
// window in ascending position order. When every selectable chunk fits the budget, the
// result is bit-identical to the dense cache.
//
// Prefill rows attend densely (the whole prefix stays on the device while a sequence is
// prefilling); at the first decode row the prefix becomes a ring of the window's rows.
//
// Everything the cache keeps on the device is in device buffers from the engine's Device,
// sized at admission (Reserve): sinks, window rows, landmarks, resident slots, prefetch
// buffers and the urgent blocks; the host reads device memory only through copies (landmark
// scores and offloaded rows), so the cache runs on devices the host cannot touch (sim, cuda).
// The store's side — sequences, offloaded blocks and landmarks, landings, fork copies — is
// ChunkStore's (chunk_store.h).
//
// Decode rows are batch-wide per layer (sparse_kv_cache_decode.cc): every sequence's
// selection and transfers first, then one wait per sequence, one attention call for the
// whole batch (one group of lists per sequence), and only then the buffer hand-backs and
// prefetches that may overwrite what attention read.
//
// `dualdecoder` mode (docs/decisions/0008-dual-token-step.md) adds speculative rows: a speculative
// row after a real row attends over the real row's keys plus its own KV (not kept), and its query
// selects the chunks the next step is predicted to need (P'); those are gathered at background
// priority into a per-layer prefetch buffer. At the next step the real query selects S exactly;
// chunks of S in P' come from the buffer, the misses S \ P' are fetched at urgent priority, so the
// real row's result is bit-identical to `sparse`. A speculative row alone (pre-decoding, after
// prefill) selects, fetches and attends for itself and seeds P' with its selection.
// Prefetches are asynchronous: the store's link serves them in the background while compute
// goes on, and the real row waits for its layer's prefetch only when it needs the data. Each
// (sequence, sparse layer) has its own prefetch buffer: its in-flight transfer is always
// waited before attention reads it and before a new prefetch is issued into it. Not
// thread-safe (one compute thread); the store's transfer thread writes only into buffers
// handed to it until the matching Wait.
//
// With `step_cache` (`sparse-cached` mode, and dualdecoder by default) each
// (sequence, sparse layer) keeps a ResidentSet: the chunks earlier steps attended stay on the
// device, a real row fetches only S \ resident on the urgent path, and dualdecoder's
// speculative row prefetches only P' \ resident, straight into resident slots, as soon as
// the row is done with its layer (no ring: the lead is a whole step). Which chunks are
// attended, and in which order, never changes: results are bit-identical to `sparse`.
#pragma once

#include <bitset>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "dd/backend/device.h"
#include "dd/backend/ops.h"
#include "decode-worker/engine/chunk_store.h"
#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/engine/kv_cache.h"
#include "decode-worker/engine/resident_set.h"
#include "decode-worker/engine/selection_model.h"
#include "kv-pool/client/kv_store.h"

namespace dd::engine {

// What P' (the chunks prefetched for the next step) is predicted from (eval/predictors.py compares
// them; results are identical whatever the predictor, only hits and transfers change):
//   speculative  the speculative row's query (the design; the default);
//   previous     the real row's own selection of this step ("reuse the last selection");
//   union        half from each ranking, filled from the speculative one, at the same size;
//   random       the speculative row, fed a random token instead of the predicted one;
//   oracle       the speculative row, fed the true next token (replaying a finished run).
// The last two are chosen by the engine (which token feeds the speculative row).
enum class Predictor { kSpeculative, kPrevious, kUnion, kRandomToken, kOracleToken };
absl::StatusOr<Predictor> ParsePredictor(absl::string_view name);
absl::string_view PredictorName(Predictor p);

struct SparseOptions {
  int64_t budget_tokens = 2048;  // selected tokens per step per KV head (a multiple of chunk)
  int64_t chunk_tokens = 8;
  int64_t sink_tokens = 16;
  int64_t window_tokens = 64;
  // Also write sliding-window layers' full chunks to the store (prefix reuse needs every
  // layer's KV of a committed prefix).
  bool offload_sliding = false;
  Predictor predictor = Predictor::kSpeculative;
  // dualdecoder: prefetch buffers per request, used round robin by the sparse layers in the
  // order they are read (2 = ping-pong). It is also the lead distance: a layer's prefetch is
  // issued as soon as the layer this many reads before it has been read (wrapping across
  // steps); >= the number of sparse layers means every prediction goes out at once.
  int64_t prefetch_buffers = 2;
  // dualdecoder: the speculative row after a real row scores only the landmarks of the real
  // row's best `spec_candidates` × budget chunks per KV head (plus chunks that became
  // selectable since), not every chunk: its prediction costs O(budget), not O(context).
  // Changes the prediction, never the results. 0 = every chunk. At most kMaxSpecCandidates.
  // kAutoSpecCandidates (the default): the Engine picks by the speculative head — 4 with the
  // full head (SmolLM2's hit rate on the license texts 95.4% vs 95.5% with every chunk, 94.3%
  // with 2, 82.0% with 1), 0 with the context head (Gemma at 16K: 86.7% with 4 vs 94.2%;
  // docs/decisions/0009-speculative-row-cost.md); a cache built without an Engine takes 4.
  static constexpr int64_t kAutoSpecCandidates = -1;
  static constexpr int64_t kFullHeadSpecCandidates = 4;
  int64_t spec_candidates = kAutoSpecCandidates;
  static constexpr int64_t kMaxSpecCandidates = 64;
  // spec_candidates with kAutoSpecCandidates resolved for a speculative head (the one place
  // the rule above lives).
  int64_t SpecCandidatesFor(bool full_head) const {
    if (spec_candidates != kAutoSpecCandidates) return spec_candidates;
    return full_head ? kFullHeadSpecCandidates : 0;
  }
  // Keep attended chunks resident across steps (see above). Off: every step gathers its whole
  // selection (`sparse`) or prefetches its whole prediction into the ring (dualdecoder).
  bool step_cache = false;
  // dualdecoder: speculative rows will come, so Reserve sizes the prefetch ring too (without
  // the step cache). Set by the Engine from the mode.
  bool dual_token = false;
  // Resident slots per KV head beyond the budget (in tokens, a multiple of the chunk): chunks
  // a step stops selecting stay this much longer, least recently used evicted first.
  int64_t resident_margin_tokens = 0;
  // None set: every global layer is sparse. Otherwise only these (global) layers are; the
  // other global layers attend over their whole KV like `full` (per-layer fidelity: the loss
  // one sparse layer causes). Not with prefix reuse (dense layers are not offloaded).
  static constexpr int64_t kMaxLayers = 256;
  std::bitset<kMaxLayers> sparse_layers{};
  // Benchmarks on synthetic weights: the chunks attended and predicted follow this stated model
  // instead of the landmark scores (which are still computed): selection_model.h. Off by
  // default; the predictor then plays no part.
  SelectionModel selection_model{};
  // InvalidArgument naming the field: budget smaller than a chunk or larger than the
  // model context, non-positive chunk, sinks/window not multiples of the chunk.
  absl::Status Validate(int64_t model_context) const;
};

class SparseKvCache : public KvCache {
 public:
  // `store` and `device` (the engine's) must outlive the cache.
  static absl::StatusOr<std::unique_ptr<SparseKvCache>> Create(const model::ModelConfig& config,
                                                               const SparseOptions& options,
                                                               kvpool::KvStore* store, backend::Device& device);

  // Fault injection for the tests that show a missing wait is caught (on the sim device):
  // every cache of the process leaves out that wait from now on.
  enum class SkipWait {
    kNone,
    kComputeWaitsForLanding,  // attention does not wait for the blocks copied to the device
  };
  static void SkipWaitForTesting(SkipWait skip);

  // Device bytes of a sequence's landmark-score buffer, for a request that may reach
  // `total_tokens` (part of the request's workspace in MemoryPlan).
  static int64_t ScoresBytes(const model::ModelConfig& config, const SparseOptions& options, int64_t total_tokens);

  ~SparseKvCache() override;  // waits for transfers still writing into its buffers
  // Opens the slot's sequence in the store now rather than at its first row, so that a full
  // pool fails this request alone (at admission) instead of a whole forward pass.
  absl::Status Open(int32_t seq) { return GetSeq(seq).status(); }
  // The dual-token step's carry: layers [0, carry_layers()) attend densely and exactly
  // (sliding windows, global layers kept dense) up to the first sparse layer, so a speculative
  // row's state through them is the next real row's when the tokens match. 0 when the first
  // layer is sparse, or when sliding layers are offloaded (a kept row would skip that).
  int64_t carry_layers() const;
  // Keeps slot `seq`'s last speculative KV in those layers (DenseKvCache::KeepSpeculative).
  absl::Status KeepSpeculative(int32_t seq, int64_t layers);
  void Reset(int32_t seq) override;
  absl::Status Copy(int32_t src, int32_t dst) override;
  int64_t Length(int32_t seq) const override;
  int64_t device_bytes() const override;
  absl::Status Attend(const model::AttentionCall& call) override;

  // Prefix reuse. RestorePrefix makes empty slot `seq` hold the state a prefill of the first
  // `tokens` positions (a multiple of the chunk) would have left, reading every layer's blocks
  // from `handle` (a store sequence, e.g. from LookupPrefix) and copying them into the slot's
  // own store sequence; the prefill then continues at `tokens`, bit-identical to a whole one.
  absl::Status RestorePrefix(int32_t seq, kvpool::SequenceId handle, int64_t tokens);
  // Commits the slot's first keys.size() prefix blocks under their keys, for `owner`
  // (KvStore::CommitPrefix).
  absl::Status CommitPrefix(int32_t seq, absl::Span<const uint64_t> keys, uint64_t owner);
  // Sliding layers' blocks are not written to the store (offload_sliding is for prefix reuse,
  // which random KV cannot serve).
  absl::Status FillRandom(int32_t seq, int64_t tokens, uint64_t seed) override;
  kvpool::KvLayout store_layout() const { return chunks_.layout(); }

  // Per sparse layer, in chunks (one chunk = one KV head's block), since construction.
  struct LayerStats {
    int64_t selected = 0;    // |S| summed over real decode rows and KV heads
    int64_t hits = 0;        // |P' ∩ S| where a prediction existed
    int64_t predicted_for = 0;  // |S| of the rows that had a prediction (hit-rate denominator)
    int64_t prefetched = 0;  // |P'| gathered in the background
    int64_t urgent = 0;      // fetched on the critical path
    int64_t wasted = 0;      // |P' \ S|
    // The part of hits / predicted_for from predictions seeded by pre-decoding (the first
    // decode step after prefill, where P' is exactly S by construction).
    int64_t seeded_hits = 0, seeded_for = 0;
    // step_cache: chunks of S already resident from earlier steps (not this step's prefetch),
    // and resident chunks evicted to make room.
    int64_t reused = 0;
    int64_t evictions = 0;
    double hit_rate() const { return predicted_for ? static_cast<double>(hits) / predicted_for : 0.0; }
    double hit_rate_after_first() const {
      const int64_t d = predicted_for - seeded_for;
      return d ? static_cast<double>(hits - seeded_hits) / d : 0.0;
    }
  };
  const std::vector<LayerStats>& layer_stats() const { return stats_; }
  LayerStats total_stats() const;  // summed over layers
  // The slot's own hit rate |P' ∩ S| / |S| since it was opened, first decode step excluded;
  // 0 when it has had no prediction yet (or the slot is unknown).
  double SeqHitRate(int32_t seq) const;
  // KV bytes one sequence moved so far (prefetched, urgent, wasted = prefetched but unused).
  struct SeqKvBytes {
    int64_t prefetched = 0, urgent = 0, wasted = 0;
  };
  SeqKvBytes SeqTransfers(int32_t seq) const;
  int64_t block_bytes() const { return chunks_.block_bytes(); }
  int64_t fetched_chunks() const { return chunks_.fetched_chunks(); }
  // Of those, the ones the device gathered itself from the store's mapped memory (a shm://
  // pool on a device the host cannot write: ChunkStore).
  int64_t device_gathered_chunks() const { return chunks_.device_gathered_chunks(); }
  // Of the others, on such a device, those moved by one device gather per buffer from the
  // landing's registered host staging (the in-process store, ucx://).
  int64_t staged_gathered_chunks() const { return chunks_.staged_gathered_chunks(); }
  int64_t direct_chunks() const { return chunks_.direct_chunks(); }
  // Before the store's Recover: the device unregisters the store's mapped memory (after the
  // gathers from it), to register the new mapping at the next landing.
  void ForgetStoreMappings() { chunks_.ForgetMappings(); }
  // Benchmarks: the selection model from the next step on (SparseOptions::selection_model).
  void SetSelectionModel(const SelectionModel& m) { options_.selection_model = m; }

  // Device memory for slot `seq` (empty) for a request of `prompt_tokens` growing to
  // `total_tokens`, prefilled `pass_rows` rows per pass at most: every buffer the sparse and
  // dense layers will use, so that a decode step allocates nothing and the allocator's totals
  // are MemoryPlan's (tested). RESOURCE_EXHAUSTED (nothing kept) when the device cannot hold
  // it. A slot used without Reserve allocates as it goes (tests).
  absl::Status Reserve(int32_t seq, int64_t prompt_tokens, int64_t total_tokens, int64_t pass_rows);
  // The prompt is in: the prefill's linear rows become the decode window's ring, and the
  // sliding layers' rings shrink (DenseKvCache::FinishPrefill).
  absl::Status FinishPrefill(int32_t seq);

 private:
  using BlockDst = ChunkStore::BlockDst;
  using Landing = ChunkStore::Landing;
  struct LayerState {
    int64_t length = 0;          // positions written
    // Device rows (n_kv × hd floats each): positions [0, sinks) in sink_k/v at row = position;
    // positions from `sinks` on in k/v at row (pos - sinks), or (pos - sinks) % ring once the
    // prompt is in (ring > 0: the decode window).
    backend::DeviceBuffer sink_k, sink_v, k, v;
    int64_t sink_cap = 0, cap = 0, ring = 0;  // rows
    backend::DeviceBuffer landmarks;  // per full chunk, n_kv × hd floats
    int64_t landmark_cap = 0;         // chunks
    backend::DeviceBuffer slots;      // step cache: the resident set's blocks
    bool decoded = false;        // a decode row has run (no more dense prefill)
    // The next step's P' for this layer, computed by a speculative row and not yet issued
    // into a prefetch buffer (issue waits for the buffer, see Seq::buffers).
    bool has_prediction = false;
    bool seeded = false;         // the prediction came from pre-decoding
    std::vector<std::vector<int64_t>> predicted;  // P' per KV head, ascending
    // step_cache state: the resident chunks, the background gather writing its in-flight
    // slots, the prediction last issued (P', for hit statistics) and the part of it that
    // was actually fetched (P' \ resident).
    ResidentSet resident;
    int64_t stamp = 0;  // real reads so far (least-recently-used clock)
    Landing prefetch;
    bool issued = false, issued_seeded = false;
    std::vector<std::vector<int64_t>> issued_sel, prefetch_chunks;
    // The selection model: the S it drew for the real row at position model_pos (-1: none).
    int64_t model_pos = -1;
    std::vector<std::vector<int64_t>> model_sel;
  };
  // A prefetch buffer: P' blocks of one sparse layer, heads in order, in flight until waited.
  struct Buffer {
    backend::DeviceBuffer data;             // budget blocks per KV head
    std::vector<std::vector<int64_t>> sel;  // what it holds (P' per KV head)
    int64_t layer = -1;                     // the model layer it is for; -1 = free
    bool seeded = false;
    Landing landing;
  };
  using Selection = std::vector<std::vector<int64_t>>;  // chunks per KV head, ascending
  struct Seq {
    kvpool::SequenceId store_id = 0;
    bool open = false;
    bool reserved = false;  // Reserve sized its buffers for the whole request
    int64_t total = 0;      // reserved: the positions it may reach
    std::vector<LayerState> layers;  // indexed by model layer; unused for dense layers
    // Sparse-layer reads by real rows so far, across steps: read k uses buffers[k % size]
    // and, once finished, frees it for read k + size.
    std::vector<Buffer> buffers;
    // Without the step cache: the blocks a read fetches on the urgent path (budget per KV
    // head), read by the layer's attention call.
    backend::DeviceBuffer urgent_blocks;
    // One selection's landmark scores (KV head g's from g × score_stride floats on) and,
    // from ids_offset bytes on, its chosen chunk ids (head g's from g × id_stride on).
    backend::DeviceBuffer scores;
    int64_t score_stride = 0, id_stride = 0, ids_offset = 0;
    int64_t reads = 0;
    int64_t reading = -1;  // the buffer the current real row reads until its step finishes
    // This request's prediction outcomes after its first decode step (the seeded step is
    // excluded: there P' = S by construction).
    int64_t hits = 0, predicted_for = 0;
    // Blocks this request moved: prefetched, fetched on the urgent path, prefetched unused.
    int64_t prefetched = 0, urgent = 0, wasted = 0;
  };
  SparseKvCache(const model::ModelConfig& config, const SparseOptions& options, kvpool::KvStore* store,
                backend::Device& device);

  absl::StatusOr<Seq*> GetSeq(int32_t seq);
  // ---- statistics: each event counted for its layer (stats_) and its request (Seq) ----
  // A prediction met by a real row's selection, per KV head: `hits` of its `selected` chunks
  // were predicted, `unused` predicted blocks were moved for nothing; a seeded prediction (the
  // pre-decoded first step) counts for the layer but not in the request's own rate.
  void CountPrediction(Seq& s, int64_t layer, int64_t hits, int64_t selected, int64_t unused, bool seeded);
  void CountPrefetched(Seq& s, int64_t layer, int64_t blocks);
  void CountUrgent(Seq& s, int64_t layer, int64_t blocks);
  // ---- device memory (sparse_kv_cache_device.cc) ----
  int64_t RowBytes() const { return config_.n_head_kv * config_.head_dim * static_cast<int64_t>(sizeof(float)); }
  int64_t BlockFloats() const { return 2 * options_.chunk_tokens * config_.head_dim; }
  int64_t BudgetBlocks() const { return options_.budget_tokens / options_.chunk_tokens * config_.n_head_kv; }
  // The decode window's ring in rows, for a sequence that may reach `total` positions (0:
  // unknown).
  int64_t RingRows(int64_t total) const;
  absl::StatusOr<backend::DeviceBuffer> Allocate(backend::MemoryTag tag, int64_t bytes);
  // K and V buffers of `rows` rows each (kv); nothing kept on failure.
  absl::Status AllocateRows(int64_t rows, backend::DeviceBuffer* k, backend::DeviceBuffer* v);
  // *dst: a buffer like `src` (empty if src is), holding its bytes when `contents`.
  absl::Status Duplicate(const backend::DeviceBuffer& src, bool contents, backend::DeviceBuffer* dst);
  void Free(backend::DeviceBuffer& buf) { device_.Free(buf); }
  void FreeSeq(Seq& s);  // every device buffer of the slot (after WaitAll and a sync)
  // Makes room for `rows` positions from `sinks` on (linear) / `chunks` landmarks, growing
  // geometrically on an unreserved slot.
  absl::Status EnsureRows(LayerState& st, int64_t end);
  absl::Status EnsureLandmarks(LayerState& st, int64_t chunks);
  absl::Status EnsureSlots(LayerState& st);
  absl::Status EnsureSeqBuffers(Seq& s);
  // Gives `st` k/v of `cap` rows (a ring when `ring`), keeping the positions that fit.
  absl::Status ResizeRows(LayerState& st, int64_t cap, bool ring);
  // Copies positions [p0, p1) into the device rows from `src_buf` (device) or, when it is
  // empty, host memory (complete when the caller synchronizes).
  absl::Status StoreRows(LayerState& st, int64_t p0, int64_t p1, const backend::DeviceBuffer& src_buf,
                         const float* k, const float* v);
  // Positions [p0, p1) as runs contiguous in one buffer pair: `sink` runs in sink_k/v, the
  // others in k/v, from row `row` on. At most three (sinks, then a ring's wrap).
  struct RowRun {
    int64_t pos = 0, len = 0, row = 0;
    bool sink = false;
  };
  int RunsOf(const LayerState& st, int64_t p0, int64_t p1, RowRun out[3]) const;
  // Enqueues copies of positions [p0, p1) into host rows k and v (complete after a sync).
  absl::Status RowsToHost(const LayerState& st, int64_t p0, int64_t p1, float* k, float* v);
  absl::Status DuplicateLayer(const LayerState& from, LayerState& to);
  const float* BlockAt(const backend::DeviceBuffer& buf, int64_t block) const {
    return static_cast<const float*>(buf.data) + block * BlockFloats();
  }
  BlockDst DstAt(const backend::DeviceBuffer& buf, int64_t block) const {
    return {buf, block * BlockFloats() * static_cast<int64_t>(sizeof(float))};
  }
  const float* LandmarkAt(const LayerState& st, int64_t chunk, int64_t g) const {
    return static_cast<const float*>(st.landmarks.data) + (chunk * config_.n_head_kv + g) * config_.head_dim;
  }

  // Appends rows for positions [pos, pos + n) (k, v: n rows, device memory in src_buf, or host
  // memory when it is empty); every chunk they complete gets its landmarks and goes to the
  // store.
  absl::Status AppendRows(Seq& s, int64_t layer, const backend::DeviceBuffer& src_buf, const float* k,
                          const float* v, int64_t pos, int64_t n);
  // offload_sliding: writes the chunks the call's real rows completed on a sliding layer.
  absl::Status OffloadSlidingChunks(const model::AttentionCall& call);
  // Decode-row window geometry for `n` visible committed-or-own positions.
  struct Window {
    int64_t sinks, dense_from, sel_begin, sel_end;
  };
  Window WindowFor(int64_t n) const;
  // ---- selection (sparse_kv_cache_select.cc) ----
  // Enqueues the landmark scores of query `q` (n_head × head_dim) into s.scores: per KV head,
  // the max over its query heads is taken later; the chunks scored go to *cands — `candidates`
  // (each in the window's selectable range) or else the whole range.
  void ScoreChunks(const Seq& s, const LayerState& st, const float* q, const Window& w, const Selection* candidates,
                   Selection* cands);
  int64_t k_sel() const { return options_.budget_tokens / options_.chunk_tokens; }
  // The previous and union predictors read the real row's selection in score order.
  bool Ranks() const { return options_.predictor == Predictor::kPrevious || options_.predictor == Predictor::kUnion; }
  static int64_t IdsOffset(const model::ModelConfig& config, int64_t chunks);
  // Enqueues the top chunks of the scores ScoreChunks left (Ops::TopChunks, one list per KV
  // head): the best `take` per head, the best k first, in score order when `sorted`.
  void RankChunks(const Seq& s, const Selection& cands, int64_t take, bool sorted);
  // One copy and one sync for every read's chosen ids where the host cannot read them in place.
  absl::Status IdsToHost(bool predictions);
  // The selection from RankChunks' ids: top budget/chunk per KV head, ascending; `ranked`
  // (optional, sorted ids) the same by score; `shortlist` (optional) all `take` ids.
  Selection Chosen(const int64_t* ids, int64_t stride, const Selection& cands, int64_t take, Selection* ranked,
                   Selection* shortlist) const;
  // Every read's selection (the scores of StartReads), its transfers started, then the
  // speculative rows' predictions: two syncs per layer for the whole batch, not two per
  // sequence.
  absl::Status SelectAndStart(const model::AttentionCall& call);
  // The union predictor: alternately from both rankings, within the next window, k per head.
  Selection UnionOf(const Selection& a, const Selection& b, const Window& w) const;
  // Starts a gather of `sel` into consecutive blocks of `buf` without waiting.
  absl::Status StartGather(Seq& s, int64_t layer, const Selection& sel, kvpool::Priority priority,
                           const backend::DeviceBuffer& buf, Landing* l);
  absl::Status WaitBuffer(Buffer& b);
  void WaitAll(Seq& s);
  // Issues layer `layer`'s pending prediction into the buffer of its next read, if that buffer
  // is free for it (the read `prefetch_buffers` before it is finished).
  absl::Status TryIssue(Seq& s, int64_t layer);
  // The ring (step_cache off): the real row of the current read is done with its blocks (and
  // so is the speculative row after it): frees its buffer and issues the prediction of the
  // read it serves next.
  absl::Status EndRingRead(Seq& s, int64_t layer);
  // Next read index of sparse layer `layer` (index among sparse layers) from now.
  int64_t NextRead(const Seq& s, int64_t sparse_index) const;
  // The first decode row of a layer: the prompt's linear rows become the window's ring.
  absl::Status StartDecoding(const Seq& s, LayerState& st);

  // One sequence's decode rows of a sparse layer within an Attend call: an entry of the
  // layer's attention plan (sparse_kv_cache_decode.cc). Kept across calls for their buffers.
  struct DecodeRead {
    int32_t seq = 0;
    int64_t real_row = -1;   // the real decode row in the call, or -1 (pre-decoding)
    int64_t spec_row = -1;   // the speculative row after it, or -1
    Window w{};              // the window the rows attend over
    Selection sel;           // the chunks they attend, per KV head, ascending
    Selection cands;         // the chunks scored for sel
    Selection ranked;        // sel by score (previous and union predictors)
    Selection shortlist;     // the real row's best chunks, the speculative row's candidates
    Window next{};           // the next step's window (the prediction's)
    Selection spec_cands;    // the chunks scored for the prediction
    bool predict_pending = false;  // the prediction is scored, not chosen yet
    int64_t take = 0;        // ids ranked per head for sel (with the shortlist: more than k)
    std::vector<int64_t> ids_host;  // the ids, where the host cannot read them in place
    Selection predicted;     // the speculative row's P' for the next step
    Selection model_predicted;  // the selection model's P' (replaces `predicted`)
    Selection misses;        // the ring: S \ P', fetched urgently into Seq::urgent_blocks
    int64_t buffer = -1;     // the ring: the prefetch buffer the real row reads
    std::vector<const float*> blocks;  // one per selected chunk, heads in order, where it lies
    Landing urgent;                    // the urgent blocks, not yet waited for
    bool wait_prefetch = false;        // step cache: it reads slots the layer's prefetch writes
    int64_t count_urgent = 0, count_reused = 0, count_evicted = 0;  // step cache statistics
  };
  // Every decode read of the call: per sequence, KV appended, prompt rows attended, decode
  // reads started (selections, urgent transfers issued, none waited).
  absl::Status StartReads(const model::AttentionCall& call);
  DecodeRead& AddRead(int32_t seq);
  // A read's own selection (the real row's, or a pre-decoding row's) scored and ranked.
  void ScoreOwnSelection(const Seq& s, const LayerState& st, const float* q, DecodeRead& r);
  // The real row's S chosen: its hit statistics, its transfers started.
  absl::Status StartRealRead(Seq& s, const model::AttentionCall& call, DecodeRead& r);
  // The speculative row's prediction P' for the next step (after the real row's selection,
  // whose shortlist and ranking it reads): scored (or, for `previous`, taken at once), then
  // chosen by FinishPrediction once the scores are in.
  void ScorePrediction(Seq& s, const model::AttentionCall& call, DecodeRead& r);
  void FinishPrediction(const Seq& s, DecodeRead& r);
  // The selection model (options_.selection_model): the read's S replaced by the model's,
  // the next step's S drawn and, where a speculative row follows, its prediction.
  void ModelSelection(Seq& s, const model::AttentionCall& call, DecodeRead& r);
  // Pre-decoding: a speculative row alone, its selection chosen: its transfers started.
  absl::Status StartPreDecodeRead(Seq& s, const model::AttentionCall& call, DecodeRead& r);
  // Waits for the read's transfers and points r.blocks at its blocks.
  absl::Status FinishFetch(Seq& s, int64_t layer, DecodeRead& r);
  // Every read's waits, one attention call for all of them, then what may follow attention.
  absl::Status AttendDecodeReads(const model::AttentionCall& call);
  void AttendPlanned(const model::AttentionCall& call);
  // After attention: the ring's buffer handed back, the prediction issued.
  absl::Status AfterAttention(Seq& s, int64_t layer, DecodeRead& r);
  // Where read r's ids are on the host: in place, or its copy.
  const int64_t* IdsOf(const Seq& s, const DecodeRead& r) const;
  // On an error: waits for the reads' urgent transfers still in flight and drops the reads.
  void AbandonReads();

  // step_cache (sparse_kv_cache_resident.cc): makes every chunk of r.sel resident, the
  // missing ones on the urgent path (started, not waited); statistics counted when `count`.
  absl::Status StartResidentFetch(Seq& s, int64_t layer, bool count, DecodeRead& r);
  // Waits for what the read reads and points r.blocks at its slots in order.
  absl::Status FinishResidentFetch(Seq& s, int64_t layer, DecodeRead& r);
  // Prefetches P' \ resident into resident slots at background priority.
  absl::Status IssueResidentPrefetch(Seq& s, int64_t layer, Selection predicted, bool seeded);
  absl::Status WaitPrefetch(LayerState& st);
  void AttendPrefillRows(Seq& s, const model::AttentionCall& call, int64_t r0, int64_t r1);
  // Device addresses of position `pos`'s K and V rows (held: a sink, or in the rows).
  const float* DevK(const LayerState& st, int64_t pos) const;
  const float* DevV(const LayerState& st, int64_t pos) const;
  int64_t RowOf(const LayerState& st, int64_t pos) const {
    const int64_t i = pos - options_.sink_tokens;
    return st.ring > 0 ? i % st.ring : i;
  }

  const model::ModelConfig& config_;
  SparseOptions options_;
  backend::Device& device_;
  backend::Ops& ops_;
  const bool host_visible_;  // the host may read and the store write device memory (cpu)
  ChunkStore chunks_;   // the store's side: offloads, landmarks, landings, fork copies
  DenseKvCache dense_;  // the dense (sliding-window) layers
  std::vector<Seq> seqs_;
  std::vector<DecodeRead> reads_;  // this layer's decode reads: [0, n_reads_) in use
  size_t n_reads_ = 0;
  // The layer's attention plan: every read's keys in order per KV head, its lists, its rows
  // (at most two per read) and one group per read.
  std::vector<const float*> attend_keys_, attend_values_;
  std::vector<backend::KeyValueList> attend_lists_;
  std::vector<backend::ListQuery> attend_rows_;
  std::vector<backend::AttentionGroup> attend_groups_;
  std::vector<float> host_k_, host_v_; // AppendRows: the completed chunks' rows, on the host
  std::vector<float> landmark_host_;   // AppendRows: the completed chunks' landmarks
  std::vector<int64_t> prefill_positions_;  // AttendPrefillRows' rows' positions
  std::vector<LayerStats> stats_;
  std::vector<int64_t> sparse_index_;  // per model layer: its index among the sparse layers (-1: dense)
  std::vector<int64_t> sparse_layers_; // the sparse layers' model indices, in order
};

}  // namespace dd::engine
