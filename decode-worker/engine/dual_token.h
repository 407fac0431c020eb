// The dual-token protocol (docs/architecture.md, "A decode step in each mode"): what makes a
// `dualdecoder` decode step, in one place.
//
//   the speculative chain  per slot, the token its next speculative row is fed and the one the
//                          last was fed; a slot without one first pre-decodes (its real token
//                          run alone as an uncommitted row) to get one
//                          (docs/decisions/0008-dual-token-step.md);
//   the resync             after a miss (the last speculative row was fed a wrong token), the
//                          context's continuation replaces the chain's token
//                          (docs/decisions/0010-speculative-resync.md);
//   the carry              the last speculative row's residual after the layers that attend
//                          densely, reused by the next real row when it has that row's token
//                          and position (docs/decisions/0011-dual-step-carry.md);
//   the output demux       the real rows' logits go out; the speculative rows' logits — or
//                          hidden states, with the context head (spec_head.h) — give the next
//                          speculative tokens.
// One forward pass holds each real row followed by its speculative row; the KV cache sees the
// latter as BatchRow::speculative and predicts the next step's chunks from its query. The real
// rows' logits are bit-identical to a `sparse` step's. Not thread-safe (the engine's thread).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "decode-worker/engine/kv_cache.h"
#include "decode-worker/engine/spec_head.h"
#include "decode-worker/engine/token_history.h"
#include "decode-worker/model/transformer.h"

namespace dd::engine {

class DualTokenStep {
 public:
  struct Options {
    Predictor predictor = Predictor::kSpeculative;  // which token feeds the speculative row
    SpecHead head = SpecHead::kFull;                 // resolved (not kAuto)
    int64_t head_common = 0;                         // context head: common tokens every slot scores
    bool resync = true;
    bool carry = true;
  };
  // `model` outlives this.
  DualTokenStep(const model::LoadedModel& model, const Options& options);

  // The context head's device memory (none for the full head); `device` outlives this.
  absl::Status Attach(backend::Device& device);
  int64_t device_bytes() const { return UsesShortlist() ? shortlist_.device_bytes() : 0; }

  // Tokens slot `seq` consumed (prompt, restored prefix): what the context head and the
  // resync look in.
  void Note(int32_t seq, absl::Span<const int32_t> tokens);
  // The slot starts a new sequence: its chain, carry and resync history are forgotten.
  void Clear(int32_t seq);
  // The slot is free: Clear, and its shortlist and oracle too.
  void Release(int32_t seq);
  // Slot `dst` continues like `src` (a fork): the chain and what the heads look in, no carry.
  void Fork(int32_t src, int32_t dst);
  // Predictor "oracle": the token at position first_pos + i is tokens[i].
  void SetOracle(int32_t seq, int64_t first_pos, std::vector<int32_t> tokens);

  // One step of real rows `rows` (one per slot, want_logits) through `transformer` on the
  // KV `kv` (which keeps speculative KV for the carry). `logits` gets n_vocab per real row.
  absl::Status Step(absl::Span<const model::BatchRow> rows, model::Transformer& transformer, KvCache& kv,
                    std::vector<float>* logits);

  // Since construction: speculative tokens replaced by the resync; real rows that started
  // from a carried state.
  int64_t resyncs() const { return resyncs_; }
  int64_t carried_rows() const { return carried_rows_; }

 private:
  bool UsesShortlist() const { return options_.head == SpecHead::kContext; }
  bool Resyncs() const {
    return options_.resync &&
           (options_.predictor == Predictor::kSpeculative || options_.predictor == Predictor::kUnion);
  }
  // Per-slot vectors grown to hold slot `seq`.
  void Grow(int32_t seq);
  // The token fed to the speculative row at position `pos` (the predictor: the speculative
  // head's best — `greedy`, the full head's argmax computed on the device, or the context
  // shortlist's given the row's final `hidden` state — a random token or the oracle's).
  // `fallback` when the shortlist is empty.
  int32_t SpeculativeToken(int32_t seq, int64_t pos, int32_t greedy, const float* hidden, int32_t fallback,
                           const model::Transformer& transformer);

  const model::LoadedModel& model_;
  Options options_;
  std::vector<int32_t> spec_;     // per slot: the next speculative row's token (-1: none yet)
  std::vector<int32_t> spec_in_;  // per slot: the token the last speculative row was fed (-1: none)
  TokenHistory history_;          // per slot: the tokens, for the resync
  // The carry, per slot: the last speculative row's residual after the carried layers and its
  // position (-1: none).
  std::vector<std::vector<float>> carry_x_;
  std::vector<int64_t> carry_pos_;
  ContextShortlist shortlist_;
  struct Oracle {
    int64_t first_pos = 0;
    std::vector<int32_t> tokens;
  };
  std::vector<Oracle> oracle_;  // per slot
  uint64_t rng_state_ = 0x9E3779B97F4A7C15ULL;  // the random predictor's LCG, fixed seed
  int64_t resyncs_ = 0, carried_rows_ = 0;
  // Step's buffers, kept across steps.
  struct StepScratch {
    std::vector<float> out, hidden, carried;
    std::vector<int32_t> spec_tokens;  // the full head's greedy tokens of the speculative rows
  };
  StepScratch step_;
};

}  // namespace dd::engine
