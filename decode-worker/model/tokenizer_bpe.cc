// GPT-2 byte-level BPE: pre-tokenizer regexes matched by hand, then merges by rank.
#include <array>
#include <cstdio>
#include <queue>

#include "absl/strings/str_cat.h"
#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/unicode_data.h"
#include "glog/logging.h"

namespace dd::model {
namespace internal {
namespace {

// The printable code points GPT-2 maps bytes to; bytes that are not printable Latin-1 get
// 256, 257, ... in byte order.
struct ByteMap {
  std::array<uint32_t, 256> to_unicode{};
  std::array<int16_t, 256 + 68> to_byte{};  // 68 bytes are remapped above 255
  ByteMap() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_unicode[b] = printable ? static_cast<uint32_t>(b) : next++;
      to_byte[to_unicode[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMap& GetByteMap() {
  static const ByteMap map;
  return map;
}

// Find-all over the pre-tokenizer regexes, written out per alternative. Comments quote the
// alternative each branch implements.
class PreTokenSplitter {
 public:
  PreTokenSplitter(std::string_view text, PreTokenizer kind) : text_(text), kind_(kind) {
    cps_.reserve(text.size());
    offsets_.reserve(text.size() + 1);
    flags_.reserve(text.size());
    for (size_t pos = 0; pos < text.size();) {
      const unicode::Utf8Char c = unicode::DecodeUtf8(text, pos);
      // An invalid byte is >= 0x80, so it never equals the ASCII the regexes look for, and
      // flags 0 makes it an "other" character.
      cps_.push_back(c.cp);
      flags_.push_back(c.valid ? unicode::CodepointFlags(c.cp) : 0);
      offsets_.push_back(static_cast<uint32_t>(pos));
      pos += c.len;
    }
    offsets_.push_back(static_cast<uint32_t>(text.size()));
    end_ = cps_.size();
  }

  std::vector<std::string_view> Split() {
    std::vector<std::string_view> pieces;
    const size_t n = cps_.size();
    if (kind_ == PreTokenizer::kSmollm) {
      // Digits(individual_digits) then the GPT-2 regex: every digit is a piece of its own, and
      // the regex runs on each stretch between digits as if the stretch were the whole text
      // (so "a 1" gives "a", " ", "1": the space cannot join the digit).
      for (size_t i = 0; i < n;) {
        if (flags_[i] & unicode::kNumber) {
          Emit(i, i + 1, &pieces);
          ++i;
          continue;
        }
        size_t e = i;
        while (e < n && !(flags_[e] & unicode::kNumber)) ++e;
        end_ = e;
        SplitRange(i, [this](size_t k) { return MatchGpt2(k); }, &pieces);
        end_ = n;
        i = e;
      }
      return pieces;
    }
    if (kind_ == PreTokenizer::kGpt2) {
      SplitRange(0, [this](size_t k) { return MatchGpt2(k); }, &pieces);
    } else {
      SplitRange(0, [this](size_t k) { return MatchLlama3(k); }, &pieces);
    }
    return pieces;
  }

 private:
  void Emit(size_t i, size_t j, std::vector<std::string_view>* pieces) const {
    pieces->push_back(text_.substr(offsets_[i], offsets_[j] - offsets_[i]));
  }
  // Find-all from i to end_ with one match function.
  template <typename Match>
  void SplitRange(size_t i, Match match, std::vector<std::string_view>* pieces) const {
    while (i < end_) {
      size_t j = match(i);
      if (j <= i) j = i + 1;  // unreachable: the alternatives cover every character
      Emit(i, j, pieces);
      i = j;
    }
  }

  // Characters past end_ do not exist for the matchers (the Digits stage's stretch boundary).
  size_t size() const { return end_; }
  bool Letter(size_t i) const { return i < size() && (flags_[i] & unicode::kLetter); }
  bool Number(size_t i) const { return i < size() && (flags_[i] & unicode::kNumber); }
  bool Space(size_t i) const { return i < size() && (flags_[i] & unicode::kWhitespace); }
  bool Other(size_t i) const { return i < size() && flags_[i] == 0; }  // [^\s\p{L}\p{N}]
  bool Is(size_t i, uint32_t cp) const { return i < size() && cps_[i] == cp; }
  bool IsNewline(size_t i) const { return Is(i, '\r') || Is(i, '\n'); }
  // Simple case folding of what the contraction alternatives can match; U+017F (long s) folds
  // to 's' under Unicode case-insensitive matching.
  uint32_t Lower(size_t i) const {
    const uint32_t c = i < size() ? cps_[i] : 0;
    if (c == 0x17F) return 's';
    return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  }
  template <typename Pred>
  size_t RunEnd(size_t i, Pred pred) const {
    while (pred(i)) ++i;
    return i;
  }

  // 's|'t|'re|'ve|'m|'ll|'d, optionally case-insensitive.
  size_t MatchContraction(size_t i, bool ignore_case) const {
    if (!Is(i, '\'')) return 0;
    auto at = [&](size_t k) { return ignore_case ? Lower(k) : (k < size() ? cps_[k] : 0); };
    const uint32_t a = at(i + 1), b = at(i + 2);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return 0;
  }

  // \s+(?!\S)|\s+ at a whitespace character: a run followed by non-space gives up its last
  // character (which then prefixes the next word), unless that leaves nothing.
  size_t MatchSpaceRun(size_t i) const {
    const size_t end = RunEnd(i, [&](size_t k) { return Space(k); });
    return (end == size() || end - i == 1) ? end : end - 1;
  }

  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  size_t MatchGpt2(size_t i) const {
    if (size_t j = MatchContraction(i, /*ignore_case=*/false)) return j;
    const size_t k = Is(i, ' ') ? i + 1 : i;
    if (Letter(k)) return RunEnd(k, [&](size_t m) { return Letter(m); });
    if (Number(k)) return RunEnd(k, [&](size_t m) { return Number(m); });
    if (Other(k)) return RunEnd(k, [&](size_t m) { return Other(m); });
    if (Space(i)) return MatchSpaceRun(i);
    return i + 1;
  }

  // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  // \s*[\r\n]+|\s+(?!\S)|\s+        (qwen2: \p{N} instead of \p{N}{1,3})
  size_t MatchLlama3(size_t i) const {
    if (size_t j = MatchContraction(i, /*ignore_case=*/true)) return j;
    auto letters = [&](size_t m) { return Letter(m); };
    if (Letter(i)) return RunEnd(i, letters);
    if (!IsNewline(i) && !Number(i) && Letter(i + 1)) return RunEnd(i + 1, letters);
    if (Number(i)) {
      const size_t max_len = kind_ == PreTokenizer::kQwen2 ? 1 : 3;
      size_t j = i;
      while (j - i < max_len && Number(j)) ++j;
      return j;
    }
    const size_t k = (Is(i, ' ') && Other(i + 1)) ? i + 1 : i;
    if (Other(k)) {
      const size_t j = RunEnd(k, [&](size_t m) { return Other(m); });
      return RunEnd(j, [&](size_t m) { return IsNewline(m); });
    }
    if (Space(i)) {
      // \s*[\r\n]+ : the whitespace run up to and including its last newline.
      const size_t end = RunEnd(i, [&](size_t m) { return Space(m); });
      for (size_t m = end; m > i; --m) {
        if (IsNewline(m - 1)) return m;
      }
      return MatchSpaceRun(i);
    }
    return i + 1;
  }

  std::string_view text_;
  PreTokenizer kind_;
  std::vector<uint32_t> cps_;
  std::vector<uint32_t> offsets_;  // byte offset of each character, plus text.size()
  std::vector<uint8_t> flags_;
  size_t end_ = 0;
};

}  // namespace

uint32_t ByteToUnicode(uint8_t byte) { return GetByteMap().to_unicode[byte]; }

std::optional<PreTokenizer> PreTokenizerFromName(std::string_view name) {
  if (name == "default" || name == "gpt2" || name == "gpt-2") return PreTokenizer::kGpt2;
  if (name == "llama3" || name == "llama-bpe" || name == "llama-v3") return PreTokenizer::kLlama3;
  if (name == "qwen2") return PreTokenizer::kQwen2;
  if (name == "smollm") return PreTokenizer::kSmollm;
  return std::nullopt;
}

std::vector<std::string_view> SplitPreTokens(std::string_view text, PreTokenizer kind) {
  return PreTokenSplitter(text, kind).Split();
}

}  // namespace internal

namespace {

struct MergeCandidate {
  int32_t rank;
  int32_t left;
  int32_t right;
  int32_t left_id;
  int32_t right_id;
  int32_t result;
};

struct MergeOrder {
  bool operator()(const MergeCandidate& a, const MergeCandidate& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

std::string MapBytes(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) unicode::AppendUtf8(internal::ByteToUnicode(b), &out);
  return out;
}

}  // namespace

absl::Status Tokenizer::InitByteLevel() {
  const auto pre = internal::PreTokenizerFromName(spec_.pre);
  if (!pre) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer spec: 'pre' = '", spec_.pre,
                     "' is not a supported pre-tokenizer (default, gpt2, gpt-2, llama3, llama-bpe, "
                     "llama-v3, qwen2, smollm)"));
  }
  pre_ = static_cast<int>(*pre);
  ignore_merges_ = *pre == internal::PreTokenizer::kLlama3;  // as in Llama-3's tokenizer.json
  const size_t n = spec_.tokens.size();
  const auto& to_byte = internal::GetByteMap().to_byte;
  piece_to_id_.reserve(n);
  rendered_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& text = spec_.tokens[i];
    const TokenType type = spec_.types[i];
    if (IsMergeable(static_cast<int32_t>(i)) && !text.empty()) {
      piece_to_id_.try_emplace(text, static_cast<int32_t>(i));
    }
    if (type == TokenType::kControl || type == TokenType::kUnknown) continue;
    if (type == TokenType::kUserDefined) {
      rendered_[i] = text;  // matched on raw text, so rendered as raw text
      continue;
    }
    std::string& out = rendered_[i];
    for (size_t pos = 0; pos < text.size();) {
      const unicode::Utf8Char c = unicode::DecodeUtf8(text, pos);
      if (c.valid && c.cp < to_byte.size() && to_byte[c.cp] >= 0) {
        out.push_back(static_cast<char>(to_byte[c.cp]));
      } else {
        out.append(text, pos, c.len);  // not a mapped byte: keep the character itself
      }
      pos += c.len;
    }
  }
  // Some vocabularies lack a few byte tokens (SmolLM2: six control characters and bytes that
  // never occur in UTF-8); such a byte is dropped when encoding, as llama.cpp does. A missing
  // printable ASCII byte means a broken vocabulary.
  for (int b = 0; b < 256; ++b) {
    std::string piece;
    unicode::AppendUtf8(internal::ByteToUnicode(static_cast<uint8_t>(b)), &piece);
    auto it = piece_to_id_.find(piece);
    byte_token_[b] = -1;
    if (it == piece_to_id_.end() && (b < 0x20 || b > 0x7e)) continue;
    if (it == piece_to_id_.end()) {
      char name[8];
      std::snprintf(name, sizeof(name), "0x%02X", b);
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer spec: byte-level vocabulary has no normal token for byte ", name,
                       " ('", piece, "')"));
    }
    byte_token_[b] = it->second;
  }

  absl::flat_hash_map<std::string_view, int32_t> any_token;  // built only if needed
  size_t skipped = 0;
  merges_.reserve(spec_.merges.size());
  for (size_t rank = 0; rank < spec_.merges.size(); ++rank) {
    const std::string& merge = spec_.merges[rank];
    auto error = [&](absl::string_view what) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer spec: 'merges[", rank, "]' = '", merge, "': ", what));
    };
    // Split at the first space that leaves known tokens on both sides.
    int32_t left = -1, right = -1;
    size_t space = merge.find(' ');
    if (space == std::string::npos) return error("not of the form 'left right'");
    for (; space != std::string::npos; space = merge.find(' ', space + 1)) {
      const std::string_view l = std::string_view(merge).substr(0, space);
      const std::string_view r = std::string_view(merge).substr(space + 1);
      auto li = piece_to_id_.find(l), ri = piece_to_id_.find(r);
      if (li != piece_to_id_.end() && ri != piece_to_id_.end()) {
        left = li->second, right = ri->second;
        break;
      }
    }
    if (left < 0) {
      const size_t first = merge.find(' ');
      const std::string_view l = std::string_view(merge).substr(0, first);
      const std::string_view r = std::string_view(merge).substr(first + 1);
      return error(
          absl::StrCat("unknown token '", std::string(piece_to_id_.contains(l) ? r : l), "'"));
    }
    const std::string merged = spec_.tokens[left] + spec_.tokens[right];
    auto it = piece_to_id_.find(merged);
    if (it == piece_to_id_.end()) {
      if (any_token.empty()) {
        for (size_t i = 0; i < n; ++i) any_token.try_emplace(spec_.tokens[i], i);
      }
      if (!any_token.contains(merged)) {
        return error(absl::StrCat("result '", merged, "' is not in the vocabulary"));
      }
      ++skipped;  // the result is a special token; plain text must never produce it
      continue;
    }
    const uint64_t key = (static_cast<uint64_t>(left) << 32) | static_cast<uint32_t>(right);
    merges_.try_emplace(key, Merge{static_cast<int32_t>(rank), it->second});
  }
  if (skipped > 0) {
    LOG(WARNING) << "tokenizer: ignored " << skipped
                 << " merges whose result is a control/user-defined token";
  }
  return absl::OkStatus();
}

void Tokenizer::EncodeByteLevel(std::string_view text, std::vector<int32_t>* out) const {
  for (std::string_view word :
       internal::SplitPreTokens(text, static_cast<internal::PreTokenizer>(pre_))) {
    EncodeByteLevelWord(word, out);
  }
}

void Tokenizer::EncodeByteLevelWord(std::string_view word, std::vector<int32_t>* out) const {
  if (word.size() == 1) {
    if (const int32_t id = byte_token_[static_cast<unsigned char>(word[0])]; id >= 0) out->push_back(id);
    return;
  }
  if (ignore_merges_) {
    auto it = piece_to_id_.find(MapBytes(word));
    if (it != piece_to_id_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  const auto n = static_cast<int32_t>(word.size());
  std::vector<int32_t> ids(n), next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) {
    ids[i] = byte_token_[static_cast<unsigned char>(word[i])];
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  std::vector<MergeCandidate> storage;
  storage.reserve(n);
  std::priority_queue<MergeCandidate, std::vector<MergeCandidate>, MergeOrder> heap(
      MergeOrder(), std::move(storage));
  auto try_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const uint64_t key =
        (static_cast<uint64_t>(ids[left]) << 32) | static_cast<uint32_t>(ids[right]);
    auto it = merges_.find(key);
    if (it == merges_.end()) return;
    heap.push({it->second.rank, left, right, ids[left], ids[right], it->second.result});
  };
  for (int32_t i = 1; i < n; ++i) try_add(i - 1, i);
  while (!heap.empty()) {
    const MergeCandidate top = heap.top();
    heap.pop();
    // Stale unless both symbols are alive (ids >= 0), adjacent and unchanged.
    if (ids[top.left] != top.left_id || ids[top.right] != top.right_id ||
        next[top.left] != top.right) {
      continue;
    }
    ids[top.left] = top.result;
    ids[top.right] = -1;
    next[top.left] = next[top.right];
    if (next[top.right] >= 0) prev[next[top.right]] = top.left;
    try_add(prev[top.left], top.left);
    try_add(top.left, next[top.left]);
  }
  // A byte without a token (ids -1 from the start, never merged) is dropped.
  for (int32_t i = 0; i >= 0; i = next[i]) {
    if (ids[i] >= 0) out->push_back(ids[i]);
  }
}

}  // namespace dd::model
