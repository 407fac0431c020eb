#include "decode-worker/engine/engine.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dd/backend/registry.h"
#include "glog/logging.h"

namespace dd::engine {

using model::BatchRow;

EngineOptions Engine::Normalized(EngineOptions o, const model::ModelConfig& config) {
  // The fetch strategy by mode (fetch_policy.h): `sparse` gathers every selection on demand;
  // sparse-cached and dualdecoder keep a resident set (dualdecoder prefetches into it).
  const bool resident = o.mode == DecodeMode::kSparseCached || o.mode == DecodeMode::kDualDecoder;
  o.sparse.fetch = resident ? KvFetch::kResident : KvFetch::kOnDemand;
  o.spec_head = ResolveSpecHead(o.spec_head, config);
  // The speculative shortlist by head: the full head's query ranks chunks as the real row's
  // did, the context head's does not (docs/decisions/0009-speculative-row-cost.md).
  o.sparse.spec_candidates = o.sparse.SpecCandidatesFor(o.spec_head == SpecHead::kFull);
  if (o.prefill_chunk <= 0) o.prefill_chunk = 512;
  return o;
}

Engine::Engine(const model::LoadedModel& model, const EngineOptions& normalized)
    : model_(model),
      options_(normalized),
      pool_(normalized.threads),
      plan_(model, normalized.mode, normalized.sparse, normalized.prefill_chunk, normalized.kv_dtype) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const model::LoadedModel& model, const EngineOptions& options) {
  if (options.device_memory_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_memory must be >= 0 bytes (0 = unlimited), got ", options.device_memory_bytes));
  }
  if (options.mode == DecodeMode::kFull && options.sparse.key_reconstruction.enabled()) {
    return absl::InvalidArgumentError("key reconstruction needs a sparse mode (sparse, sparse-cached, dualdecoder): "
                                      "full attention fetches nothing");
  }
  std::unique_ptr<Engine> e(new Engine(model, Normalized(options, model.config)));
  const EngineOptions& o = e->options_;
  // Memory is accounted by MemoryPlan (docs/architecture.md, "The compute-backend seam"), so the
  // device is created without a budget.
  ASSIGN_OR_RETURN(e->device_, backend::CreateDevice(o.device, {.budget_bytes = 0,
                                                                .pool = &e->pool_,
                                                                .cuda_graphs = o.cuda_graphs,
                                                                .cuda_copy_engine_prefetch = o.cuda_copy_engine_prefetch}));
  ASSIGN_OR_RETURN(e->transformer_, model::Transformer::Create(model, *e->device_, o.matmul, o.prefill_chunk));
  if (o.mode == DecodeMode::kDualDecoder) {
    e->dual_ = std::make_unique<DualTokenStep>(model, DualTokenStep::Options{.predictor = o.sparse.predictor,
                                                                             .head = o.spec_head,
                                                                             .head_common = o.spec_head_common,
                                                                             .resync = o.spec_resync,
                                                                             .carry = o.spec_carry});
    RETURN_IF_ERROR(e->dual_->Attach(*e->device_));
    e->plan_.AddSharedWorkspace(e->dual_->device_bytes());
  }
  if (o.device_memory_bytes > 0) {
    const RequestBytes one = e->plan_.Request(1, 1);
    const int64_t need = e->plan_.weight_bytes() + e->plan_.shared_workspace_bytes() + one.steady();
    if (need > o.device_memory_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_memory of ", MiB(o.device_memory_bytes), " is too small for even one request in ",
          DecodeModeName(o.mode), " mode: the smallest needs ", MiB(need), " (", e->plan_.Describe(one), ")"));
    }
  }
  ASSIGN_OR_RETURN(e->kv_, KvCache::Create(model.config,
                                           {.mode = o.mode,
                                            .sparse = o.sparse,
                                            .link = o.link,
                                            .kv_store = o.kv_store,
                                            .kv_store_token = o.kv_store_token,
                                            .kv_store_locate = o.kv_store_locate,
                                            .prefix_block_tokens = o.prefix_block_tokens,
                                            .prefix_cache_bytes = o.prefix_cache_bytes,
                                            .prefix_cache_tenant_bytes = o.prefix_cache_tenant_bytes,
                                            .model_fingerprint = o.prefix_block_tokens > 0 ? ModelFingerprint(model) : 0,
                                            .kv_dtype = o.kv_dtype},
                                           *e->device_));
  return e;
}

absl::Status Engine::Admit(int32_t seq, int64_t prompt_tokens, int64_t total_tokens) {
  if (seq < 0) return absl::InvalidArgumentError(absl::StrCat("slot ", seq, " is negative"));
  if (prompt_tokens <= 0 || total_tokens < prompt_tokens || total_tokens > model_.config.n_ctx_train) {
    return absl::InvalidArgumentError(absl::StrCat("request of ", prompt_tokens, " prompt tokens growing to ", total_tokens,
                                                   ": need 0 < prompt <= total <= the model context (",
                                                   model_.config.n_ctx_train, ")"));
  }
  if (seq >= static_cast<int32_t>(reservations_.size())) reservations_.resize(seq + 1);
  if (reservations_[seq].active) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is already admitted"));
  Reservation r{.active = true, .prefilling = true, .prompt = prompt_tokens, .total = total_tokens,
                .bytes = plan_.Request(prompt_tokens, total_tokens)};
  const int64_t budget = options_.device_memory_bytes;
  if (budget > 0) {
    RETURN_IF_ERROR(FitsAlone(prompt_tokens, total_tokens));
    const int64_t fixed = plan_.weight_bytes() + plan_.shared_workspace_bytes();
    const int64_t need = r.bytes.steady() + r.bytes.prefill_extra;
    const int64_t in_use = reserved_bytes();
    if (fixed + in_use + need > budget) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "device memory full: ", admitted(), " requests hold ", MiB(in_use), ", this one needs ", MiB(need),
          ", weights and workspace ", MiB(fixed), ", budget ", MiB(budget)));
    }
  }
  // The forward workspace for a decode step of every admitted request (two rows each in
  // dualdecoder), grown now rather than in the step.
  const int64_t rows_per_request = options_.mode == DecodeMode::kDualDecoder ? 2 : 1;
  RETURN_IF_ERROR(transformer_->ReserveRows((admitted() + 1) * rows_per_request));
  RETURN_IF_ERROR(kv_->Reserve(seq, prompt_tokens, total_tokens, options_.prefill_chunk));
  reservations_[seq] = r;
  return absl::OkStatus();
}

absl::Status Engine::FitsAlone(int64_t prompt_tokens, int64_t total_tokens) const {
  const int64_t budget = options_.device_memory_bytes;
  if (budget <= 0) return absl::OkStatus();
  const RequestBytes r = plan_.Request(prompt_tokens, total_tokens);
  const int64_t need = plan_.weight_bytes() + plan_.shared_workspace_bytes() + r.steady() + r.prefill_extra;
  if (need <= budget) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "device_memory of ", MiB(budget), " cannot hold even one request of ", total_tokens, " tokens in ",
      DecodeModeName(options_.mode), " mode: it needs ", MiB(need), " (", plan_.Describe(r), ")"));
}

int64_t Engine::free_device_bytes() const {
  if (options_.device_memory_bytes <= 0) return -1;
  return std::max<int64_t>(0, options_.device_memory_bytes - plan_.weight_bytes() - plan_.shared_workspace_bytes() -
                                  reserved_bytes());
}

absl::Status Engine::EnsureAdmitted(int32_t seq, int64_t prompt_tokens) {
  if (seq >= 0 && seq < static_cast<int32_t>(reservations_.size()) && reservations_[seq].active) {
    if (prompt_tokens > reservations_[seq].total) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", seq, " was admitted for ", reservations_[seq].total,
                                                     " tokens, the prompt has ", prompt_tokens));
    }
    return absl::OkStatus();
  }
  return Admit(seq, prompt_tokens, model_.config.n_ctx_train);
}

void Engine::SetOracle(int32_t seq, int64_t first_pos, std::vector<int32_t> tokens) {
  if (dual_ != nullptr) dual_->SetOracle(seq, first_pos, std::move(tokens));
}

void Engine::Release(int32_t seq) {
  kv_->Release(seq);  // a committed prefix stays with the store
  if (dual_ != nullptr) dual_->Release(seq);
  if (seq >= 0 && seq < static_cast<int32_t>(reservations_.size())) reservations_[seq] = Reservation();
}

int64_t Engine::reserved_bytes() const {
  int64_t total = 0;
  for (const Reservation& r : reservations_) {
    if (r.active) total += r.bytes.steady() + (r.prefilling ? r.bytes.prefill_extra : 0);
  }
  return total;
}

int64_t Engine::admitted() const {
  int64_t n = 0;
  for (const Reservation& r : reservations_) n += r.active ? 1 : 0;
  return n;
}

absl::Status Engine::Fork(int32_t src, int32_t dst) {
  if (src == dst) return absl::OkStatus();
  if (src < 0 || src >= static_cast<int32_t>(reservations_.size()) || !reservations_[src].active) {
    return absl::FailedPreconditionError(absl::StrCat("fork: slot ", src, " holds no request"));
  }
  Release(dst);
  const Reservation from = reservations_[src];
  RETURN_IF_ERROR(Admit(dst, from.prompt, from.total));
  reservations_[dst].prefilling = from.prefilling;
  if (absl::Status st = kv_->Copy(src, dst); !st.ok()) {
    Release(dst);
    return st;
  }
  if (dual_ != nullptr) dual_->Fork(src, dst);
  return absl::OkStatus();
}

absl::StatusOr<DecodeMode> ParseDecodeMode(absl::string_view name) {
  if (name == "full") return DecodeMode::kFull;
  if (name == "sparse") return DecodeMode::kSparse;
  if (name == "sparse-cached") return DecodeMode::kSparseCached;
  if (name == "dualdecoder") return DecodeMode::kDualDecoder;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown decode mode '", name, "' (full, sparse, sparse-cached, dualdecoder)"));
}

absl::string_view DecodeModeName(DecodeMode mode) {
  switch (mode) {
    case DecodeMode::kFull: return "full";
    case DecodeMode::kSparse: return "sparse";
    case DecodeMode::kSparseCached: return "sparse-cached";
    case DecodeMode::kDualDecoder: return "dualdecoder";
  }
  return "unknown";
}

absl::Status Engine::ValidatePrompt(absl::Span<const int32_t> prompt) const {
  const auto& c = model_.config;
  if (prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  if (static_cast<int64_t>(prompt.size()) >= c.n_ctx_train) {
    return absl::InvalidArgumentError(absl::StrCat("prompt has ", prompt.size(), " tokens but the model's context is ",
                                                   c.n_ctx_train, " tokens (at least one must be left to generate)"));
  }
  for (int32_t t : prompt) {
    if (t < 0 || t >= c.n_vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", t, " outside the vocabulary [0, ", c.n_vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Engine::Prefill(int32_t seq, absl::Span<const int32_t> prompt) {
  int64_t last = static_cast<int64_t>(prompt.size()) - 1;
  return PromptLogits(seq, prompt, absl::MakeConstSpan(&last, 1));
}

absl::StatusOr<std::vector<float>> Engine::PromptLogits(
    int32_t seq, absl::Span<const int32_t> tokens, absl::Span<const int64_t> positions,
    const std::function<void(int64_t, int64_t)>& on_progress) {
  RETURN_IF_ERROR(ValidatePrompt(tokens));
  if (kv_->Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  ClearSpec(seq);
  const int64_t n = static_cast<int64_t>(tokens.size());
  RETURN_IF_ERROR(EnsureAdmitted(seq, n));
  std::vector<bool> want(n, positions.empty());
  for (int64_t p : positions) {
    if (p < 0 || p >= n) return absl::InvalidArgumentError(absl::StrCat("position ", p, " outside the prompt [0, ", n, ")"));
    want[p] = true;
  }
  // Prefix reuse covers blocks before the first position whose logits are wanted.
  int64_t start = 0;
  if (kv_->prefix_reuse() && !positions.empty()) {
    start = RestorePrefix(seq, tokens, std::min(*std::min_element(positions.begin(), positions.end()), n - 1));
  }
  std::vector<float> out, chunk_logits;
  std::vector<BatchRow> rows;
  for (int64_t b = start; b < n; b += options_.prefill_chunk) {
    const int64_t e = std::min(n, b + options_.prefill_chunk);
    rows.clear();
    for (int64_t i = b; i < e; ++i) rows.push_back({.seq = seq, .pos = i, .token = tokens[i], .want_logits = static_cast<bool>(want[i]), .prefill = true});
    NoteTokens(seq, tokens.subspan(b, e - b));
    absl::Status st = transformer_->Forward(rows, *kv_, &chunk_logits);
    if (st.ok()) st = kv_->AfterPrefill(seq, b, e);
    if (!st.ok()) {
      Release(seq);
      return st;
    }
    out.insert(out.end(), chunk_logits.begin(), chunk_logits.end());
    if (on_progress) on_progress(e, n);
  }
  kv_->CommitPrefix(seq, tokens.first(n - 1));
  // Positions may be given in any order; return rows in the order asked.
  if (!positions.empty()) {
    std::vector<int64_t> sorted(positions.begin(), positions.end());
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    const int64_t V = model_.config.n_vocab;
    std::vector<float> ordered(positions.size() * V);
    for (size_t i = 0; i < positions.size(); ++i) {
      const int64_t idx = std::lower_bound(sorted.begin(), sorted.end(), positions[i]) - sorted.begin();
      std::copy(out.begin() + idx * V, out.begin() + (idx + 1) * V, ordered.begin() + i * V);
    }
    return ordered;
  }
  return out;
}

int64_t Engine::RestorePrefix(int32_t seq, absl::Span<const int32_t> tokens, int64_t limit) {
  const int64_t restored = kv_->RestorePrefix(seq, tokens, limit);
  NoteTokens(seq, tokens.first(restored));
  return restored;
}

absl::StatusOr<std::vector<std::vector<float>>> Engine::PrefillBatch(
    absl::Span<const int32_t> seqs, absl::Span<const std::vector<int32_t>> prompts) {
  if (seqs.size() != prompts.size()) return absl::InvalidArgumentError("seqs and prompts differ in length");
  for (size_t i = 0; i < seqs.size(); ++i) {
    RETURN_IF_ERROR(Annotate(ValidatePrompt(prompts[i]), absl::StrCat("prompt ", i)));
    if (kv_->Length(seqs[i]) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seqs[i], " is not empty"));
    ClearSpec(seqs[i]);
    for (size_t j = 0; j < i; ++j) {
      if (seqs[j] == seqs[i]) return absl::InvalidArgumentError(absl::StrCat("slot ", seqs[i], " given twice"));
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (absl::Status st = EnsureAdmitted(seqs[i], static_cast<int64_t>(prompts[i].size())); !st.ok()) {
      for (size_t j = 0; j < i; ++j) Release(seqs[j]);
      return Annotate(st, absl::StrCat("prompt ", i));
    }
  }
  // Passes of up to prefill_chunk tokens, spread over the prompts in order.
  std::vector<std::vector<float>> out(seqs.size()), last;
  std::vector<int64_t> done(seqs.size(), 0);
  std::vector<PrefillPiece> pieces;
  std::vector<size_t> owner;  // which prompt each piece belongs to
  for (;;) {
    pieces.clear();
    owner.clear();
    int64_t budget = options_.prefill_chunk;
    for (size_t i = 0; i < seqs.size() && budget > 0; ++i) {
      const int64_t n = static_cast<int64_t>(prompts[i].size());
      const int64_t take = std::min(budget, n - done[i]);
      if (take <= 0) continue;
      pieces.push_back({.seq = seqs[i], .prompt = prompts[i], .begin = done[i], .end = done[i] + take});
      owner.push_back(i);
      done[i] += take;
      budget -= take;
    }
    if (pieces.empty()) break;
    if (absl::Status st = ForwardPieces(pieces, /*commit_prefix=*/false, &last); !st.ok()) {
      for (int32_t s : seqs) Release(s);
      return st;
    }
    for (size_t j = 0; j < pieces.size(); ++j) {
      if (!last[j].empty()) out[owner[j]] = std::move(last[j]);
    }
  }
  return out;
}

absl::StatusOr<int64_t> Engine::StartPrefill(int32_t seq, absl::Span<const int32_t> prompt, uint64_t prefix_salt) {
  RETURN_IF_ERROR(ValidatePrompt(prompt));
  if (seq < 0 || seq >= static_cast<int32_t>(reservations_.size()) || !reservations_[seq].active) {
    return absl::FailedPreconditionError(absl::StrCat("prefill: slot ", seq, " is not admitted"));
  }
  if (kv_->Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  RETURN_IF_ERROR(EnsureAdmitted(seq, static_cast<int64_t>(prompt.size())));
  ClearSpec(seq);
  kv_->SetPrefixSalt(seq, prefix_salt);
  RETURN_IF_ERROR(kv_->Open(seq));
  return RestorePrefix(seq, prompt, static_cast<int64_t>(prompt.size()) - 1);
}

absl::Status Engine::PrefillSynthetic(int32_t seq, absl::Span<const int32_t> prompt, int64_t upto, uint64_t seed) {
  RETURN_IF_ERROR(ValidatePrompt(prompt));
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (upto <= 0 || upto >= n) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic prefill of ", upto, " positions of a ", n,
                                                   "-token prompt: want 1 to ", n - 1, " (the last is prefilled)"));
  }
  if (kv_->prefix_reuse()) {
    return absl::FailedPreconditionError("synthetic prefill: random KV is no prompt's, so not with prefix reuse");
  }
  if (seq < 0 || seq >= static_cast<int32_t>(reservations_.size()) || !reservations_[seq].active) {
    return absl::FailedPreconditionError(absl::StrCat("synthetic prefill: slot ", seq, " is not admitted"));
  }
  if (kv_->Length(seq) != 0) return absl::FailedPreconditionError(absl::StrCat("slot ", seq, " is not empty"));
  RETURN_IF_ERROR(EnsureAdmitted(seq, n));
  ClearSpec(seq);
  absl::Status st = kv_->Open(seq);
  if (st.ok()) st = kv_->FillRandom(seq, upto, seed);
  if (!st.ok()) {
    Release(seq);  // nothing half-filled stays admitted
    return st;
  }
  NoteTokens(seq, prompt.first(upto));
  return absl::OkStatus();
}

absl::Status Engine::PrefillParts(absl::Span<const PrefillPiece> pieces,
                                  std::vector<std::vector<float>>* last_logits) {
  return ForwardPieces(pieces, /*commit_prefix=*/true, last_logits);
}

absl::Status Engine::ForwardPieces(absl::Span<const PrefillPiece> pieces, bool commit_prefix,
                                   std::vector<std::vector<float>>* last_logits) {
  std::vector<BatchRow> rows;
  std::vector<size_t> owner;  // which piece each logits row belongs to
  for (size_t i = 0; i < pieces.size(); ++i) {
    const PrefillPiece& p = pieces[i];
    const int64_t n = static_cast<int64_t>(p.prompt.size());
    if (p.begin < 0 || p.begin >= p.end || p.end > n || kv_->Length(p.seq) != p.begin) {
      return absl::InvalidArgumentError(absl::StrCat("prefill piece [", p.begin, ", ", p.end, ") of a ", n,
                                                     "-token prompt does not continue slot ", p.seq, " (",
                                                     kv_->Length(p.seq), " tokens cached)"));
    }
    for (int64_t pos = p.begin; pos < p.end; ++pos) rows.push_back({.seq = p.seq, .pos = pos, .token = p.prompt[pos], .want_logits = pos == n - 1, .prefill = true});
    NoteTokens(p.seq, p.prompt.subspan(p.begin, p.end - p.begin));
    if (p.end == n) owner.push_back(i);
  }
  std::vector<float> logits;
  RETURN_IF_ERROR(transformer_->Forward(rows, *kv_, &logits));
  if (commit_prefix) {
    for (const PrefillPiece& p : pieces) RETURN_IF_ERROR(kv_->AfterPrefill(p.seq, p.begin, p.end));
  }
  const int64_t V = model_.config.n_vocab;
  last_logits->assign(pieces.size(), {});
  for (size_t j = 0; j < owner.size(); ++j) {
    (*last_logits)[owner[j]].assign(logits.begin() + j * V, logits.begin() + (j + 1) * V);
    const PrefillPiece& p = pieces[owner[j]];
    if (commit_prefix) kv_->CommitPrefix(p.seq, p.prompt.first(p.prompt.size() - 1));
  }
  return absl::OkStatus();
}

absl::Status Engine::DecodeStep(absl::Span<const int32_t> seqs, absl::Span<const int32_t> tokens,
                                std::vector<float>* logits) {
  if (seqs.size() != tokens.size()) return absl::InvalidArgumentError("seqs and tokens differ in length");
  std::vector<BatchRow> rows;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i] < 0 || seqs[i] >= static_cast<int32_t>(reservations_.size()) || !reservations_[seqs[i]].active) {
      return absl::FailedPreconditionError(absl::StrCat("decode: slot ", seqs[i], " holds no request"));
    }
    // Checked here as well as in the forward pass: before any speculative state changes.
    if (tokens[i] < 0 || tokens[i] >= model_.config.n_vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", tokens[i], " outside the vocabulary [0, ",
                                                     model_.config.n_vocab, ")"));
    }
    const int64_t pos = kv_->Length(seqs[i]);
    if (pos >= model_.config.n_ctx_train) {
      return absl::OutOfRangeError(absl::StrCat("sequence ", seqs[i], " reached the model context of ",
                                                model_.config.n_ctx_train, " tokens"));
    }
    if (pos >= reservations_[seqs[i]].total) {
      return absl::OutOfRangeError(absl::StrCat("sequence ", seqs[i], " reached the ", reservations_[seqs[i]].total,
                                                " tokens it was admitted for"));
    }
    rows.push_back({seqs[i], pos, tokens[i], true});
  }
  for (int32_t s : seqs) {  // decode drops the dense prompt
    if (reservations_[s].prefilling) RETURN_IF_ERROR(kv_->FinishPrefill(s));
    reservations_[s].prefilling = false;
  }
  if (dual_ == nullptr) return transformer_->Forward(rows, *kv_, logits);
  return dual_->Step(rows, *transformer_, *kv_, logits);
}

absl::StatusOr<GenerateResult> Engine::Generate(absl::Span<const int32_t> prompt, const GenerateOptions& options,
                                                const std::function<void(absl::string_view)>& on_text) {
  RETURN_IF_ERROR(options.sampling.Validate());
  if (options.max_new_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens must be > 0, got ", options.max_new_tokens));
  }
  RETURN_IF_ERROR(ValidatePrompt(prompt));
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  constexpr int32_t kSeq = 0;
  Release(kSeq);
  const int64_t total = std::min<int64_t>(model_.config.n_ctx_train,
                                          static_cast<int64_t>(prompt.size()) + options.max_new_tokens);
  RETURN_IF_ERROR(Admit(kSeq, static_cast<int64_t>(prompt.size()), total));
  if (!options.oracle_tokens.empty()) SetOracle(kSeq, static_cast<int64_t>(prompt.size()), options.oracle_tokens);
  GenerateResult res;
  res.prompt_tokens = static_cast<int64_t>(prompt.size());
  int64_t last = static_cast<int64_t>(prompt.size()) - 1;
  const int64_t reused_before = kv_->prefix_reused_tokens();
  ASSIGN_OR_RETURN(std::vector<float> logits,
                   PromptLogits(kSeq, prompt, absl::MakeConstSpan(&last, 1), options.on_prefill_progress));
  res.prefix_reused_tokens = kv_->prefix_reused_tokens() - reused_before;
  Sampler sampler(options.sampling);
  sampler.SetPrompt(prompt);
  TextStream out(*model_.tokenizer, options.stop_strings, options.stop_ids, options.stop_at_eos);
  Clock::time_point t_first;
  res.stop_reason = "max_tokens";
  for (int64_t i = 0; i < options.max_new_tokens; ++i) {
    const int32_t next = sampler.Sample(logits.data(), model_.config.n_vocab);
    if (i == 0) t_first = Clock::now();
    if (std::string stop = out.Push(next); !stop.empty()) {
      res.stop_reason = std::move(stop);
      break;
    }
    if (std::string delta = out.Delta(); !delta.empty() && on_text) on_text(delta);
    if (i + 1 == options.max_new_tokens) break;
    if (kv_->Length(kSeq) >= model_.config.n_ctx_train) {
      res.stop_reason = "context_full";
      break;
    }
    RETURN_IF_ERROR(DecodeStep(absl::MakeConstSpan(&kSeq, 1), absl::MakeConstSpan(&next, 1), &logits));
  }
  out.Finish();
  if (std::string delta = out.Delta(); !delta.empty() && on_text) on_text(delta);
  res.tokens = out.tokens();
  res.text = out.text();
  const auto t_end = Clock::now();
  res.ttft_s = std::chrono::duration<double>(t_first - t0).count();
  res.decode_s = std::chrono::duration<double>(t_end - t_first).count();
  Release(kSeq);
  return res;
}

}  // namespace dd::engine
