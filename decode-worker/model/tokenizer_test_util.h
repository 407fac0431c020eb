// Helpers shared by the tokenizer tests (tokenizer_test.cc, tokenizer_roundtrip_test.cc,
// hf_tokenizer_json_test.cc, tokenizer_large_input_test.cc): hand-made vocabularies and small
// conveniences. Header-only (everything is inline), so each test source may include it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/unicode_data.h"
#include "gtest/gtest.h"

namespace dd::model::testing_util {

using Ids = std::vector<int32_t>;

inline std::unique_ptr<Tokenizer> MustCreate(TokenizerSpec spec) {
  auto tokenizer = Tokenizer::Create(std::move(spec));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(*tokenizer) : nullptr;
}

inline std::string Utf8(uint32_t cp) {
  std::string s;
  unicode::AppendUtf8(cp, &s);
  return s;
}

// ---------------------------------------------------------------------------------------------
// A hand-made SentencePiece vocabulary. Merges worked by hand in tokenizer_test.cc.

inline constexpr int32_t kUnk = 0, kBos = 1, kEos = 2, kStartTurn = 3, kEndTurn = 4, kBr = 5;
inline constexpr int32_t Byte(int b) { return 6 + b; }  // <0x00>..<0xFF> are ids 6..261
// clang-format off
enum SpmId : int32_t {
  kSp = 262, kH, kE, kL, kO, kW, kR, kD, kHe, kLl, kLlo, kEl, kLo, kSpW, kOr, kSpWor, kLd, kA,
  kAa, kSpSp
};
// clang-format on

inline TokenizerSpec SpmSpec() {
  TokenizerSpec spec;
  spec.kind = TokenizerSpec::Kind::kSentencePieceBpe;
  auto add = [&](std::string text, float score, TokenType type) {
    spec.tokens.push_back(std::move(text));
    spec.scores.push_back(score);
    spec.types.push_back(type);
  };
  add("<unk>", 0, TokenType::kUnknown);
  add("<bos>", 0, TokenType::kControl);
  add("<eos>", 0, TokenType::kControl);
  add("<start_of_turn>", 0, TokenType::kControl);
  add("<end_of_turn>", 0, TokenType::kControl);
  add("<br>", 0, TokenType::kUserDefined);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    add(name, 0, TokenType::kByte);
  }
  const std::pair<const char*, float> pieces[] = {
      {"\u2581", -1},    {"h", -1},  {"e", -1},  {"l", -1},       {"o", -1},
      {"w", -1},         {"r", -1},  {"d", -1},  {"he", -5},      {"ll", -2},
      {"llo", -1.5},     {"el", -3}, {"lo", -6}, {"\u2581w", -4}, {"or", -4},
      {"\u2581wor", -3}, {"ld", -7}, {"a", -1},  {"aa", -2},      {"\u2581\u2581", -8},
  };
  for (const auto& [text, score] : pieces) add(text, score, TokenType::kNormal);
  EXPECT_EQ(spec.tokens.size(), static_cast<size_t>(kSpSp + 1));
  spec.bos_id = kBos;
  spec.eos_id = kEos;
  spec.unk_id = kUnk;
  spec.eog_ids = {kEndTurn};
  spec.add_bos = true;
  return spec;
}

// ---------------------------------------------------------------------------------------------
// A hand-made byte-level vocabulary: ids 0..255 are the bytes (mapped), then merged pieces.

// clang-format off
enum BlId : int32_t {
  kGt = 256, kBlHe, kGthe, kIn, kGin, kTh, kThe, kGG, k12, kEndOfText, kImEnd, kUd
};
// clang-format on

inline TokenizerSpec ByteLevelSpec(std::string pre) {
  TokenizerSpec spec;
  spec.kind = TokenizerSpec::Kind::kByteLevelBpe;
  spec.pre = std::move(pre);
  for (int b = 0; b < 256; ++b) spec.tokens.push_back(Utf8(internal::ByteToUnicode(b)));
  spec.types.assign(256, TokenType::kNormal);
  const std::pair<const char*, const char*> merges[] = {
      {"\u0120", "t"}, {"h", "e"},  {"\u0120t", "he"},    {"i", "n"}, {"\u0120", "in"},
      {"t", "h"},      {"th", "e"}, {"\u0120", "\u0120"}, {"1", "2"},
  };
  for (const auto& [l, r] : merges) {
    spec.merges.push_back(std::string(l) + " " + r);
    spec.tokens.push_back(std::string(l) + r);
    spec.types.push_back(TokenType::kNormal);
  }
  spec.tokens.push_back("<|endoftext|>");
  spec.types.push_back(TokenType::kControl);
  spec.tokens.push_back("<|im_end|>");
  spec.types.push_back(TokenType::kControl);
  spec.tokens.push_back("<ud>");
  spec.types.push_back(TokenType::kUserDefined);
  EXPECT_EQ(spec.tokens.size(), static_cast<size_t>(kUd + 1));
  spec.eos_id = kEndOfText;
  spec.eog_ids = {kImEnd};
  return spec;
}

}  // namespace dd::model::testing_util
