// Tokenizer: spec validation, special-token splitting, decoding, Utf8StreamBuffer.
// The two BPE algorithms live in tokenizer_spm.cc and tokenizer_bpe.cc.
#include "decode-worker/model/tokenizer.h"

#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "decode-worker/model/unicode_data.h"

namespace dd::model {
namespace {

absl::Status SpecError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer spec: ", what));
}

absl::Status CheckId(absl::string_view field, int32_t id, size_t vocab_size) {
  if (id == -1 || (id >= 0 && static_cast<size_t>(id) < vocab_size)) return absl::OkStatus();
  return SpecError(absl::StrCat("'", field, "' = ", id, " is out of range [0, ", vocab_size,
                                ") (use -1 for none)"));
}

// Length of the tail of `s` that is a proper prefix of a valid UTF-8 sequence (0 if none).
size_t IncompleteUtf8Tail(std::string_view s) {
  const size_t n = s.size();
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const uint8_t b = static_cast<uint8_t>(s[n - k]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    size_t len = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    }
    if (len <= k) return 0;  // ASCII, invalid lead, or a complete (or overlong) sequence
    if (k >= 2) {
      const uint8_t second = static_cast<uint8_t>(s[n - k + 1]);
      if (second < lo || second > hi) return 0;  // can never complete
    }
    return k;
  }
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(TokenizerSpec spec) {
  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer(std::move(spec)));
  absl::Status status = tokenizer->Init();
  if (!status.ok()) return status;
  return tokenizer;
}

bool Tokenizer::IsMergeable(int32_t id) const {
  const TokenType type = spec_.types[id];
  return type == TokenType::kNormal || type == TokenType::kUndefined;
}

absl::Status Tokenizer::Init() {
  const size_t n = spec_.tokens.size();
  if (n == 0) return SpecError("'tokens' (the vocabulary) is empty");
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return SpecError(absl::StrCat("'tokens' has ", n, " entries, more than int32 ids allow"));
  }
  if (spec_.types.empty()) spec_.types.assign(n, TokenType::kNormal);
  if (spec_.types.size() != n) {
    return SpecError(
        absl::StrCat("'types' has ", spec_.types.size(), " entries but 'tokens' has ", n));
  }
  for (size_t i = 0; i < n; ++i) {
    const auto t = static_cast<int32_t>(spec_.types[i]);
    if (t < 0 || t > static_cast<int32_t>(TokenType::kByte)) {
      return SpecError(absl::StrCat("'types[", i, "]' = ", t, " is not a token type (0..6)"));
    }
  }
  const bool spm = spec_.kind == TokenizerSpec::Kind::kSentencePieceBpe;
  if (spm && spec_.scores.size() != n) {
    return SpecError(absl::StrCat("'scores' has ", spec_.scores.size(),
                                  " entries but 'tokens' has ", n,
                                  " (SentencePiece BPE needs one score per token)"));
  }
  if (!spm && !spec_.scores.empty() && spec_.scores.size() != n) {
    return SpecError(absl::StrCat("'scores' has ", spec_.scores.size(),
                                  " entries but 'tokens' has ", n, " (expected 0 or ", n, ")"));
  }
  for (size_t i = 0; i < spec_.scores.size(); ++i) {
    if (std::isnan(spec_.scores[i])) return SpecError(absl::StrCat("'scores[", i, "]' is NaN"));
  }
  for (const auto& [field, id] : {std::pair<absl::string_view, int32_t>{"bos_id", spec_.bos_id},
                                  {"eos_id", spec_.eos_id},
                                  {"unk_id", spec_.unk_id},
                                  {"pad_id", spec_.pad_id}}) {
    absl::Status status = CheckId(field, id, n);
    if (!status.ok()) return status;
  }
  if (spec_.add_bos && spec_.bos_id < 0) return SpecError("'add_bos' is set but 'bos_id' is -1");
  is_eog_.assign(n, false);
  for (size_t i = 0; i < spec_.eog_ids.size(); ++i) {
    const int32_t id = spec_.eog_ids[i];
    if (id < 0 || static_cast<size_t>(id) >= n) {
      return SpecError(absl::StrCat("'eog_ids[", i, "]' = ", id, " is out of range [0, ", n, ")"));
    }
    is_eog_[id] = true;
  }
  auto add_eog = [&](int32_t id) {
    if (is_eog_[id]) return;
    spec_.eog_ids.push_back(id);
    is_eog_[id] = true;
  };
  if (spec_.eos_id >= 0) add_eog(spec_.eos_id);
  for (size_t i = 0; i < n; ++i) {
    const TokenType type = spec_.types[i];
    if (type != TokenType::kControl && type != TokenType::kUserDefined) continue;
    for (std::string_view name : internal::kEndOfGenerationNames) {
      if (spec_.tokens[i] == name) add_eog(static_cast<int32_t>(i));
    }
  }
  absl::Status status = spm ? InitSpm() : InitByteLevel();
  if (!status.ok()) return status;
  BuildSpecialTrie();
  return absl::OkStatus();
}

void Tokenizer::BuildSpecialTrie() {
  trie_token_.assign(1, -1);
  for (size_t id = 0; id < spec_.tokens.size(); ++id) {
    const TokenType type = spec_.types[id];
    if (type != TokenType::kControl && type != TokenType::kUserDefined &&
        type != TokenType::kUnknown) {
      continue;
    }
    const std::string& text = spec_.tokens[id];
    if (text.empty()) continue;
    int32_t node = 0;
    for (unsigned char c : text) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | c;
      auto [it, inserted] = trie_edge_.try_emplace(key, static_cast<int32_t>(trie_token_.size()));
      if (inserted) trie_token_.push_back(-1);
      node = it->second;
    }
    if (trie_token_[node] < 0) trie_token_[node] = static_cast<int32_t>(id);
    trie_first_byte_[static_cast<unsigned char>(text[0])] = true;
  }
}

int32_t Tokenizer::MatchSpecial(std::string_view text, size_t pos, bool parse_special,
                                size_t* len) const {
  int32_t node = 0;
  int32_t best = -1;
  for (size_t i = pos; i < text.size(); ++i) {
    const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(text[i]);
    auto it = trie_edge_.find(key);
    if (it == trie_edge_.end()) break;
    node = it->second;
    const int32_t id = trie_token_[node];
    if (id >= 0 && (parse_special || spec_.types[id] == TokenType::kUserDefined)) {
      best = id;
      *len = i - pos + 1;
    }
  }
  return best;
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos,
                                       bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos && spec_.bos_id >= 0) out.push_back(spec_.bos_id);
  const bool spm = spec_.kind == TokenizerSpec::Kind::kSentencePieceBpe;
  size_t fragment_start = 0;
  auto encode_fragment = [&](size_t end) {
    if (end <= fragment_start) return;
    std::string_view fragment = text.substr(fragment_start, end - fragment_start);
    if (spm) {
      // The space prefix goes only before text that starts the input, so Decode can undo it.
      EncodeSpm(fragment, spec_.add_space_prefix && fragment_start == 0, &out);
    } else {
      EncodeByteLevel(fragment, &out);
    }
  };
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    const int32_t id = trie_first_byte_[static_cast<unsigned char>(text[pos])]
                           ? MatchSpecial(text, pos, parse_special, &len)
                           : -1;
    if (id < 0) {
      ++pos;
      continue;
    }
    encode_fragment(pos);
    out.push_back(id);
    pos += len;
    fragment_start = pos;
  }
  encode_fragment(text.size());
  return out;
}

std::string Tokenizer::TokenBytes(int32_t id, bool render_special) const {
  if (id < 0 || id >= vocab_size()) return {};
  const TokenType type = spec_.types[id];
  if (render_special && (type == TokenType::kControl || type == TokenType::kUnknown)) {
    return spec_.tokens[id];
  }
  return rendered_[id];
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool render_special) const {
  std::string out;
  size_t first_text = 0;  // index of the token that may carry Encode's space prefix
  if (!ids.empty() && spec_.bos_id >= 0 && ids[0] == spec_.bos_id) first_text = 1;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size()) continue;
    const TokenType type = spec_.types[id];
    if (render_special && (type == TokenType::kControl || type == TokenType::kUnknown)) {
      out += spec_.tokens[id];
      continue;
    }
    const std::string& bytes = rendered_[id];
    const bool strip =
        i == first_text && spec_.add_space_prefix &&
        spec_.kind == TokenizerSpec::Kind::kSentencePieceBpe &&
        (type == TokenType::kNormal || type == TokenType::kUndefined || type == TokenType::kByte) &&
        !bytes.empty() && bytes[0] == ' ';
    out.append(bytes, strip ? 1 : 0, std::string::npos);
  }
  return out;
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return id >= 0 && id < vocab_size() && is_eog_[id];
}

std::string Utf8StreamBuffer::Push(std::string_view bytes) {
  pending_.append(bytes);
  const size_t ready = pending_.size() - IncompleteUtf8Tail(pending_);
  std::string out = pending_.substr(0, ready);
  pending_.erase(0, ready);
  return out;
}

std::string Utf8StreamBuffer::Flush() { return std::exchange(pending_, std::string()); }

}  // namespace dd::model
