#include "decode-worker/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "dd/kernels/cpu_ops.h"

namespace dd::engine {

absl::Status SamplingParams::Validate() const {
  if (!std::isfinite(temperature) || temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be a finite number >= 0, got ", temperature));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0 (0 = off), got ", top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  return absl::OkStatus();
}

int32_t Argmax(const float* logits, int64_t n) { return kernels::ArgmaxFirst(logits, n); }

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int32_t Sampler::Sample(const float* logits, int64_t n) {
  if (params_.temperature == 0.0f) return Argmax(logits, n);
  candidates_.resize(n);
  for (int64_t i = 0; i < n; ++i) candidates_[i] = {logits[i] / params_.temperature, static_cast<int32_t>(i)};
  auto better = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  int64_t keep = n;
  if (params_.top_k > 0 && params_.top_k < n) {
    keep = params_.top_k;
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), better);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), better);
  }
  const float mx = candidates_[0].first;
  double total = 0;
  for (int64_t i = 0; i < keep; ++i) {
    candidates_[i].first = std::exp(candidates_[i].first - mx);
    total += candidates_[i].first;
  }
  if (params_.top_p < 1.0f) {
    double acc = 0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      acc += candidates_[i].first / total;
      if (acc >= params_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    total = 0;
    for (int64_t i = 0; i < keep; ++i) total += candidates_[i].first;
  }
  const double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += candidates_[i].first;
    if (u < acc) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;
}

}  // namespace dd::engine
