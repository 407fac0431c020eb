#include "decode-worker/engine/memory_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "decode-worker/model/transformer.h"

namespace dd::engine {
namespace {

bool Sliding(const model::ModelConfig& c, int64_t l) {
  return c.sliding_window > 0 && l < static_cast<int64_t>(c.layer_is_swa.size()) && c.layer_is_swa[l];
}

// A global layer the sparse modes make sparse: every one, or the listed ones (--sparse_layers).
bool SparseLayer(const model::ModelConfig& c, const SparseOptions& o, int64_t l) {
  return !Sliding(c, l) && (o.sparse_layers.none() || (l < SparseOptions::kMaxLayers && o.sparse_layers.test(l)));
}

int64_t ViewBytes(const kernels::WeightView& w) { return w.data ? w.rows * w.row_bytes : 0; }
int64_t VecBytes(const std::vector<float>& v) { return static_cast<int64_t>(v.size() * sizeof(float)); }

int64_t WeightBytes(const model::LoadedModel& m) {
  const model::ModelWeights& w = m.weights;
  int64_t total = ViewBytes(w.token_embd) + VecBytes(w.output_norm);
  if (w.output.data != w.token_embd.data) total += ViewBytes(w.output);
  for (const model::LayerWeights& l : w.layers) {
    for (const kernels::WeightView* v : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) total += ViewBytes(*v);
    for (const std::vector<float>* v : {&l.attn_norm, &l.ffn_norm, &l.post_attn_norm, &l.post_ffn_norm, &l.q_norm,
                                        &l.k_norm, &l.bq, &l.bk, &l.bv}) {
      total += VecBytes(*v);
    }
  }
  return total;
}

}  // namespace

MemoryPlan::MemoryPlan(const model::LoadedModel& model, DecodeMode mode, const SparseOptions& sparse,
                       int64_t prefill_chunk, KvDtype kv)
    : config_(model.config),
      mode_(mode),
      sparse_(sparse),
      prefill_chunk_(prefill_chunk),
      kv_(kv),
      weight_bytes_(WeightBytes(model)),
      // The forward workspace as the engine creates it: a prefill pass, the logits rows.
      shared_workspace_(model::Transformer::WorkspaceBytes(model.config, std::max<int64_t>(prefill_chunk, 1))) {
  // (Sparse modes: a request's urgent blocks and landmark scores are its own, in Request: every
  // sequence's blocks of a layer are read by one attention call, and every sequence's scores
  // come to the host together.)
}

KvBytes MemoryPlan::DecodeKv(int64_t length) const {
  const int64_t row = 2 * config_.n_head_kv * config_.head_dim * KvDtypeBytes(kv_);
  const int64_t C = sparse_.chunk_tokens;
  KvBytes b;
  int64_t sparse_layers = 0;
  for (int64_t l = 0; l < config_.n_layer; ++l) {
    if (Sliding(config_, l)) {
      b.kv += (config_.sliding_window + 1) * row;
    } else if (mode_ == DecodeMode::kFull || !SparseLayer(config_, sparse_, l)) {
      b.kv += length * row;
    } else {
      b.kv += std::min(length, sparse_.sink_tokens + sparse_.window_tokens + C) * row;
      b.landmarks += (length / C) * config_.n_head_kv * config_.head_dim * static_cast<int64_t>(sizeof(float));
      if (sparse_.key_reconstruction.MayReconstruct(l)) {
        const int64_t kv_dim = config_.n_head_kv * config_.head_dim, rank = sparse_.key_reconstruction.RankFor(kv_dim);
        b.low_rank += (rank * kv_dim + (length / C) * C * rank) * static_cast<int64_t>(sizeof(float));
      }
      ++sparse_layers;
    }
  }
  if (Resident()) b.resident = sparse_layers * (sparse_.budget_tokens + sparse_.resident_margin_tokens) * row;
  return b;
}

RequestBytes MemoryPlan::Request(int64_t prompt_tokens, int64_t total_tokens) const {
  const model::ModelConfig& c = config_;
  const int64_t rows = mode_ == DecodeMode::kDualDecoder ? 2 : 1;
  RequestBytes r;
  r.kv = DecodeKvBytes(total_tokens);
  // The forward workspace past the transformer's initial one (shared: a prefill pass and the
  // logits of kLogitRows rows) grows by at most this much a row.
  r.workspace = rows * model::Transformer::WorkspaceRowBytes(c);
  const int64_t row = 2 * c.n_head_kv * c.head_dim * KvDtypeBytes(kv_);
  if (mode_ != DecodeMode::kFull) r.workspace += ChunkSelector::ScoresBytes(c, sparse_, total_tokens);
  // A narrow KV type: the speculative row's own K and V rows, narrowed (SparseKvCache::Seq::own).
  if (mode_ != DecodeMode::kFull && kv_ != KvDtype::kF32) r.workspace += row;
  if (mode_ != DecodeMode::kFull && !Resident()) {
    // Without resident slots a layer's selected blocks land in a buffer of the request's own
    // until the batch's attention call has read them.
    r.workspace += sparse_.budget_tokens * row;
  }
  int64_t sliding_layers = 0;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    sliding_layers += Sliding(c, l) ? 1 : 0;
  }
  // Prefill rings: window - 1 + the rows of one pass, against window + 1 when decoding.
  r.prefill_extra = sliding_layers * std::max<int64_t>(0, std::min(prompt_tokens, prefill_chunk_) - 2) * row;
  if (mode_ != DecodeMode::kFull) {
    // Prefill keeps the whole prompt of every sparse layer on the device.
    const int64_t dense_now = std::min(prompt_tokens, sparse_.sink_tokens + sparse_.window_tokens + sparse_.chunk_tokens);
    int64_t sparse_layers = 0;
    for (int64_t l = 0; l < c.n_layer; ++l) sparse_layers += SparseLayer(c, sparse_, l) ? 1 : 0;
    r.prefill_extra += sparse_layers * (prompt_tokens - dense_now) * row;
  }
  return r;
}

int64_t MemoryPlan::StoreChunks(int64_t prompt_tokens, int64_t total_tokens, bool prefix_reuse) const {
  const int64_t C = sparse_.chunk_tokens;
  if (mode_ != DecodeMode::kFull) return total_tokens / C;
  return prefix_reuse && prompt_tokens >= C ? prompt_tokens / C : -1;
}

int64_t MemoryPlan::MaxBatch(int64_t budget, int64_t prompt_tokens, int64_t total_tokens) const {
  const RequestBytes r = Request(prompt_tokens, total_tokens);
  const int64_t room = budget - weight_bytes_ - shared_workspace_ - r.prefill_extra;
  return room < r.steady() ? 0 : room / r.steady();
}

std::string MemoryPlan::Describe(const RequestBytes& r) const {
  std::string s = absl::StrCat("weights ", MiB(weight_bytes_), " + workspace ", MiB(shared_workspace_ + r.workspace),
                               " + kv ", MiB(r.kv));
  if (r.prefill_extra > 0) absl::StrAppend(&s, " + prefill ", MiB(r.prefill_extra));
  return s;
}

}  // namespace dd::engine
