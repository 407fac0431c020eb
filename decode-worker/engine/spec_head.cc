#include "decode-worker/engine/spec_head.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/model/tokenizer.h"

namespace dd::engine {

absl::StatusOr<SpecHead> ParseSpecHead(absl::string_view name) {
  if (name == "full") return SpecHead::kFull;
  if (name == "context") return SpecHead::kContext;
  if (name == "auto") return SpecHead::kAuto;
  return absl::InvalidArgumentError(absl::StrCat("unknown speculative head '", name, "' (full, context, auto)"));
}

absl::string_view SpecHeadName(SpecHead head) {
  switch (head) {
    case SpecHead::kFull:
      return "full";
    case SpecHead::kContext:
      return "context";
    case SpecHead::kAuto:
      break;
  }
  return "auto";
}

SpecHead ResolveSpecHead(SpecHead head, const model::ModelConfig& c) {
  if (head != SpecHead::kAuto) return head;
  // Per row: q, k, v and o projections, and a gated FFN's three matrices, in every layer.
  const double layer = static_cast<double>(c.n_embd) * c.head_dim * (2 * c.n_head + 2 * c.n_head_kv) +
                       3.0 * static_cast<double>(c.n_embd) * c.n_ff;
  const double lm_head = static_cast<double>(c.n_vocab) * c.n_embd;
  return lm_head > layer * static_cast<double>(c.n_layer) ? SpecHead::kContext : SpecHead::kFull;
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

ContextShortlist::~ContextShortlist() {
  if (device_ == nullptr) return;
  (void)device_->Synchronize(device_->Record(backend::Queue::kCompute));
  device_->Free(cache_rows_);
  device_->Free(hidden_);
  device_->Free(scores_);
}

absl::Status ContextShortlist::Attach(backend::Device& device, int64_t n_embd) {
  if (device_ != nullptr) return absl::FailedPreconditionError("context shortlist: already attached to a device");
  if (n_embd <= 0) return absl::InvalidArgumentError(absl::StrCat("context shortlist: n_embd ", n_embd));
  const int64_t row = n_embd * static_cast<int64_t>(sizeof(float));
  const int64_t cap_rows = std::min(cache_bytes_ / row, n_vocab_);
  device_ = &device;
  d_ = n_embd;
  if (cap_rows > 0) {
    ASSIGN_OR_RETURN(cache_rows_, device.Allocate(backend::MemoryTag::kWorkspace, cap_rows * row));
  }
  ASSIGN_OR_RETURN(hidden_, device.Allocate(backend::MemoryTag::kWorkspace, row));
  ASSIGN_OR_RETURN(scores_, device.Allocate(backend::MemoryTag::kWorkspace, n_vocab_ * static_cast<int64_t>(sizeof(float))));
  return absl::OkStatus();
}

absl::StatusOr<int32_t> ContextShortlist::Argmax(int32_t seq, const kernels::WeightView& output, const float* hidden) {
  if (device_ == nullptr) return absl::FailedPreconditionError("context shortlist: Argmax before Attach");
  if (size(seq) == 0) return -1;
  backend::Device& dev = *device_;
  backend::Ops& ops = dev.ops();
  const std::vector<int32_t>& ids = slots_[seq].ids;
  const int64_t d = d_, n = static_cast<int64_t>(ids.size());
  // Cache the rows not yet held while the cap allows.
  if (cache_index_.empty()) cache_index_.assign(n_vocab_, -1);
  const int64_t cap_rows = cache_rows_.bytes / (d * static_cast<int64_t>(sizeof(float)));
  const int64_t first_new = static_cast<int64_t>(cached_.size());
  for (int64_t i = 0; i < n && static_cast<int64_t>(cached_.size()) < cap_rows; ++i) {
    if (cache_index_[ids[i]] >= 0) continue;
    cache_index_[ids[i]] = static_cast<int32_t>(cached_.size());
    cached_.push_back(ids[i]);
  }
  float* rows = static_cast<float*>(cache_rows_.data);
  float* x = static_cast<float*>(hidden_.data);
  float* scores = static_cast<float*>(scores_.data);
  RETURN_IF_ERROR(dev.CopyToDevice(backend::Queue::kCompute, hidden, hidden_, 0, d * static_cast<int64_t>(sizeof(float))));
  if (static_cast<int64_t>(cached_.size()) > first_new) {
    ops.DequantizeRows(output, absl::MakeConstSpan(cached_).subspan(first_new), rows + first_new * d);
  }
  // Cached rows from the cache; rows past its cap are dequantized and scored one at a time.
  scratch_.score.resize(n);
  scratch_.row_ptrs.clear();
  scratch_.scored.clear();
  scratch_.uncached.clear();
  scratch_.uncached_at.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t at = cache_index_[ids[i]];
    if (at >= 0) {
      scratch_.row_ptrs.push_back(rows + static_cast<int64_t>(at) * d);
      scratch_.scored.push_back(i);
    } else {
      scratch_.uncached.push_back(ids[i]);
      scratch_.uncached_at.push_back(i);
    }
  }
  // Scores of the cached rows first, then of the others, side by side in scores_.
  const int64_t nc = static_cast<int64_t>(scratch_.row_ptrs.size());
  ops.DotRows(scratch_.row_ptrs, x, d, scores);
  ops.ScoreRows(output, scratch_.uncached, x, scores + nc);
  scratch_.piece_scores.resize(n);
  ASSIGN_OR_RETURN(const void* read, dev.ReadOnHost(backend::Queue::kCompute, scores_, 0,
                                                    n * static_cast<int64_t>(sizeof(float)), scratch_.piece_scores.data()));
  const float* got = static_cast<const float*>(read);
  // Also what `hidden` must live for (the copy to the device above reads it).
  RETURN_IF_ERROR(dev.Synchronize(dev.Record(backend::Queue::kCompute)));
  for (size_t j = 0; j < scratch_.scored.size(); ++j) scratch_.score[scratch_.scored[j]] = got[j];
  for (size_t j = 0; j < scratch_.uncached_at.size(); ++j) scratch_.score[scratch_.uncached_at[j]] = got[nc + j];
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (scratch_.score[i] > scratch_.score[best]) best = i;
  }
  return ids[best];
}

}  // namespace dd::engine
