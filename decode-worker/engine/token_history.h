// Each slot's tokens (prompt, restored prefix, generated), for resynchronizing the dual-token
// chain (dualdecoder). The speculative row's input is the token the previous step speculated;
// when that token turns out wrong, the row's output (the next speculative token) was computed
// from a wrong token and usually derails the chain for several steps, or locks it one step
// behind on text that repeats itself (docs/decisions/0010-speculative-resync.md). After such a
// miss the engine asks Continuation() instead: the token that followed the latest earlier
// occurrence of the sequence's last two tokens (else of its last token), a lookup in the
// context that costs no forward pass.
//
// Host memory: 4 bytes per token per slot. Not thread-safe: the engine calls it from its one
// forward thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace dd::engine {

class TokenHistory {
 public:
  // Appends tokens to slot `seq` (grows the slot table as needed; negative slots are ignored).
  void Note(int32_t seq, absl::Span<const int32_t> tokens);
  void Copy(int32_t src, int32_t dst);
  void Reset(int32_t seq);
  int64_t size(int32_t seq) const;
  // The token that followed the latest earlier occurrence of the slot's last two tokens (as a
  // pair), else of its last token alone; -1 when the slot has fewer than three tokens or the
  // last token never occurred before.
  int32_t Continuation(int32_t seq) const;

 private:
  std::vector<std::vector<int32_t>> slots_;
};

}  // namespace dd::engine
