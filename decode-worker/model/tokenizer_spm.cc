// SentencePiece-style BPE with byte fallback (the algorithm of llama.cpp's SPM tokenizer).
//
// The text is escaped (' ' -> '▁') and split into UTF-8 characters, kept as a linked list of
// symbols over the escaped buffer. A max-heap holds every adjacent pair whose concatenation is a
// vocabulary piece, keyed by that piece's score (ties: leftmost). Popping the best pair merges
// it and offers the two new neighbouring pairs; stale entries are recognised by the symbols'
// lengths. O(n log n) in the number of characters.
#include <cstdio>
#include <queue>

#include "absl/strings/str_cat.h"
#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/unicode_data.h"

namespace dd::model {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581 '▁'

// "<0xAB>" -> 0xAB, or -1.
int ParseByteToken(std::string_view text) {
  if (text.size() != 6 || text.substr(0, 3) != "<0x" || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    value <<= 4;
    if (c >= '0' && c <= '9') {
      value |= c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value |= c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value |= c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

struct Symbol {
  uint32_t start;  // offset in the escaped text
  uint32_t len;    // 0 once merged into its left neighbour
  int32_t prev;
  int32_t next;
  bool frozen;  // a literal U+2581 from the input: never merged, always emitted as bytes
  bool space;   // an escaped ' ' that has not been merged
};

struct Bigram {
  float score;
  int32_t left;
  int32_t right;
  uint32_t len;
};

struct BigramOrder {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

absl::Status Tokenizer::InitSpm() {
  const size_t n = spec_.tokens.size();
  byte_token_.fill(-1);
  piece_to_id_.reserve(n);
  rendered_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    const std::string& text = spec_.tokens[i];
    const TokenType type = spec_.types[i];
    if (type == TokenType::kByte) {
      const int byte = ParseByteToken(text);
      if (byte < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer spec: 'tokens[", i, "]' = '", text,
                         "' has type BYTE but is not of the form <0xXX>"));
      }
      if (byte_token_[byte] < 0) byte_token_[byte] = id;
      rendered_[i] = std::string(1, static_cast<char>(byte));
      continue;
    }
    if (IsMergeable(id) && !text.empty()) piece_to_id_.try_emplace(text, id);
    if (type == TokenType::kControl || type == TokenType::kUnknown ||
        type == TokenType::kUserDefined) {
      // User-defined tokens are matched on raw text, so they render as raw text.
      if (type == TokenType::kUserDefined) rendered_[i] = text;
      continue;
    }
    std::string& out = rendered_[i];
    for (size_t pos = 0; pos < text.size();) {
      if (text.compare(pos, kSpace.size(), kSpace) == 0) {
        out.push_back(' ');
        pos += kSpace.size();
      } else {
        out.push_back(text[pos++]);
      }
    }
  }
  // Byte fallback needs all 256 byte tokens; without them, unknown characters become unk_id.
  for (int b = 0; b < 256 && spec_.unk_id < 0; ++b) {
    if (byte_token_[b] >= 0) continue;
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer spec: SentencePiece vocabulary has no byte-fallback token ", name,
                     " (type BYTE) and no 'unk_id' to use instead"));
  }
  return absl::OkStatus();
}

void Tokenizer::EncodeSpm(std::string_view text, bool space_prefix,
                          std::vector<int32_t>* out) const {
  std::string escaped;
  escaped.reserve(text.size() + text.size() / 4 + 4);
  std::vector<Symbol> symbols;
  symbols.reserve(text.size() + 1);
  auto add_symbol = [&](std::string_view bytes, bool frozen, bool space) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({static_cast<uint32_t>(escaped.size()), static_cast<uint32_t>(bytes.size()),
                       index - 1, index + 1, frozen, space});
    escaped.append(bytes);
  };
  if (space_prefix) add_symbol(kSpace, false, true);
  for (size_t pos = 0; pos < text.size();) {
    if (text[pos] == ' ') {
      add_symbol(kSpace, false, true);
      ++pos;
      continue;
    }
    const unicode::Utf8Char c = unicode::DecodeUtf8(text, pos);
    add_symbol(text.substr(pos, c.len), c.valid && c.cp == 0x2581, false);
    pos += c.len;
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  std::vector<Bigram> heap_storage;
  heap_storage.reserve(symbols.size() * 2);
  std::priority_queue<Bigram, std::vector<Bigram>, BigramOrder> heap(BigramOrder(),
                                                                     std::move(heap_storage));
  auto try_add = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const Symbol& l = symbols[left];
    const Symbol& r = symbols[right];
    if (l.frozen || r.frozen) return;
    auto it = piece_to_id_.find(std::string_view(escaped).substr(l.start, l.len + r.len));
    if (it == piece_to_id_.end()) return;
    heap.push({spec_.scores[it->second], left, right, l.len + r.len});
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add(i - 1, i);

  while (!heap.empty()) {
    const Bigram top = heap.top();
    heap.pop();
    Symbol& l = symbols[top.left];
    Symbol& r = symbols[top.right];
    if (l.len == 0 || r.len == 0 || l.next != top.right || l.len + r.len != top.len) continue;
    l.len += r.len;
    l.space = false;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) symbols[r.next].prev = top.left;
    try_add(l.prev, top.left);
    try_add(top.left, l.next);
  }

  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    const std::string_view piece = std::string_view(escaped).substr(s.start, s.len);
    if (!s.frozen) {
      auto it = piece_to_id_.find(piece);
      if (it != piece_to_id_.end()) {
        out->push_back(it->second);
        continue;
      }
    }
    // Byte fallback. An escaped space falls back to the byte of ' ', not to the bytes of '▁'.
    std::string_view bytes = s.space ? std::string_view(" ") : piece;
    bool all_bytes = true;
    for (unsigned char b : bytes) all_bytes = all_bytes && byte_token_[b] >= 0;
    if (!all_bytes) {
      out->push_back(spec_.unk_id);
      continue;
    }
    for (unsigned char b : bytes) out->push_back(byte_token_[b]);
  }
}

}  // namespace dd::model
