// Token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.
//
// temperature == 0 means greedy (argmax, lowest id wins ties). Otherwise logits are divided
// by the temperature, restricted to the top_k best (0 = no limit), then to the smallest set
// whose probability reaches top_p, and sampled with a per-request RNG seeded by `seed`, so a
// request's samples do not depend on other requests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"

namespace dd::engine {

struct SamplingParams {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  // InvalidArgument naming the field: temperature < 0 or not finite, top_k < 0,
  // top_p outside (0, 1].
  absl::Status Validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t Sample(const float* logits, int64_t n_vocab);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
};

int32_t Argmax(const float* logits, int64_t n);

}  // namespace dd::engine
