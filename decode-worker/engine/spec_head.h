// The speculative row's LM head (dualdecoder). The speculative token only steers which chunks
// are prefetched for the next step, so its head need not be exact: with SpecHead::kContext it
// scores only the tokens the sequence has seen (prompt and generated), a few thousand rows
// instead of the whole vocabulary (262144 on Gemma 3), and returns the best of those. Results
// never depend on it (misses are fetched on the urgent path); only the hit rate does
// (bench/results/eval-predictors*.md reports both heads).
//
// Not thread-safe: the engine calls it from its one forward thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/thread_pool.h"
#include "decode-worker/model/weights.h"

namespace dd::engine {

// kFull: the whole LM head, argmax over the vocabulary. kContext: argmax over the sequence's
// own tokens.
enum class SpecHead { kFull, kContext };
absl::StatusOr<SpecHead> ParseSpecHead(absl::string_view name);  // "full", "context"

// The `common` most frequent normal tokens of a vocabulary: the highest SentencePiece scores
// (log-probabilities) when the vocabulary has scores, else the lowest ids (byte-level BPE
// vocabularies are ordered by merge, i.e. roughly by frequency). Control tokens excluded.
std::vector<int32_t> CommonTokens(const model::Tokenizer& tokenizer, int64_t common);

class ContextShortlist {
 public:
  explicit ContextShortlist(int64_t n_vocab) : n_vocab_(n_vocab) {}
  // Tokens every slot's set starts with (CommonTokens), scored before the slot's own.
  void SetBase(std::vector<int32_t> base) { base_ = std::move(base); }
  // Adds tokens to slot `seq`'s set (ids outside the vocabulary are ignored).
  void Note(int32_t seq, absl::Span<const int32_t> tokens);
  void Copy(int32_t src, int32_t dst);
  void Reset(int32_t seq);
  int64_t size(int32_t seq) const;
  // The token of `seq`'s set whose output-matrix row has the largest dot product with
  // `hidden` (n_embd floats, already normalized); ties go to the token seen first. -1 when
  // the set is empty.
  int32_t Argmax(int32_t seq, const model::LoadedModel& model, const float* hidden, ThreadPool& pool) const;

 private:
  struct Slot {
    std::vector<uint64_t> bits;  // membership, one bit per vocabulary id
    std::vector<int32_t> ids;    // in the order first seen
  };
  Slot& At(int32_t seq);
  Slot Fresh() const;
  int64_t n_vocab_;
  std::vector<int32_t> base_;
  std::vector<Slot> slots_;
};

}  // namespace dd::engine
