#include "decode-worker/engine/sampler.h"

#include <algorithm>
#include <cmath>

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
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1] (0 = off), got ", min_p));
  }
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 10.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be in (0, 10] (1 = off), got ", repetition_penalty));
  }
  for (auto [name, v] : {std::pair{"frequency_penalty", frequency_penalty}, {"presence_penalty", presence_penalty}}) {
    if (!(v >= -2.0f && v <= 2.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be in [-2, 2] (0 = off), got ", v));
    }
  }
  return absl::OkStatus();
}

int32_t Argmax(const float* logits, int64_t n) { return kernels::ArgmaxFirst(logits, n); }

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

void Sampler::SetPrompt(absl::Span<const int32_t> prompt) {
  if (params_.repetition_penalty == 1.0f) return;
  for (int32_t t : prompt) seen_[t].in_prompt = true;
}

void Sampler::Accept(int32_t token) {
  if (params_.penalized()) ++seen_[token].in_output;
}

const float* Sampler::Penalized(const float* logits, int64_t n) {
  if (seen_.empty()) return logits;
  probs_.assign(logits, logits + n);
  const float rp = params_.repetition_penalty;
  for (const auto& [token, seen] : seen_) {
    if (token < 0 || token >= n) continue;
    float& x = probs_[token];
    if (rp != 1.0f) x = x > 0 ? x / rp : x * rp;
    if (seen.in_output > 0) x -= params_.frequency_penalty * static_cast<float>(seen.in_output) + params_.presence_penalty;
  }
  return probs_.data();
}

namespace {

// Most likely first; ties to the lower id (a strict total order: selection and sorting agree).
bool Better(const std::pair<int32_t, float>& a, const std::pair<int32_t, float>& b) {
  return a.second > b.second || (a.second == b.second && a.first < b.first);
}

using Candidates = std::vector<std::pair<int32_t, float>>;

// The fewest entries of [begin, end), best first, whose probabilities add up to `need` (all of
// them when they do not), moved to the front: selection halves the range until 1024 entries
// are left, which are sorted and counted. Expected time linear in the range.
size_t PrefixReaching(Candidates::iterator begin, Candidates::iterator end, double need) {
  size_t lo = 0, hi = static_cast<size_t>(end - begin);
  double acc = 0;  // the entries before lo, all better than those in [lo, hi)
  while (hi - lo > 1024) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(begin + lo, begin + mid, begin + hi, Better);
    double half = 0;
    for (size_t i = lo; i < mid; ++i) half += begin[i].second;
    if (acc + half >= need) {
      hi = mid;
    } else {
      acc += half;
      lo = mid;
    }
  }
  std::sort(begin + lo, begin + hi, Better);
  for (size_t i = lo; i < hi; ++i) {
    acc += begin[i].second;
    if (acc >= need) return i + 1;
  }
  return hi;
}

// The largest probability and the sum of all, in 16 lanes the compiler vectorizes (one chain
// of double additions waits on each one: a third of a millisecond over 262144 tokens).
void MaxAndSum(const float* p, int64_t n, float* max, double* sum) {
  float m[16];
  double s[16];
  std::fill(m, m + 16, -INFINITY);
  std::fill(s, s + 16, 0.0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      m[j] = p[i + j] > m[j] ? p[i + j] : m[j];
      s[j] += p[i + j];
    }
  }
  for (; i < n; ++i) {
    m[0] = p[i] > m[0] ? p[i] : m[0];
    s[0] += p[i];
  }
  *max = *std::max_element(m, m + 16);
  *sum = 0;
  for (double x : s) *sum += x;
}

}  // namespace

void Sampler::GatherBand(float lo, float hi, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (probs_[i] >= lo && probs_[i] < hi) kept_.emplace_back(static_cast<int32_t>(i), probs_[i]);
  }
}

double Sampler::Keep(const float* logits, int64_t n) {
  if (logits != probs_.data()) probs_.assign(logits, logits + n);  // else Penalized's copy
  kernels::ScaledSoftmax(probs_.data(), n, 1.0f / params_.temperature);
  kept_.clear();
  const bool top_k = params_.top_k > 0 && params_.top_k < n;
  const bool top_p = params_.top_p < 1.0f;
  const bool min_p = params_.min_p > 0.0f;
  if (!top_k && !top_p && !min_p) return 0;  // every token
  float pmax = 0;
  double row = 0;
  MaxAndSum(probs_.data(), n, &pmax, &row);
  const float min_prob = params_.min_p * pmax;
  const double target = params_.top_p * row;  // top-p alone takes its share of the whole row
  // The tokens above a threshold are exactly the most likely ones. Each round gathers the band
  // below the last threshold (2^8 lower, at last 0: every token) until the candidates hold
  // top-k's k or top-p's prefix; only that band is then ordered, by selection.
  float threshold = !top_k && !top_p ? min_prob : pmax * (1.0f / 256);
  float above = INFINITY;
  double before = 0;  // top-p alone: the probability of the bands gathered before, all kept
  while (true) {
    const size_t from = kept_.size();
    GatherBand(threshold, above, n);
    const auto band = kept_.begin() + static_cast<std::ptrdiff_t>(from);
    if (top_k) {
      const size_t k = static_cast<size_t>(params_.top_k);
      if (kept_.size() >= k || threshold == 0) {
        if (kept_.size() > k) std::nth_element(band, kept_.begin() + static_cast<std::ptrdiff_t>(k), kept_.end(), Better);
        kept_.resize(std::min(k, kept_.size()));
        std::sort(kept_.begin(), kept_.end(), Better);
        if (top_p) {  // the prefix of the k, renormalized over them
          double total = 0;
          for (const auto& [t, p] : kept_) total += p;
          double acc = 0;
          for (size_t i = 0; i < kept_.size(); ++i) {
            acc += kept_[i].second / total;
            if (acc >= params_.top_p) {
              kept_.resize(i + 1);
              break;
            }
          }
        }
        break;
      }
    } else if (top_p) {
      double mass = 0;
      for (auto it = band; it != kept_.end(); ++it) mass += it->second;
      if (before + mass >= target || threshold == 0) {
        kept_.resize(from + PrefixReaching(band, kept_.end(), target - before));
        break;
      }
      before += mass;
    } else {
      break;  // min-p alone: its band is the answer
    }
    above = threshold;
    threshold = threshold < 1e-30f ? 0.0f : threshold * (1.0f / 256);
  }
  if (min_p) {  // the best candidate always stays: min_prob <= pmax
    std::erase_if(kept_, [min_prob](const auto& c) { return c.second < min_prob; });
  }
  double total = 0;
  for (const auto& [token, p] : kept_) total += p;
  return total;
}

int32_t Sampler::Sample(const float* logits, int64_t n) {
  const float* l = Penalized(logits, n);
  int32_t token = -1;
  if (params_.temperature == 0.0f) {
    token = Argmax(l, n);
  } else {
    const double total = Keep(l, n);
    if (kept_.empty()) {  // every token, in id order
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += probs_[i];
      const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
      double acc = 0;
      for (int64_t i = 0; i < n && token < 0; ++i) {
        acc += probs_[i];
        if (u < acc) token = static_cast<int32_t>(i);
      }
      if (token < 0) token = Argmax(l, n);
    } else {
      const double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
      double acc = 0;
      for (const auto& [t, p] : kept_) {
        acc += p;
        if (u < acc) {
          token = t;
          break;
        }
      }
      if (token < 0) token = kept_.back().first;
    }
  }
  Accept(token);
  return token;
}

std::vector<std::pair<int32_t, float>> Sampler::Kept(const float* logits, int64_t n) {
  const float* l = Penalized(logits, n);
  if (params_.temperature == 0.0f) return {};
  const double total = Keep(l, n);
  std::vector<std::pair<int32_t, float>> out;
  double sum = total;
  if (kept_.empty()) {
    GatherBand(0.0f, INFINITY, n);
    sum = 0;
    for (const auto& [t, p] : kept_) sum += p;
  }
  std::sort(kept_.begin(), kept_.end(), Better);  // before normalizing, which may round two apart into a tie
  for (const auto& [t, p] : kept_) out.emplace_back(t, static_cast<float>(p / sum));
  return out;
}

}  // namespace dd::engine
