#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/tokenizer_test_util.h"
#include "decode-worker/model/unicode_data.h"
#include "gtest/gtest.h"

namespace dd::model {
namespace {

using namespace ::dd::model::testing_util;  // NOLINT(build/namespaces)

// ---------------------------------------------------------------------------------------------
// Large inputs with realistic vocabulary sizes. These check correctness at scale; the time
// they print is informational (speed claims come from benchmarks).

std::string SyntheticEnglish(size_t bytes, uint32_t seed) {
  static const char* kWords[] = {
      "the",      "of",     "and",        "to",      "in",       "a",       "is",     "that",
      "for",      "it",     "as",         "was",     "with",     "be",      "by",     "on",
      "not",      "he",     "this",       "are",     "or",       "his",     "from",   "at",
      "which",    "but",    "have",       "an",      "had",      "they",    "you",    "were",
      "their",    "one",    "all",        "we",      "can",      "her",     "has",    "there",
      "been",     "if",     "more",       "when",    "will",     "would",   "who",    "so",
      "no",       "model",  "attention",  "memory",  "transfer", "predict", "decode", "token",
      "sequence", "cache",  "throughput", "latency", "sparse",   "dense",   "layer",  "buffer",
      "request",  "worker",
  };
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> letter('a', 'z');
  std::geometric_distribution<int> zipfish(0.08);
  std::uniform_int_distribution<int> percent(0, 99);
  std::string text;
  bool capital = true;
  while (text.size() < bytes) {
    std::string word;
    const int r = percent(rng);
    if (r < 70) {
      word = kWords[std::min<size_t>(zipfish(rng), std::size(kWords) - 1)];
    } else if (r < 95) {  // a rarer made-up word
      for (int n = 3 + percent(rng) % 8; n > 0; --n) word.push_back(static_cast<char>(letter(rng)));
    } else {
      word = std::to_string(percent(rng) * 37 + percent(rng));
    }
    if (capital) word[0] = static_cast<char>(std::toupper(word[0]));
    text += word;
    capital = false;
    const int p = percent(rng);
    if (p < 6) {
      text += ". ";
      capital = true;
    } else if (p < 9) {
      text += ", ";
    } else if (p < 10) {
      text += ".\n\n";
      capital = true;
    } else {
      text += ' ';
    }
  }
  return text;
}

// A ~50K-piece SentencePiece vocabulary: bytes, characters, and the most frequent substrings
// (up to 10 characters) of the escaped text, scored by frequency.
TokenizerSpec SyntheticSpmSpec(const std::string& text, size_t vocab_size) {
  std::string escaped;
  for (char c : text) escaped += c == ' ' ? std::string("\u2581") : std::string(1, c);
  std::unordered_map<std::string, int> counts;
  std::vector<size_t> starts;  // character boundaries
  for (size_t pos = 0; pos < escaped.size(); pos += unicode::DecodeUtf8(escaped, pos).len) {
    starts.push_back(pos);
  }
  starts.push_back(escaped.size());
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    for (size_t len = 2; len <= 10 && i + len < starts.size(); ++len) {
      ++counts[escaped.substr(starts[i], starts[i + len] - starts[i])];
    }
  }
  std::vector<std::pair<int, std::string>> ranked;
  for (auto& [piece, count] : counts) ranked.emplace_back(count, piece);
  std::sort(ranked.begin(), ranked.end(), std::greater<>());
  TokenizerSpec spec;
  spec.kind = TokenizerSpec::Kind::kSentencePieceBpe;
  auto add = [&](std::string t, float score, TokenType type) {
    spec.tokens.push_back(std::move(t));
    spec.scores.push_back(score);
    spec.types.push_back(type);
  };
  add("<unk>", 0, TokenType::kUnknown);
  add("<bos>", 0, TokenType::kControl);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    add(name, 0, TokenType::kByte);
  }
  for (const char* c : {"\u2581", ".", ",", "\n"}) add(c, 0, TokenType::kNormal);
  for (char c = 'a'; c <= 'z'; ++c) add(std::string(1, c), 0, TokenType::kNormal);
  for (char c = 'A'; c <= 'Z'; ++c) add(std::string(1, c), 0, TokenType::kNormal);
  for (char c = '0'; c <= '9'; ++c) add(std::string(1, c), 0, TokenType::kNormal);
  for (size_t i = 0; i < ranked.size() && spec.tokens.size() < vocab_size; ++i) {
    add(ranked[i].second, static_cast<float>(std::log(ranked[i].first)) * ranked[i].second.size(),
        TokenType::kNormal);
  }
  for (size_t i = 0; spec.tokens.size() < vocab_size; ++i) {  // pad with never-used pieces
    add("\u2581pad" + std::to_string(i), -100, TokenType::kNormal);
  }
  spec.bos_id = 1;
  spec.unk_id = 0;
  return spec;
}

// A ~50K-token byte-level vocabulary whose merges build the text's pre-tokens left to right,
// most frequent prefixes first (so each merge's left side already exists).
TokenizerSpec SyntheticByteLevelSpec(const std::string& text, size_t vocab_size,
                                     const std::string& pre) {
  std::unordered_map<std::string, int> prefix_counts;
  for (std::string_view word :
       internal::SplitPreTokens(text, *internal::PreTokenizerFromName(pre))) {
    std::string mapped;
    for (unsigned char b : word) mapped += Utf8(internal::ByteToUnicode(b));
    for (size_t len = 2; len <= mapped.size(); ++len) {
      // Only prefixes that end on a character boundary.
      if (len < mapped.size() && (static_cast<unsigned char>(mapped[len]) & 0xC0) == 0x80) continue;
      ++prefix_counts[mapped.substr(0, len)];
    }
  }
  std::vector<std::tuple<int, size_t, std::string>> ranked;
  for (auto& [p, count] : prefix_counts) ranked.emplace_back(-count, p.size(), p);
  std::sort(ranked.begin(), ranked.end());
  TokenizerSpec spec;
  spec.kind = TokenizerSpec::Kind::kByteLevelBpe;
  spec.pre = pre;
  for (int b = 0; b < 256; ++b) spec.tokens.push_back(Utf8(internal::ByteToUnicode(b)));
  std::unordered_map<std::string, bool> known;
  for (const auto& t : spec.tokens) known[t] = true;
  for (const auto& [neg_count, size, p] : ranked) {
    if (spec.tokens.size() >= vocab_size) break;
    // Split off the last character.
    size_t last = p.size() - 1;
    while ((static_cast<unsigned char>(p[last]) & 0xC0) == 0x80) --last;
    const std::string left = p.substr(0, last), right = p.substr(last);
    if (!known.count(left) || !known.count(right) || known.count(p)) continue;
    spec.merges.push_back(left + " " + right);
    spec.tokens.push_back(p);
    known[p] = true;
  }
  for (size_t i = 0; spec.tokens.size() < vocab_size; ++i) {
    spec.tokens.push_back("pad" + std::to_string(i));  // never produced
  }
  return spec;
}

TEST(LargeInputTest, SentencePiece100KB) {
  const std::string text = SyntheticEnglish(100 * 1024, 1);
  auto tok = MustCreate(SyntheticSpmSpec(text, 50000));
  ASSERT_NE(tok, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const Ids ids = tok->Encode(text, true, false);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("[   INFO   ] SPM: %zu bytes -> %zu tokens in %.1f ms (vocab %d)\n", text.size(),
              ids.size(), ms, tok->vocab_size());
  EXPECT_LT(ids.size(), text.size() / 2);  // the merges did real work
  EXPECT_EQ(tok->Decode(ids), text);
}

TEST(LargeInputTest, ByteLevel100KB) {
  const std::string text = SyntheticEnglish(100 * 1024, 2);
  // gpt2: no whole-word shortcut, so every pre-token goes through the merges.
  auto tok = MustCreate(SyntheticByteLevelSpec(text, 50000, "gpt2"));
  ASSERT_NE(tok, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const Ids ids = tok->Encode(text, true, false);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[   INFO   ] byte-level: %zu bytes -> %zu tokens in %.1f ms (vocab %d, %zu merges)\n",
      text.size(), ids.size(), ms, tok->vocab_size(), tok->spec().merges.size());
  EXPECT_LT(ids.size(), text.size() / 3);
  EXPECT_EQ(tok->Decode(ids), text);
}

}  // namespace
}  // namespace dd::model
