#include "decode-worker/engine/text_stream.h"

#include <algorithm>

namespace dd::engine {

TextStream::TextStream(const model::Tokenizer& tok, std::vector<std::string> stop_strings,
                       std::vector<int32_t> stop_ids, bool stop_at_eos)
    : tok_(tok), stop_strings_(std::move(stop_strings)), stop_ids_(std::move(stop_ids)), stop_at_eos_(stop_at_eos) {
  for (const std::string& s : stop_strings_) holdback_ = std::max(holdback_, s.empty() ? 0 : s.size() - 1);
}

void TextStream::Replay(absl::Span<const int32_t> tokens, int64_t streamed_bytes) {
  for (int32_t t : tokens) {
    tokens_.push_back(t);
    text_ += utf8_.Push(tok_.TokenBytes(t));
  }
  emitted_ = std::min(text_.size(), static_cast<size_t>(std::max<int64_t>(0, streamed_bytes)));
}

std::string TextStream::Push(int32_t token) {
  if (stop_at_eos_ && tok_.IsEndOfGeneration(token)) return "eos";
  if (std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end()) return "stop_id";
  tokens_.push_back(token);
  const std::string piece = utf8_.Push(tok_.TokenBytes(token));
  text_ += piece;
  size_t stop_at = std::string::npos;
  for (const std::string& s : stop_strings_) {
    if (s.empty()) continue;
    // Only the tail can hold a match that this token completed.
    const size_t tail = piece.size() + s.size();
    const size_t from = text_.size() > tail ? text_.size() - tail : 0;
    const size_t at = text_.find(s, from);
    if (at != std::string::npos) stop_at = std::min(stop_at, at);
  }
  if (stop_at != std::string::npos) {
    text_.resize(stop_at);  // the stop string itself is not part of the output
    finished_ = true;
    return "stop_string";
  }
  return "";
}

void TextStream::Finish() {
  if (!finished_) text_ += utf8_.Flush();
  finished_ = true;
}

std::string TextStream::Delta() {
  // While running, hold back a tail that could still be the start of a stop string.
  const size_t safe = finished_ ? text_.size() : (text_.size() > holdback_ ? text_.size() - holdback_ : 0);
  if (safe <= emitted_) return "";
  std::string out = text_.substr(emitted_, safe - emitted_);
  emitted_ = safe;
  return out;
}

}  // namespace dd::engine
