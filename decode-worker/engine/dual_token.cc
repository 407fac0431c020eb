#include "decode-worker/engine/dual_token.h"

#include <algorithm>

#include "common/status_macros.h"
#include "decode-worker/engine/sampler.h"
#include "glog/logging.h"

namespace dd::engine {

using model::BatchRow;

DualTokenStep::DualTokenStep(const model::LoadedModel& model, const Options& options)
    : model_(model), options_(options), shortlist_(model.config.n_vocab) {
  if (UsesShortlist() && options_.head_common > 0 && model.tokenizer != nullptr) {
    shortlist_.SetBase(CommonTokens(*model.tokenizer, options_.head_common));
  }
}

absl::Status DualTokenStep::Attach(backend::Device& device) {
  return UsesShortlist() ? shortlist_.Attach(device, model_.config.n_embd) : absl::OkStatus();
}

void DualTokenStep::Grow(int32_t seq) {
  if (seq >= static_cast<int32_t>(spec_.size())) spec_.resize(seq + 1, -1);
  if (seq >= static_cast<int32_t>(spec_in_.size())) spec_in_.resize(seq + 1, -1);
  if (seq >= static_cast<int32_t>(carry_pos_.size())) carry_pos_.resize(seq + 1, -1);
  if (seq >= static_cast<int32_t>(carry_x_.size())) carry_x_.resize(seq + 1);
}

void DualTokenStep::Note(int32_t seq, absl::Span<const int32_t> tokens) {
  if (UsesShortlist()) shortlist_.Note(seq, tokens);
  if (Resyncs()) history_.Note(seq, tokens);
}

void DualTokenStep::Clear(int32_t seq) {
  if (seq < 0) return;
  if (seq < static_cast<int32_t>(spec_.size())) spec_[seq] = -1;
  if (seq < static_cast<int32_t>(spec_in_.size())) spec_in_[seq] = -1;
  if (seq < static_cast<int32_t>(carry_pos_.size())) carry_pos_[seq] = -1;
  history_.Reset(seq);
}

void DualTokenStep::Release(int32_t seq) {
  Clear(seq);
  shortlist_.Reset(seq);
  if (seq >= 0 && seq < static_cast<int32_t>(oracle_.size())) oracle_[seq] = Oracle();
}

void DualTokenStep::Fork(int32_t src, int32_t dst) {
  if (src < 0 || dst < 0 || src == dst) return;
  Grow(std::max(src, dst));
  spec_[dst] = spec_[src];
  spec_in_[dst] = spec_in_[src];
  carry_pos_[dst] = -1;  // a fork starts without a carry
  if (UsesShortlist()) shortlist_.Copy(src, dst);
  if (Resyncs()) history_.Copy(src, dst);
}

void DualTokenStep::SetOracle(int32_t seq, int64_t first_pos, std::vector<int32_t> tokens) {
  if (seq < 0) return;
  if (seq >= static_cast<int32_t>(oracle_.size())) oracle_.resize(seq + 1);
  oracle_[seq] = {first_pos, std::move(tokens)};
}

int32_t DualTokenStep::SpeculativeToken(int32_t seq, int64_t pos, int32_t greedy, const float* hidden,
                                        int32_t fallback, const model::Transformer& transformer) {
  const int64_t V = model_.config.n_vocab;
  switch (options_.predictor) {
    case Predictor::kRandomToken:
      rng_state_ = rng_state_ * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<int32_t>((rng_state_ >> 17) % static_cast<uint64_t>(V));
    case Predictor::kOracleToken:
      if (seq < static_cast<int32_t>(oracle_.size())) {
        const Oracle& o = oracle_[seq];
        const int64_t i = pos - o.first_pos;
        if (i >= 0 && i < static_cast<int64_t>(o.tokens.size())) return o.tokens[i];
      }
      break;  // past the replay: fall back to the prediction
    default:
      break;
  }
  if (hidden != nullptr) {
    const absl::StatusOr<int32_t> t = shortlist_.Argmax(seq, transformer.weights().output, hidden);
    LOG_IF(ERROR, !t.ok()) << "context head: " << t.status();  // a prediction only: fall back
    return t.ok() && *t >= 0 ? *t : fallback;
  }
  return greedy;
}

absl::Status DualTokenStep::Step(absl::Span<const BatchRow> rows, model::Transformer& transformer, KvCache& kv,
                                 std::vector<float>* logits) {
  const int64_t V = model_.config.n_vocab, d = model_.config.n_embd;
  for (const BatchRow& r : rows) {
    Grow(r.seq);
    Note(r.seq, {&r.token, 1});
  }
  // With the context head, speculative rows skip the LM head and come back as hidden states.
  std::vector<float>* hidden_out = UsesShortlist() ? &step_.hidden : nullptr;
  // With the full head, only their greedy tokens leave the device, not n_vocab logits each.
  std::vector<int32_t>* tokens_out = UsesShortlist() ? nullptr : &step_.spec_tokens;
  // The chain: slots without a speculative token pre-decode (their real token alone, an
  // uncommitted row); after a miss, the resync.
  std::vector<BatchRow> pre;
  for (const BatchRow& r : rows) {
    if (spec_[r.seq] < 0) {
      pre.push_back({r.seq, r.pos, r.token, true, /*speculative=*/true});
    } else if (Resyncs() && spec_in_[r.seq] >= 0 && spec_in_[r.seq] != r.token) {
      // Last step's speculative row was fed a wrong token, so the token it returned for this
      // step's row is conditioned on it: take the context's continuation where there is one.
      if (const int32_t t = history_.Continuation(r.seq); t >= 0) {
        spec_[r.seq] = t;
        ++resyncs_;
      }
    }
  }
  if (!pre.empty()) {
    RETURN_IF_ERROR(transformer.Forward(pre, kv, &step_.out, hidden_out, nullptr, tokens_out));
    for (size_t i = 0; i < pre.size(); ++i) {
      spec_[pre[i].seq] = SpeculativeToken(pre[i].seq, pre[i].pos + 1, hidden_out ? -1 : step_.spec_tokens[i],
                                           hidden_out ? &step_.hidden[i * d] : nullptr, pre[i].token, transformer);
    }
  }
  // Each real row, then its speculative row (none at the model's last position).
  std::vector<BatchRow> dual;
  std::vector<bool> has_spec;
  const int64_t carry_layers = options_.carry ? kv.carry_layers() : 0;
  for (const BatchRow& r : rows) {
    dual.push_back(r);
    // The last speculative row was fed this very token at this position: start from its state.
    // (Should the cache no longer hold that row's KV, the row simply runs every layer.)
    if (carry_layers > 0 && carry_pos_[r.seq] == r.pos && spec_in_[r.seq] == r.token &&
        kv.KeepSpeculative(r.seq, carry_layers).ok()) {
      dual.back().resume = carry_x_[r.seq].data();
      ++carried_rows_;
    }
    carry_pos_[r.seq] = -1;  // only a forward that completes arms the next
    const bool spec = r.pos + 1 < model_.config.n_ctx_train;
    has_spec.push_back(spec);
    if (spec) dual.push_back({r.seq, r.pos + 1, spec_[r.seq], true, /*speculative=*/true});
    spec_in_[r.seq] = spec ? spec_[r.seq] : -1;
  }
  const model::Transformer::Carry carry{carry_layers, &step_.carried};
  RETURN_IF_ERROR(
      transformer.Forward(dual, kv, &step_.out, hidden_out, carry_layers > 0 ? &carry : nullptr, tokens_out));
  if (carry_layers > 0) {  // the speculative rows' states, for the next step
    for (size_t i = 0, c = 0; i < rows.size(); ++i) {
      carry_pos_[rows[i].seq] = has_spec[i] ? rows[i].pos + 1 : -1;
      if (has_spec[i]) {
        carry_x_[rows[i].seq].assign(step_.carried.begin() + c * d, step_.carried.begin() + (c + 1) * d);
        ++c;
      }
    }
  }
  // The demux: real rows' logits out; the speculative rows' give the next tokens.
  logits->resize(rows.size() * V);
  size_t o = 0, h = 0;  // rows of step_.out and of step_.hidden or step_.spec_tokens consumed
  for (size_t i = 0; i < rows.size(); ++i) {
    std::copy(step_.out.begin() + o * V, step_.out.begin() + (o + 1) * V, logits->begin() + i * V);
    ++o;
    if (has_spec[i]) {
      // The next step's speculative token, for position pos + 2.
      const int32_t fallback = rows[i].token;  // only if the shortlist were empty
      if (hidden_out != nullptr) {
        spec_[rows[i].seq] =
            SpeculativeToken(rows[i].seq, rows[i].pos + 2, -1, &step_.hidden[h++ * d], fallback, transformer);
      } else {
        spec_[rows[i].seq] =
            SpeculativeToken(rows[i].seq, rows[i].pos + 2, step_.spec_tokens[h++], nullptr, fallback, transformer);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace dd::engine
