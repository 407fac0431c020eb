#include "decode-worker/engine/spec_head.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "dd/kernels/cpu_ops.h"
#include "decode-worker/model/tokenizer.h"

namespace dd::engine {

absl::StatusOr<SpecHead> ParseSpecHead(absl::string_view name) {
  if (name == "full") return SpecHead::kFull;
  if (name == "context") return SpecHead::kContext;
  return absl::InvalidArgumentError(absl::StrCat("unknown speculative head '", name, "' (full, context)"));
}

std::vector<int32_t> CommonTokens(const model::Tokenizer& tokenizer, int64_t common) {
  const model::TokenizerSpec& spec = tokenizer.spec();
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < static_cast<int32_t>(spec.tokens.size()); ++i) {
    if (spec.types.empty() || spec.types[i] == model::TokenType::kNormal) ids.push_back(i);
  }
  if (spec.scores.size() == spec.tokens.size()) {
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return spec.scores[a] > spec.scores[b]; });
  }
  if (static_cast<int64_t>(ids.size()) > common) ids.resize(std::max<int64_t>(common, 0));
  return ids;
}

ContextShortlist::Slot ContextShortlist::Fresh() const {
  Slot s;
  s.bits.assign((n_vocab_ + 63) / 64, 0);
  for (int32_t t : base_) {
    if (t < 0 || t >= n_vocab_ || (s.bits[t / 64] >> (t % 64) & 1)) continue;
    s.bits[t / 64] |= uint64_t{1} << (t % 64);
    s.ids.push_back(t);
  }
  return s;
}

ContextShortlist::Slot& ContextShortlist::At(int32_t seq) {
  if (seq >= static_cast<int32_t>(slots_.size())) slots_.resize(seq + 1);
  Slot& s = slots_[seq];
  if (s.bits.empty()) s = Fresh();
  return s;
}

void ContextShortlist::Note(int32_t seq, absl::Span<const int32_t> tokens) {
  if (seq < 0) return;
  Slot& s = At(seq);
  for (int32_t t : tokens) {
    if (t < 0 || t >= n_vocab_) continue;
    uint64_t& word = s.bits[t / 64];
    const uint64_t bit = uint64_t{1} << (t % 64);
    if (word & bit) continue;
    word |= bit;
    s.ids.push_back(t);
  }
}

void ContextShortlist::Copy(int32_t src, int32_t dst) {
  if (src < 0 || dst < 0 || src == dst) return;
  Slot copy = At(src);  // a copy first: At(dst) may grow slots_ and move slots_[src]
  At(dst) = std::move(copy);
}

void ContextShortlist::Reset(int32_t seq) {
  if (seq >= 0 && seq < static_cast<int32_t>(slots_.size())) slots_[seq] = Slot();
}

int64_t ContextShortlist::size(int32_t seq) const {
  return seq >= 0 && seq < static_cast<int32_t>(slots_.size()) ? static_cast<int64_t>(slots_[seq].ids.size()) : 0;
}

int32_t ContextShortlist::Argmax(int32_t seq, const model::LoadedModel& model, const float* hidden,
                                 ThreadPool& pool) const {
  if (size(seq) == 0) return -1;
  const std::vector<int32_t>& ids = slots_[seq].ids;
  const kernels::WeightView& out = model.weights.output;
  const int64_t d = model.config.n_embd, n = static_cast<int64_t>(ids.size());
  std::vector<float> score(n);
  auto run = [&](int64_t b, int64_t e) {
    std::vector<float> row(d);
    for (int64_t i = b; i < e; ++i) {
      kernels::DequantizeRow(out.type, out.data + ids[i] * out.row_bytes, row.data(), d);
      score[i] = kernels::Dot(row.data(), hidden, d);
    }
  };
  // About 1 µs per row: split only when there are enough rows to pay for the wake-ups.
  if (pool.size() > 1 && n >= 1024) {
    pool.ParallelFor(n, run);
  } else {
    run(0, n);
  }
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (score[i] > score[best]) best = i;
  }
  return ids[best];
}

}  // namespace dd::engine
