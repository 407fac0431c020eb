// The CPU decode engine: sequences in slots, chunked prefill, batched decode, in one of four
// modes (docs/decisions/0006-decode-modes.md): `full` (dense KV), `sparse` (top-k chunks
// fetched on demand from a KV store), `sparse-cached` (the same with chunks kept resident
// across steps, fetching only the misses) and `dualdecoder` (sparse plus a speculative row per
// request that predicts the next step's chunks, prefetched in the background; real rows
// bit-identical to `sparse`).
//
// Prefill runs a prompt in chunks of `prefill_chunk` tokens; DecodeStep advances several
// sequences by one token in one batched forward (continuous batching builds on this).
// Not thread-safe: one caller drives the engine.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "dd/backend/device.h"
#include "decode-worker/engine/kv_cache.h"
#include "decode-worker/engine/memory_plan.h"
#include "decode-worker/engine/prefix_reuse.h"
#include "decode-worker/engine/sparse_kv_cache.h"
#include "decode-worker/engine/sampler.h"
#include "decode-worker/engine/dual_token.h"
#include "decode-worker/engine/spec_head.h"
#include "decode-worker/engine/token_history.h"
#include "decode-worker/engine/text_stream.h"
#include "decode-worker/model/transformer.h"
#include "decode-worker/model/weights.h"

namespace dd::engine {

// DecodeMode (memory_plan.h) — full: dense KV on the device. sparse: top-k chunks fetched on
// demand. dualdecoder: sparse plus a speculative row per request whose query predicts the next
// step's chunks (prefetch).
absl::StatusOr<DecodeMode> ParseDecodeMode(absl::string_view name);  // "full", "sparse", "dualdecoder"
absl::string_view DecodeModeName(DecodeMode mode);

struct EngineOptions {
  DecodeMode mode = DecodeMode::kFull;
  // The compute device (dd/backend/registry.h): "cpu" and "sim" run everywhere (every mode);
  // "cuda" runs on GPU 0 and is refused with the reason where it cannot. Flags resolve "auto".
  std::string device = "cpu";
  std::string device_why{};   // how `device` was chosen, for the start-up line (flags: auto or requested)
  // What the flags' start-up device check (device_check.h, engine_flags.h) found, for /metrics:
  // the device checked (empty when none ran: the cpu was named, or auto had no other
  // candidate), its verdict and what it cost (both runs, engine creation included).
  std::string checked_device{};
  bool device_check_passed = false;
  double device_check_seconds = 0;
  // cuda: each half of a layer around its attention launched as one CUDA graph per batch size
  // (ops.h, static segments; the same kernels in the same order, so the same bits).
  bool cuda_graphs = false;
  // cuda: prefetch gathers from mapped host memory by the copy engines (one batch of merged
  // runs) instead of the gather kernel, leaving the SMs to compute; urgent ones keep the kernel.
  bool cuda_copy_engine_prefetch = false;
  SparseOptions sparse{};     // used when mode != kFull
  // The type KV is kept in (docs/decisions/0049-kv-storage-type.md): f32, or f16.
  KvDtype kv_dtype = KvDtype::kF32;
  kvpool::LinkModel link{};   // the simulated store↔device link (infinite by default)
  // Where offloaded chunks live (sparse modes): "inproc://" (default) or "shm://HOST:PORT"
  // (a dd-kv-pool on this host, authenticated with kv_store_token).
  std::string kv_store = "inproc://";
  std::string kv_store_token{};
  // Set for a pool found in a registry: where it is now, asked again when it is lost.
  kvpool::PoolLocate kv_store_locate{};
  // Prefix reuse (a pool store): prompts are keyed in blocks of this many tokens
  // (docs/prefix-keys.md); a prompt starting with a committed prefix restores it from the pool
  // instead of prefilling it. Sparse modes also commit their own blocks afterwards; `full`
  // only restores (its prefill offloads nothing: a prefix some sparse engine committed,
  // whose KV equals full's bit for bit). 0 = off.
  int64_t prefix_block_tokens = 0;
  // The in-process store's prefix cache (kv_store inproc://): committed prefixes kept after
  // their requests end, least recently used evicted past this many bytes. A pool's cache is
  // bounded by its tenant quota instead.
  int64_t prefix_cache_bytes = int64_t{1} << 30;
  // One tenant's share of it: a tenant's releases evict only its own prefixes, past this share
  // (kvpool::NewInProcessKvStore). 0: all of it; -1 (auto): all of it unless the server sets
  // a share (ddctl serve: an equal one per API tenant).
  int64_t prefix_cache_tenant_bytes = -1;
  int threads = 0;            // 0 = all cores
  int64_t prefill_chunk = 512;
  // Device-memory budget in bytes (0 = unlimited): weights, workspace and every admitted
  // request's projected footprint (MemoryPlan) must fit, else admission is refused.
  int64_t device_memory_bytes = 0;
  model::Transformer::MatMulKind matmul = model::Transformer::MatMulKind::kInt8;
  // dualdecoder: the speculative row's LM head (spec_head.h). kFull: the whole vocabulary;
  // kContext: only the sequence's own tokens (cheaper where the head is compute bound); kAuto
  // (default): the context head where the LM head outweighs the layers (ResolveSpecHead).
  SpecHead spec_head = SpecHead::kAuto;
  // kContext: also score this many of the vocabulary's most frequent tokens (CommonTokens).
  int64_t spec_head_common = 0;
  // dualdecoder (predictors speculative and union): after a step whose speculative token
  // missed, the next speculative token is the context's continuation of the last two tokens,
  // else of the last one (TokenHistory), where there is one, instead of the row's output from
  // the wrong token.
  bool spec_resync = true;
  // dualdecoder: when a step's token is the one the last speculative row was fed, that row's
  // state through the layers before the first sparse one (SparseKvCache::carry_layers) is
  // this row's, bit for bit: the real row starts there and keeps the speculative row's KV of
  // those layers instead of computing them again (Gemma 3: 5 of 18 layers). Same results.
  bool spec_carry = true;
};

struct GenerateOptions {
  int64_t max_new_tokens = 128;
  SamplingParams sampling;
  bool stop_at_eos = true;
  std::vector<std::string> stop_strings;
  std::vector<int32_t> stop_ids;  // tokens that end the output (not part of it), like EOS
  // Called after each prefill chunk with (tokens done, prompt tokens); for progress output.
  std::function<void(int64_t, int64_t)> on_prefill_progress;
  // Predictor "oracle": the tokens this request will generate (from an earlier greedy run).
  std::vector<int32_t> oracle_tokens;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (without the prompt)
  std::string text;
  std::string stop_reason;      // "eos", "stop_string", "max_tokens", "context_full"
  int64_t prompt_tokens = 0;
  int64_t prefix_reused_tokens = 0;  // prompt tokens restored from the pool, not prefilled
  double ttft_s = 0;            // prompt in → first token out
  double decode_s = 0;          // time for the tokens after the first
};

class Engine {
 public:
  // Validates the options (sparse budget etc.: InvalidArgument naming the field), creates the
  // device, the forward pass and the KV (KvCache), and returns the engine, or the reason it
  // cannot run (a device that is not there, a store that cannot be opened). `model` must
  // outlive it.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const model::LoadedModel& model,
                                                        const EngineOptions& options);
  // The options as the engine runs them (Normalized).
  const EngineOptions& options() const { return options_; }
  // Changes the simulated link for transfers issued from now on (sparse modes).
  void SetLink(const kvpool::LinkModel& link) { kv_->SetLink(link); }
  // Benchmarks on synthetic weights: the chunks of the sparse modes' steps follow `m` from the
  // next step on (SparseOptions::selection_model); nothing in full mode.
  void SetSelectionModel(const SelectionModel& m) {
    options_.sparse.selection_model = m;
    kv_->SetSelectionModel(m);
  }
  // Compute threads used from now on (1..options' threads; <= 0: all). Same results with any
  // count (ThreadPool::SetActive); the benchmarks prefill with all and decode with one fewer.
  void SetComputeThreads(int n) { pool_.SetActive(n); }
  // The speculative row's head as the engine runs it (kAuto resolved).
  SpecHead spec_head() const { return options_.spec_head; }
  // The speculative row's landmark candidates (× the budget, 0 = every chunk) as the engine
  // runs them (SparseOptions::kAutoSpecCandidates resolved by the head).
  int64_t spec_candidates() const { return options_.sparse.spec_candidates; }
  // dualdecoder: speculative tokens replaced by the context's continuation after a miss
  // (EngineOptions::spec_resync), since construction.
  int64_t spec_resyncs() const { return dual_ != nullptr ? dual_->resyncs() : 0; }
  // dualdecoder: real rows that started from their speculative row's carried state
  // (EngineOptions::spec_carry), since construction.
  int64_t carried_rows() const { return dual_ != nullptr ? dual_->carried_rows() : 0; }
  // Time the compute thread spent waiting for KV transfers.
  int64_t transfer_wait_ns() const { return kv_->transfer_wait_ns(); }
  // The KV: its selection and transfer statistics (KvCache::total_stats and the others).
  const KvCache& kv() const { return *kv_; }
  // Prompt tokens restored from committed prefixes instead of prefilled, since construction.
  int64_t prefix_reused_tokens() const { return kv_->prefix_reused_tokens(); }

  const model::ModelConfig& config() const { return model_.config; }
  const model::LoadedModel& model() const { return model_; }
  absl::string_view device_name() const { return device_->name(); }
  // The compute device: its allocator holds the weights, the workspace and (full mode) the KV.
  const backend::Device& device() const { return *device_; }
  // KV values an f16 cache saturated at ±65504 (Ops::KvOverflows).
  // Read without waiting (a metric): safe from another thread.
  int64_t kv_saturated_values() const { return device_->ops().KvOverflows(); }
  const model::Tokenizer& tokenizer() const { return *model_.tokenizer; }

  // Checks a prompt before any work: non-empty, ids in the vocabulary, shorter than the
  // model's context. The error names the limit.
  absl::Status ValidatePrompt(absl::Span<const int32_t> prompt) const;

  // Prefills `prompt` into slot `seq` (which must be empty) and returns the last row's logits.
  absl::StatusOr<std::vector<float>> Prefill(int32_t seq, absl::Span<const int32_t> prompt);
  // Prefills several prompts in shared forward passes (up to prefill_chunk tokens per pass,
  // spread over the prompts in order) and returns each prompt's last-row logits. Results are
  // bit-identical to prefilling each prompt alone (batch-invariant kernels).
  absl::StatusOr<std::vector<std::vector<float>>> PrefillBatch(absl::Span<const int32_t> seqs,
                                                              absl::Span<const std::vector<int32_t>> prompts);
  // Chunked prefill for continuous batching. StartPrefill checks `prompt` for admitted, empty
  // slot `seq`, restores a committed prefix (prefix reuse) and returns how many prompt tokens
  // are already in the cache. PrefillParts then runs prompt pieces of several slots in one
  // forward pass (each piece must start where its slot's cache ends); for each piece that ends
  // its prompt, (*last_logits)[i] gets the last row's logits (empty otherwise) and the prompt's
  // blocks are committed for reuse. Same logits as Prefill, however the pieces are cut.
  // `prefix_salt` scopes the slot's prefix reuse (kvpool::TenantSalt of the request's tenant):
  // it restores and commits only prefixes under the same salt.
  absl::StatusOr<int64_t> StartPrefill(int32_t seq, absl::Span<const int32_t> prompt, uint64_t prefix_salt = 0);
  struct PrefillPiece {
    int32_t seq = 0;
    absl::Span<const int32_t> prompt{};
    int64_t begin = 0, end = 0;  // prompt positions [begin, end)
  };
  absl::Status PrefillParts(absl::Span<const PrefillPiece> pieces, std::vector<std::vector<float>>* last_logits);
  // Benchmarks at long contexts on synthetic weights, in StartPrefill's place: admitted, empty
  // slot `seq` gets random KV for prompt positions [0, upto) (RandomKv: unit RMS, every layer,
  // landmarks and store blocks as a prefill leaves them) instead of computing it — a 128K-token
  // prefill of the 8B shape outlasts a benchmark — and a PrefillParts piece [upto, n) then
  // finishes the prompt. Only timings mean anything after it: the KV is no prompt's. Not with
  // prefix reuse (nothing to commit).
  absl::Status PrefillSynthetic(int32_t seq, absl::Span<const int32_t> prompt, int64_t upto, uint64_t seed);
  // One batched decode step: token[i] is appended to seqs[i]; logits gets n_vocab per seq.
  absl::Status DecodeStep(absl::Span<const int32_t> seqs, absl::Span<const int32_t> tokens,
                          std::vector<float>* logits);
  // Reserves device memory for a request in slot `seq` with `prompt_tokens` that may grow to
  // `total_tokens`. RESOURCE_EXHAUSTED (with the numbers) when it does not fit next to the
  // requests already admitted; the message says so when it would not fit even alone. A slot
  // prefilled without Admit is admitted for the model's whole context.
  absl::Status Admit(int32_t seq, int64_t prompt_tokens, int64_t total_tokens);
  // Frees the slot's KV and its reservation.
  void Release(int32_t seq);
  // After a step failed with UNAVAILABLE because the KV pool was lost: reconnects the store
  // (KvStore::Recover). Release every sequence first; the scheduler rebuilds them (the prompt
  // prefilled, in sparse modes the generated tokens replayed as decode steps).
  // The device forgets the store's mapped memory first: Recover unmaps it, and a new mapping
  // may come back at the same address.
  absl::Status RecoverKvStore() { return kv_->RecoverStore(); }
  const MemoryPlan& memory_plan() const { return plan_; }
  // The store bytes a request may be charged (MemoryPlan::StoreChunks with this engine's prefix
  // reuse, as the store reserves them), and the store's bound for this worker (its pool
  // tenant's quota; 0: none known).
  int64_t StoreBytes(int64_t prompt_tokens, int64_t total_tokens) const {
    return kv_->StoreBytes(plan_.StoreChunks(prompt_tokens, total_tokens, kv_->prefix_reuse()));
  }
  int64_t store_capacity_bytes() const { return kv_->store_capacity_bytes(); }
  // Whether a request of `prompt_tokens` growing to `total_tokens` fits the device-memory budget
  // with nothing else admitted (RESOURCE_EXHAUSTED with the numbers if not). Reads only what
  // is fixed at construction, so any thread may call it.
  absl::Status FitsAlone(int64_t prompt_tokens, int64_t total_tokens) const;
  int64_t device_memory_bytes() const { return options_.device_memory_bytes; }
  // Budget minus weights, workspace and reservations; -1 when the budget is unlimited.
  int64_t free_device_bytes() const;
  // Bytes reserved by admitted requests (steady state, plus prefill while prefilling).
  int64_t reserved_bytes() const;
  int64_t admitted() const;
  // Predictor "oracle": the token at position first_pos + i is tokens[i].
  void SetOracle(int32_t seq, int64_t first_pos, std::vector<int32_t> tokens);
  // Starts slot `dst` as a copy of slot `src` (same prompt prefix, independent continuation);
  // `dst` is admitted like `src`.
  absl::Status Fork(int32_t src, int32_t dst);
  int64_t Length(int32_t seq) const { return kv_->Length(seq); }
  int64_t kv_bytes() const { return kv_->device_bytes(); }

  // Logits at `positions` (all if empty) of a causal prefill of `tokens` in slot `seq`.
  absl::StatusOr<std::vector<float>> PromptLogits(
      int32_t seq, absl::Span<const int32_t> tokens, absl::Span<const int64_t> positions,
      const std::function<void(int64_t, int64_t)>& on_progress = nullptr);

  // Single-request generation; on_text receives UTF-8-complete text as it is produced.
  absl::StatusOr<GenerateResult> Generate(absl::Span<const int32_t> prompt, const GenerateOptions& options,
                                          const std::function<void(absl::string_view)>& on_text);

 private:
  Engine(const model::LoadedModel& model, const EngineOptions& normalized);
  // The options as the engine runs them, resolved once: the fetch strategy by mode, the
  // speculative head and shortlist, the prefill pass, the sliding layers' offload for prefix
  // reuse.
  static EngineOptions Normalized(EngineOptions o, const model::ModelConfig& config);
  const model::LoadedModel& model_;
  EngineOptions options_;
  ThreadPool pool_;
  std::unique_ptr<backend::Device> device_;  // cpu: the ops run on pool_
  std::unique_ptr<model::Transformer> transformer_;
  std::unique_ptr<KvCache> kv_;  // every mode's KV, the store and prefix reuse (kv_cache.h)
  // dualdecoder: the dual-token protocol (chain, resync, carry, demux); null in other modes.
  std::unique_ptr<DualTokenStep> dual_;
  // Forgets slot `seq`'s speculative chain: the slot starts a new sequence.
  void ClearSpec(int32_t seq) {
    if (dual_ != nullptr) dual_->Clear(seq);
  }
  struct Reservation {
    bool active = false;
    bool prefilling = false;  // holds its prompt densely until its first decode step
    int64_t prompt = 0, total = 0;
    RequestBytes bytes;
  };
  absl::Status EnsureAdmitted(int32_t seq, int64_t prompt_tokens);
  MemoryPlan plan_;
  std::vector<Reservation> reservations_;  // per slot
  // KvCache::RestorePrefix, with the restored tokens noted for the speculative heads.
  int64_t RestorePrefix(int32_t seq, absl::Span<const int32_t> tokens, int64_t limit);
  // One forward pass over prompt pieces (shared by PrefillBatch and PrefillParts): the last
  // row's logits of each piece that ends its prompt, whose blocks are committed for reuse if
  // `commit_prefix`.
  absl::Status ForwardPieces(absl::Span<const PrefillPiece> pieces, bool commit_prefix,
                             std::vector<std::vector<float>>* last_logits);
  // Adds tokens the slot has consumed to what the speculative heads look in (dualdecoder).
  void NoteTokens(int32_t seq, absl::Span<const int32_t> tokens) {
    if (dual_ != nullptr) dual_->Note(seq, tokens);
  }
};

}  // namespace dd::engine
