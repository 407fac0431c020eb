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
#include "dd/backend/device.h"
#include "dd/backend/ops.h"
#include "decode-worker/model/weights.h"

namespace dd::engine {

// kFull: the whole LM head, argmax over the vocabulary. kContext: argmax over the sequence's
// own tokens. kAuto: chosen per model by ResolveSpecHead.
enum class SpecHead { kFull, kContext, kAuto };
absl::StatusOr<SpecHead> ParseSpecHead(absl::string_view name);  // "full", "context", "auto"
absl::string_view SpecHeadName(SpecHead head);

// kAuto becomes kContext where the LM head has more multiply-adds per row than all the layers
// together (Gemma 3 270M: 168M vs 100M), where the full head is most of the speculative row's
// cost; else kFull (SmolLM2-135M: 28M vs 106M; Llama-3.1-8B: 0.5G vs 7G), where the extra row
// through a weight-bound head is nearly free. Other heads are returned as they are.
// docs/decisions/0009-speculative-row-cost.md has the measurements.
SpecHead ResolveSpecHead(SpecHead head, const model::ModelConfig& config);

// The `common` most frequent normal tokens of a vocabulary: the highest SentencePiece scores
// (log-probabilities) when the vocabulary has scores, else the lowest ids (byte-level BPE
// vocabularies are ordered by merge, i.e. roughly by frequency). Control tokens excluded.
std::vector<int32_t> CommonTokens(const model::Tokenizer& tokenizer, int64_t common);

// One shortlist serves one model: it keeps the output-matrix rows it has dequantized (shared by
// every slot, up to `cache_bytes`), so a step dequantizes only the tokens new since the last
// one. Rows past the cap are dequantized on every call, as without the cache; the scores, and
// so the argmax, are the same either way. The cached rows, the hidden state and the scores are
// device memory (Attach); the scores come back to the host by one copy.
class ContextShortlist {
 public:
  static constexpr int64_t kDefaultCacheBytes = int64_t{16} << 20;
  explicit ContextShortlist(int64_t n_vocab, int64_t cache_bytes = kDefaultCacheBytes)
      : n_vocab_(n_vocab), cache_bytes_(cache_bytes) {}
  ~ContextShortlist();
  ContextShortlist(const ContextShortlist&) = delete;
  ContextShortlist& operator=(const ContextShortlist&) = delete;
  // Allocates the device memory (tag kWorkspace) for rows of `n_embd` floats: the row cache,
  // one hidden state, a score per vocabulary id. Once, before Argmax; `device` outlives this.
  absl::Status Attach(backend::Device& device, int64_t n_embd);
  // The bytes Attach allocates (the memory plan's shared workspace).
  int64_t device_bytes() const { return cache_rows_.bytes + hidden_.bytes + scores_.bytes; }
  // Tokens every slot's set starts with (CommonTokens), scored before the slot's own.
  void SetBase(std::vector<int32_t> base) { base_ = std::move(base); }
  // Adds tokens to slot `seq`'s set (ids outside the vocabulary are ignored).
  void Note(int32_t seq, absl::Span<const int32_t> tokens);
  void Copy(int32_t src, int32_t dst);
  void Reset(int32_t seq);
  int64_t size(int32_t seq) const;
  // The token of `seq`'s set whose row of `output` (the output matrix on the device) has the
  // largest dot product with `hidden` (n_embd floats of host memory, already normalized);
  // ties go to the token seen first. -1 when the set is empty.
  absl::StatusOr<int32_t> Argmax(int32_t seq, const kernels::WeightView& output, const float* hidden);
  // Rows held dequantized (for tests and the memory report).
  int64_t cached_rows() const { return static_cast<int64_t>(cached_.size()); }
  int64_t cache_cap_bytes() const { return cache_bytes_; }

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
  int64_t cache_bytes_;
  std::vector<int32_t> cache_index_;  // per vocabulary id: its row in cache_rows_, or -1
  std::vector<int32_t> cached_;       // the ids held, in the order cached
  backend::Device* device_ = nullptr;
  int64_t d_ = 0;                     // n_embd
  backend::DeviceBuffer cache_rows_;  // up to cache_bytes_ / row of n_embd floats
  backend::DeviceBuffer hidden_;      // n_embd floats
  backend::DeviceBuffer scores_;      // a score per vocabulary id
  // Argmax's scratch, kept across calls: cached rows and their places, rows past the cap and
  // their places, scores (host).
  struct ArgmaxScratch {
    std::vector<const float*> row_ptrs;
    std::vector<int64_t> scored, uncached_at;
    std::vector<int32_t> uncached;
    std::vector<float> piece_scores, score;
  };
  ArgmaxScratch scratch_;
};

}  // namespace dd::engine
