// The text side of one request's output: stop conditions and streamable UTF-8 deltas.
//
// Tokens go in one at a time; text comes out only when it is complete UTF-8 and cannot be the
// start of a stop string, so a client never receives text that is later cut. Used by
// Engine::Generate and by the worker's continuous-batching scheduler (which also replays the
// tokens a client already has when a request resumes on another worker).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "decode-worker/model/tokenizer.h"

namespace dd::engine {

class TextStream {
 public:
  // `tok` must outlive the stream. Stop ids and (with stop_at_eos) end-of-generation tokens
  // end the output without being part of it; a stop string ends it and is cut from the text.
  TextStream(const model::Tokenizer& tok, std::vector<std::string> stop_strings, std::vector<int32_t> stop_ids,
             bool stop_at_eos);

  // Tokens generated earlier whose first `streamed_bytes` bytes of text the client already
  // has: they count for stop strings, and Delta() continues after those bytes.
  void Replay(absl::Span<const int32_t> tokens, int64_t streamed_bytes);
  // Adds a generated token. Returns the stop reason ("eos", "stop_id", "stop_string") when it
  // ends the output, else the empty string.
  std::string Push(int32_t token);
  // Flushes an incomplete UTF-8 tail at the end of a request that did not stop on a string.
  void Finish();
  // Text that is safe to stream and was not returned before.
  std::string Delta();

  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::string& text() const { return text_; }

 private:
  const model::Tokenizer& tok_;
  std::vector<std::string> stop_strings_;
  std::vector<int32_t> stop_ids_;
  bool stop_at_eos_;
  model::Utf8StreamBuffer utf8_;
  std::vector<int32_t> tokens_;
  std::string text_;
  size_t holdback_ = 0;  // longest stop string - 1: the tail that may still become a match
  size_t emitted_ = 0;
  bool finished_ = false;
};

}  // namespace dd::engine
