// Token sampling: penalties, then greedy, or temperature with top-k, top-p (nucleus) and min-p,
// seeded.
//
// In order:
//   1. penalties on the logits of tokens already seen: repetition_penalty (HF, vLLM: a seen
//      token's logit divided by it when positive, multiplied when negative; prompt and output
//      tokens alike), then frequency_penalty × its count in the output and presence_penalty
//      once if it is in the output (OpenAI's definitions);
//   2. temperature == 0: greedy (argmax, lowest id wins ties);
//   3. otherwise the softmax of logits / temperature; keep the top_k most likely (0 = all),
//      then the smallest most-likely-first set whose probability reaches top_p (renormalized
//      over what top_k kept), then those at least min_p × the most likely one's probability;
//   4. draw from what is kept with a per-request RNG seeded by `seed`, so a request's samples
//      depend on its own logits alone, never on other requests or the batch.
// No step sorts the vocabulary: the candidates above a probability threshold are gathered in
// one pass, and the threshold is lowered only when they cannot hold the answer (a 262K-token
// vocabulary costs about as much as its softmax; bench/sampler_bench.cc).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

namespace dd::engine {

struct SamplingParams {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;  // 1 = off
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  uint64_t seed = 0;
  // InvalidArgument naming the field: temperature < 0 or not finite, top_k < 0, top_p outside
  // (0, 1], min_p outside [0, 1], repetition_penalty outside (0, 10], frequency_penalty or
  // presence_penalty outside [-2, 2].
  absl::Status Validate() const;
  bool penalized() const {
    return repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f;
  }
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // The prompt's tokens, which repetition_penalty counts as seen.
  void SetPrompt(absl::Span<const int32_t> prompt);
  // The next token from a row of logits; it is then counted as output (Accept).
  int32_t Sample(const float* logits, int64_t n_vocab);
  // Counts a token as output without sampling it (a resumed request's earlier tokens).
  void Accept(int32_t token);

  // The candidates step 3 keeps, most likely first, with their probabilities renormalized over
  // them (for tests: Sample draws from exactly these). Empty for greedy.
  std::vector<std::pair<int32_t, float>> Kept(const float* logits, int64_t n_vocab);

 private:
  struct Seen {
    bool in_prompt = false;
    int32_t in_output = 0;
  };
  // The penalized logits, in probs_ (the row itself when nothing is penalized): Keep then
  // works on them in place, so a penalized row is copied once.
  const float* Penalized(const float* logits, int64_t n);
  // probs_ = softmax(logits / temperature); kept_ = the candidates of step 3 with their
  // probabilities (in an order fixed by the row: Sample walks it), returning their total. An
  // empty kept_ means every token, by id.
  double Keep(const float* logits, int64_t n);
  // Appends the tokens whose probability is in [lo, hi) to kept_, in id order.
  void GatherBand(float lo, float hi, int64_t n);

  SamplingParams params_;
  std::mt19937_64 rng_;
  absl::flat_hash_map<int32_t, Seen> seen_;  // only with penalties
  std::vector<float> probs_;
  std::vector<std::pair<int32_t, float>> kept_;
};

int32_t Argmax(const float* logits, int64_t n);

}  // namespace dd::engine
