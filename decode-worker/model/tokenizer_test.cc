#include "decode-worker/model/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <tuple>
#include <unordered_map>

#include "decode-worker/model/unicode_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dd::model {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using ::testing::Not;
using Json = nlohmann::json;
using Ids = std::vector<int32_t>;

std::unique_ptr<Tokenizer> MustCreate(TokenizerSpec spec) {
  auto tokenizer = Tokenizer::Create(std::move(spec));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(*tokenizer) : nullptr;
}

std::string Utf8(uint32_t cp) {
  std::string s;
  unicode::AppendUtf8(cp, &s);
  return s;
}

// ---------------------------------------------------------------------------------------------
// A hand-made SentencePiece vocabulary. Merges worked by hand in the tests below.

constexpr int32_t kUnk = 0, kBos = 1, kEos = 2, kStartTurn = 3, kEndTurn = 4, kBr = 5;
constexpr int32_t Byte(int b) { return 6 + b; }  // <0x00>..<0xFF> are ids 6..261
// clang-format off
enum SpmId : int32_t {
  kSp = 262, kH, kE, kL, kO, kW, kR, kD, kHe, kLl, kLlo, kEl, kLo, kSpW, kOr, kSpWor, kLd, kA,
  kAa, kSpSp
};
// clang-format on

TokenizerSpec SpmSpec() {
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

TEST(SpmTokenizerTest, MergesByScoreNotByPosition) {
  auto tok = MustCreate(SpmSpec());
  // "hello▁world": ll(-2) first, then llo(-1.5); ▁w and or tie at -4 (leftmost first), then
  // ▁wor(-3); he(-5) and ld(-7) last. el(-3) and lo(-6) went stale.
  EXPECT_THAT(tok->Encode("hello world", false, false), ElementsAre(kHe, kLlo, kSpWor, kLd));
  EXPECT_EQ(tok->Decode(tok->Encode("hello world", false, false)), "hello world");
}

TEST(SpmTokenizerTest, EqualScoresMergeLeftmostFirst) {
  auto tok = MustCreate(SpmSpec());
  EXPECT_THAT(tok->Encode("aaa", false, false), ElementsAre(kAa, kA));
  EXPECT_THAT(tok->Encode("aaaa", false, false), ElementsAre(kAa, kAa));
}

TEST(SpmTokenizerTest, SpacesBecomeMetaspacePieces) {
  auto tok = MustCreate(SpmSpec());
  EXPECT_THAT(tok->Encode("a  a", false, false), ElementsAre(kA, kSpSp, kA));
  EXPECT_THAT(tok->Encode(" a", false, false), ElementsAre(kSp, kA));
  EXPECT_EQ(tok->Decode({kA, kSpSp, kA}), "a  a");
}

TEST(SpmTokenizerTest, UnknownCharactersFallBackToBytes) {
  auto tok = MustCreate(SpmSpec());
  EXPECT_THAT(tok->Encode("hi", false, false), ElementsAre(kH, Byte('i')));
  EXPECT_THAT(tok->Encode("\xC3\xA9", false, false), ElementsAre(Byte(0xC3), Byte(0xA9)));
  EXPECT_THAT(tok->Encode("\xF0\x9F\x98\x80", false, false),  // U+1F600
              ElementsAre(Byte(0xF0), Byte(0x9F), Byte(0x98), Byte(0x80)));
  // Invalid UTF-8 is encoded byte by byte.
  EXPECT_THAT(tok->Encode("a\xFF\xC3", false, false), ElementsAre(kA, Byte(0xFF), Byte(0xC3)));
  EXPECT_EQ(tok->Decode({kA, Byte(0xFF), Byte(0xC3)}), "a\xFF\xC3");
}

TEST(SpmTokenizerTest, LiteralMetaspaceCharacterIsEncodedAsBytes) {
  auto tok = MustCreate(SpmSpec());
  // A '▁' piece would decode as ' ', so the literal character goes out as its three bytes.
  EXPECT_THAT(tok->Encode("a\u2581", false, false),
              ElementsAre(kA, Byte(0xE2), Byte(0x96), Byte(0x81)));
  EXPECT_EQ(tok->Decode(tok->Encode("\u2581w \u2581", false, false)), "\u2581w \u2581");
}

TEST(SpmTokenizerTest, BosIsPrependedOnRequestAndHiddenInDecode) {
  auto tok = MustCreate(SpmSpec());
  EXPECT_THAT(tok->Encode("he", true, false), ElementsAre(kBos, kHe));
  EXPECT_THAT(tok->Encode("", true, false), ElementsAre(kBos));
  EXPECT_THAT(tok->Encode("", false, false), ElementsAre());
  EXPECT_EQ(tok->Decode({kBos, kHe}), "he");
  EXPECT_EQ(tok->Decode({kBos, kHe}, /*render_special=*/true), "<bos>he");
  EXPECT_EQ(tok->Decode({kHe, 99999, -1}), "he");  // out-of-range ids render as nothing
}

TEST(SpmTokenizerTest, ControlTokensAreParsedOnlyWithParseSpecial) {
  auto tok = MustCreate(SpmSpec());
  const std::string text = "<start_of_turn>hello<end_of_turn>";
  EXPECT_THAT(tok->Encode(text, false, true), ElementsAre(kStartTurn, kHe, kLlo, kEndTurn));
  const Ids plain = tok->Encode(text, false, false);
  EXPECT_THAT(plain, Not(::testing::Contains(kStartTurn)));
  EXPECT_THAT(plain, Not(::testing::Contains(kEndTurn)));
  EXPECT_EQ(tok->Decode(plain), text);
  EXPECT_EQ(tok->Decode(tok->Encode(text, false, true)), "hello");
  EXPECT_EQ(tok->Decode(tok->Encode(text, false, true), true), text);
}

TEST(SpmTokenizerTest, UserDefinedTokensAreAlwaysMatched) {
  auto tok = MustCreate(SpmSpec());
  EXPECT_THAT(tok->Encode("he<br>he", false, false), ElementsAre(kHe, kBr, kHe));
  EXPECT_THAT(tok->Encode("he<br>he", false, true), ElementsAre(kHe, kBr, kHe));
  EXPECT_EQ(tok->Decode({kHe, kBr, kHe}), "he<br>he");
}

TEST(SpmTokenizerTest, SpecialMatchingIsLongestFirst) {
  TokenizerSpec spec = SpmSpec();
  spec.tokens.push_back("<br>x");
  spec.scores.push_back(0);
  spec.types.push_back(TokenType::kUserDefined);
  const int32_t br_x = static_cast<int32_t>(spec.tokens.size()) - 1;
  auto tok = MustCreate(std::move(spec));
  EXPECT_THAT(tok->Encode("<br>xa<br>a", false, false), ElementsAre(br_x, kA, kBr, kA));
}

TEST(SpmTokenizerTest, SpacePrefixIsAddedBeforeLeadingTextAndStrippedByDecode) {
  TokenizerSpec spec = SpmSpec();
  spec.add_space_prefix = true;
  auto tok = MustCreate(std::move(spec));
  EXPECT_THAT(tok->Encode("world", false, false), ElementsAre(kSpWor, kLd));
  EXPECT_EQ(tok->Decode({kSpWor, kLd}), "world");
  EXPECT_EQ(tok->Decode({kBos, kSpWor, kLd}), "world");
  // "▁▁world": ▁w(-4) beats ▁▁(-8), leaving a lone ▁ whose space Decode strips.
  EXPECT_THAT(tok->Encode(" world", false, false), ElementsAre(kSp, kSpWor, kLd));
  EXPECT_EQ(tok->Decode({kSp, kSpWor, kLd}), " world");
  // No prefix after a special token at the start: "world" without ▁ is w + or + ld.
  EXPECT_THAT(tok->Encode("<start_of_turn>world", false, true),
              ElementsAre(kStartTurn, kW, kOr, kLd));
  EXPECT_EQ(tok->Decode({kStartTurn, kW, kOr, kLd}, true), "<start_of_turn>world");
}

TEST(SpmTokenizerTest, EndOfGenerationIncludesEos) {
  auto tok = MustCreate(SpmSpec());
  EXPECT_TRUE(tok->IsEndOfGeneration(kEos));
  EXPECT_TRUE(tok->IsEndOfGeneration(kEndTurn));
  EXPECT_FALSE(tok->IsEndOfGeneration(kStartTurn));
  EXPECT_FALSE(tok->IsEndOfGeneration(-1));
  EXPECT_FALSE(tok->IsEndOfGeneration(1 << 20));
  EXPECT_EQ(tok->vocab_size(), kSpSp + 1);
  EXPECT_EQ(tok->bos_id(), kBos);
  EXPECT_EQ(tok->eos_id(), kEos);
  EXPECT_TRUE(tok->add_bos());
}

TEST(SpmTokenizerTest, WellKnownEndOfTurnTokensEndGeneration) {
  TokenizerSpec spec = SpmSpec();
  spec.eog_ids.clear();
  spec.eos_id = -1;
  spec.tokens[kEos] = "</s>";
  spec.types[kEos] = TokenType::kNormal;  // plain text that happens to look like an eos
  auto tok = MustCreate(std::move(spec));
  EXPECT_TRUE(tok->IsEndOfGeneration(kEndTurn));  // "<end_of_turn>", control
  EXPECT_FALSE(tok->IsEndOfGeneration(kEos));
  EXPECT_THAT(tok->spec().eog_ids, ElementsAre(kEndTurn));
}

TEST(SpmTokenizerTest, WithoutByteTokensUnknownCharactersBecomeUnk) {
  TokenizerSpec spec;
  spec.tokens = {"<unk>", "a", "b"};
  spec.scores = {0, 0, 0};
  spec.types = {TokenType::kUnknown, TokenType::kNormal, TokenType::kNormal};
  spec.unk_id = 0;
  auto tok = MustCreate(std::move(spec));
  EXPECT_THAT(tok->Encode("a\xC3\xA9"
                          "b",
                          false, false),
              ElementsAre(1, 0, 2));
}

// ---------------------------------------------------------------------------------------------
// A hand-made byte-level vocabulary: ids 0..255 are the bytes (mapped), then merged pieces.

// clang-format off
enum BlId : int32_t {
  kGt = 256, kBlHe, kGthe, kIn, kGin, kTh, kThe, kGG, k12, kEndOfText, kImEnd, kUd
};
// clang-format on

TokenizerSpec ByteLevelSpec(std::string pre) {
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

TEST(ByteLevelTokenizerTest, MergesByRank) {
  auto tok = MustCreate(ByteLevelSpec("gpt2"));
  // "the": h+e (rank 1) beats t+h (rank 5), and no merge joins t and he.
  // " in": i+n, then Ġ+in. " the": Ġ+t, h+e, then Ġt+he.
  EXPECT_THAT(tok->Encode("the in the", false, false), ElementsAre('t', kBlHe, kGin, kGthe));
  EXPECT_THAT(tok->Encode("a   b", false, false), ElementsAre('a', kGG, ' ', 'b'));
  EXPECT_EQ(tok->Decode({'t', kBlHe, kGin, kGthe}), "the in the");
}

TEST(ByteLevelTokenizerTest, Llama3EmitsWholeWordsThatAreInTheVocabulary) {
  auto tok = MustCreate(ByteLevelSpec("llama3"));
  // ignore_merges: "the" is a token, so it is used even though the merges cannot build it.
  EXPECT_THAT(tok->Encode("the in the", false, false), ElementsAre(kThe, kGin, kGthe));
}

TEST(ByteLevelTokenizerTest, DigitsFollowThePreTokenizer) {
  EXPECT_THAT(MustCreate(ByteLevelSpec("gpt2"))->Encode("1212", false, false),
              ElementsAre(k12, k12));
  EXPECT_THAT(MustCreate(ByteLevelSpec("llama-bpe"))->Encode("1212", false, false),
              ElementsAre(k12, '1', '2'));
  EXPECT_THAT(MustCreate(ByteLevelSpec("qwen2"))->Encode("1212", false, false),
              ElementsAre('1', '2', '1', '2'));
}

TEST(ByteLevelTokenizerTest, NonAsciiBytesUseTheirMappedTokens) {
  auto tok = MustCreate(ByteLevelSpec("gpt2"));
  EXPECT_THAT(tok->Encode("\xC3\xA9", false, false), ElementsAre(0xC3, 0xA9));
  EXPECT_THAT(tok->Encode("a\n", false, false), ElementsAre('a', '\n'));
  EXPECT_THAT(tok->Encode("\xFF", false, false), ElementsAre(0xFF));
  EXPECT_EQ(tok->TokenBytes(0xC3), "\xC3");
  EXPECT_EQ(tok->TokenBytes(' '), " ");
}

TEST(ByteLevelTokenizerTest, SpecialTokens) {
  auto tok = MustCreate(ByteLevelSpec("qwen2"));
  EXPECT_THAT(tok->Encode("<|im_end|>the", false, true), ElementsAre(kImEnd, 't', kBlHe));
  const Ids plain = tok->Encode("<|im_end|>the", false, false);
  EXPECT_THAT(plain, Not(::testing::Contains(kImEnd)));
  EXPECT_EQ(tok->Decode(plain), "<|im_end|>the");
  EXPECT_THAT(tok->Encode("a<ud>b", false, false), ElementsAre('a', kUd, 'b'));
  EXPECT_EQ(tok->Decode({kImEnd, 'a'}), "a");
  EXPECT_EQ(tok->Decode({kImEnd, 'a'}, true), "<|im_end|>a");
  EXPECT_EQ(tok->TokenBytes(kImEnd), "");
  EXPECT_EQ(tok->TokenBytes(kImEnd, true), "<|im_end|>");
  EXPECT_TRUE(tok->IsEndOfGeneration(kImEnd));
  EXPECT_TRUE(tok->IsEndOfGeneration(kEndOfText));
  // No BOS in this vocabulary: add_bos has nothing to add.
  EXPECT_THAT(tok->Encode("a", true, false), ElementsAre('a'));
}

TEST(ByteLevelTokenizerTest, MergesWhoseResultIsSpecialAreIgnored) {
  TokenizerSpec spec = ByteLevelSpec("gpt2");
  const auto add = [&](const char* left, const char* right, TokenType type) {
    spec.merges.push_back(std::string(left) + " " + right);
    spec.tokens.push_back(std::string(left) + right);
    spec.types.push_back(type);
    return static_cast<int32_t>(spec.tokens.size()) - 1;
  };
  const int32_t lt_lt = add("<", "<", TokenType::kNormal);
  const int32_t gt_gt = add(">", ">", TokenType::kNormal);
  const int32_t control = add("<<", ">>", TokenType::kControl);  // a merge must not build this
  auto tok = MustCreate(std::move(spec));
  EXPECT_THAT(tok->Encode("<<>>", false, false), ElementsAre(lt_lt, gt_gt));
  EXPECT_THAT(tok->Encode("<<>>", false, true), ElementsAre(control));
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer splits (cross-checked against the regexes with Python's `regex` module).

std::vector<std::string> Split(std::string_view text, internal::PreTokenizer kind) {
  std::vector<std::string> out;
  for (std::string_view piece : internal::SplitPreTokens(text, kind)) out.emplace_back(piece);
  return out;
}

TEST(PreTokenizerTest, Gpt2) {
  const auto k = internal::PreTokenizer::kGpt2;
  EXPECT_THAT(Split("Hello world's  test\n\n 123abc", k),
              ElementsAre("Hello", " world", "'s", " ", " test", "\n\n", " 123", "abc"));
  EXPECT_THAT(Split("HELLO'S", k), ElementsAre("HELLO", "'", "S"));
  EXPECT_THAT(Split("a.\n\nb", k), ElementsAre("a", ".", "\n", "\n", "b"));
  EXPECT_THAT(Split("x  ", k), ElementsAre("x", "  "));
  EXPECT_THAT(Split("a\xFF"
                    "b",
                    k),
              ElementsAre("a", "\xFF", "b"));
  EXPECT_THAT(Split("", k), ElementsAre());
}

TEST(PreTokenizerTest, Llama3) {
  const auto k = internal::PreTokenizer::kLlama3;
  EXPECT_THAT(Split("Hello world's  test\n\n 123abc", k),
              ElementsAre("Hello", " world", "'s", " ", " test", "\n\n", " ", "123", "abc"));
  EXPECT_THAT(Split("HELLO'S", k), ElementsAre("HELLO", "'S"));
  EXPECT_THAT(Split("a.\n\nb", k), ElementsAre("a", ".\n\n", "b"));
  EXPECT_THAT(Split("x  \n  y", k), ElementsAre("x", "  \n", " ", " y"));
  EXPECT_THAT(Split("\tword 1234567", k), ElementsAre("\tword", " ", "123", "456", "7"));
  EXPECT_THAT(Split("\xC3\xA9t\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87", k),  // "été 中文"
              ElementsAre("\xC3\xA9t\xC3\xA9", " \xE4\xB8\xAD\xE6\x96\x87"));
}

TEST(PreTokenizerTest, Qwen2SplitsDigitsOneByOne) {
  EXPECT_THAT(Split("ab 2024!", internal::PreTokenizer::kQwen2),
              ElementsAre("ab", " ", "2", "0", "2", "4", "!"));
}

TEST(PreTokenizerTest, Names) {
  EXPECT_EQ(internal::PreTokenizerFromName("default"), internal::PreTokenizer::kGpt2);
  EXPECT_EQ(internal::PreTokenizerFromName("llama-bpe"), internal::PreTokenizer::kLlama3);
  EXPECT_EQ(internal::PreTokenizerFromName("qwen2"), internal::PreTokenizer::kQwen2);
  EXPECT_EQ(internal::PreTokenizerFromName("falcon"), std::nullopt);
}

TEST(UnicodeDataTest, Classes) {
  using namespace unicode;
  EXPECT_EQ(CodepointFlags('a'), kLetter);
  EXPECT_EQ(CodepointFlags('7'), kNumber);
  EXPECT_EQ(CodepointFlags(' '), kWhitespace);
  EXPECT_EQ(CodepointFlags('!'), 0);
  EXPECT_EQ(CodepointFlags(0x4E2D), kLetter);  // 中
  EXPECT_EQ(CodepointFlags(0x0661), kNumber);  // Arabic-Indic one
  EXPECT_EQ(CodepointFlags(0x00BD), kNumber);  // ½ (No)
  EXPECT_EQ(CodepointFlags(0x3000), kWhitespace);
  EXPECT_EQ(CodepointFlags(0x0301), 0);         // combining acute (Mn)
  EXPECT_EQ(CodepointFlags(0x1F600), 0);        // emoji (So)
  EXPECT_EQ(CodepointFlags(0x20000), kLetter);  // CJK extension B
  EXPECT_EQ(CodepointFlags(0x10FFFF), 0);
  EXPECT_EQ(CodepointFlags(0x110000), 0);
  EXPECT_EQ(CodepointFlags(0x1C), 0);  // not White_Space (Python's isspace says otherwise)
}

// ---------------------------------------------------------------------------------------------
// Round trips.

std::vector<std::string> TrickyStrings() {
  return {
      "",
      " ",
      "   ",
      "\n",
      "\n\n\n",
      " leading",
      "trailing ",
      "  multiple   spaces  ",
      "tabs\tand\r\nnewlines\n",
      "emoji \xF0\x9F\x98\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD family \xF0\x9F\x91\xA8\xE2\x80\x8D"
      "\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7",
      "\xE4\xB8\xAD\xE6\x96\x87\xE6\xB5\x8B\xE8\xAF\x95 \xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4",
      "e\xCC\x81\xCC\x81 combining a\xCC\x8A",
      "control \x01\x02\x1B[0m\x7F",
      std::string("nul \0 inside", 12),
      "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
      "<|im_start|><|im_end|><|endoftext|><bos><eos><br><ud>",
      "<0x41> looks like a byte token",
      "\xE2\x96\x81 literal metaspace \xE2\x96\x81\xE2\x96\x81",
      "\xC4\xA0 G-dot (GPT-2's mapped space)",
      "it's THEY'RE we'll I'M ſ's",
      "12345678901234567890",
      "\xF0\xA0\x80\x80\xF3\xA0\x80\x81\xF4\x8F\xBF\xBF planes 2, 14, 16",
      "\xEF\xBB\xBF"
      "BOM and \xEF\xBF\xBD replacement",
  };
}

std::vector<std::string> InvalidUtf8Strings() {
  return {"\xFF",
          "\xC3",
          "a\xE2\x96",
          "\xED\xA0\x80 surrogate",
          "\xC0\xAF overlong",
          "\xF4\x90\x80\x80 too big",
          "\x80\x80",
          "ok\xF0\x9F\x98"};
}

// Random valid UTF-8 drawn from many blocks and all planes.
std::string RandomUtf8(std::mt19937& rng) {
  static const std::pair<uint32_t, uint32_t> kBlocks[] = {
      {0x20, 0x7E},       {0x20, 0x20},       {0x0, 0x1F},         {0x80, 0x2FF},
      {0x300, 0x36F},     {0x370, 0x52F},     {0x600, 0x6FF},      {0x900, 0x97F},
      {0x2000, 0x206F},   {0x2580, 0x2582},   {0x3000, 0x30FF},    {0x4E00, 0x9FFF},
      {0xAC00, 0xD7A3},   {0xE000, 0xFFFD},   {0x1F300, 0x1FAFF},  {0x10000, 0x1FFFF},
      {0x20000, 0x2FFFF}, {0x30000, 0xDFFFF}, {0xE0000, 0x10FFFF},
  };
  std::uniform_int_distribution<int> len_dist(0, 40);
  std::uniform_int_distribution<size_t> block_dist(0, std::size(kBlocks) - 1);
  std::string s;
  for (int i = len_dist(rng); i > 0; --i) {
    const auto [lo, hi] = kBlocks[block_dist(rng)];
    uint32_t cp = std::uniform_int_distribution<uint32_t>(lo, hi)(rng);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
    unicode::AppendUtf8(cp, &s);
  }
  return s;
}

void ExpectRoundTrips(const Tokenizer& tok, const std::string& text) {
  EXPECT_EQ(tok.Decode(tok.Encode(text, false, false)), text);
  EXPECT_EQ(tok.Decode(tok.Encode(text, true, false)), text);
  EXPECT_EQ(tok.Decode(tok.Encode(text, false, true), /*render_special=*/true), text);
  std::string streamed;
  for (int32_t id : tok.Encode(text, false, false)) streamed += tok.TokenBytes(id);
  if (!tok.spec().add_space_prefix) {
    EXPECT_EQ(streamed, text);
  }
}

std::vector<std::unique_ptr<Tokenizer>> AllTestTokenizers() {
  std::vector<std::unique_ptr<Tokenizer>> out;
  out.push_back(MustCreate(SpmSpec()));
  TokenizerSpec prefixed = SpmSpec();
  prefixed.add_space_prefix = true;
  out.push_back(MustCreate(std::move(prefixed)));
  for (const char* pre : {"gpt2", "llama3", "qwen2"}) out.push_back(MustCreate(ByteLevelSpec(pre)));
  return out;
}

TEST(RoundTripTest, TrickyStrings) {
  for (const auto& tok : AllTestTokenizers()) {
    for (const std::string& s : TrickyStrings()) {
      SCOPED_TRACE(s);
      ExpectRoundTrips(*tok, s);
    }
  }
}

TEST(RoundTripTest, InvalidUtf8IsKeptByteForByte) {
  for (const auto& tok : AllTestTokenizers()) {
    for (const std::string& s : InvalidUtf8Strings()) {
      SCOPED_TRACE(s);
      ExpectRoundTrips(*tok, s);
    }
  }
}

TEST(RoundTripTest, RandomUtf8) {
  std::mt19937 rng(20240607);
  const auto toks = AllTestTokenizers();
  for (int i = 0; i < 2000; ++i) {
    const std::string s = RandomUtf8(rng);
    for (const auto& tok : toks) {
      SCOPED_TRACE(testing::Message() << "string #" << i);
      ExpectRoundTrips(*tok, s);
    }
  }
}

TEST(RoundTripTest, RandomBytes) {
  std::mt19937 rng(7);
  const auto toks = AllTestTokenizers();
  for (int i = 0; i < 500; ++i) {
    std::string s(std::uniform_int_distribution<int>(0, 24)(rng), '\0');
    for (char& c : s) c = static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng));
    for (const auto& tok : toks) ExpectRoundTrips(*tok, s);
  }
}

// ---------------------------------------------------------------------------------------------
// Utf8StreamBuffer.

TEST(Utf8StreamBufferTest, HoldsBackIncompleteSequences) {
  Utf8StreamBuffer buf;
  EXPECT_EQ(buf.Push("h"), "h");
  EXPECT_EQ(buf.Push("\xE2"), "");
  EXPECT_EQ(buf.Push("\x96"), "");
  EXPECT_EQ(buf.Push("\x81x"), "\xE2\x96\x81x");
  EXPECT_EQ(buf.Push("ab\xF0\x9F"), "ab");
  EXPECT_EQ(buf.Push("\x98"), "");
  EXPECT_EQ(buf.Push("\x80\xC3"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(buf.Push("\xA9"), "\xC3\xA9");
  EXPECT_EQ(buf.Flush(), "");
}

TEST(Utf8StreamBufferTest, PassesThroughBytesThatCanNeverComplete) {
  Utf8StreamBuffer buf;
  EXPECT_EQ(buf.Push("\xFF"), "\xFF");
  EXPECT_EQ(buf.Push("\xE0\x80"), "\xE0\x80");  // E0 needs A0..BF next
  EXPECT_EQ(buf.Push("\x80"), "\x80");          // stray continuation byte
  EXPECT_EQ(buf.Push("\xF0\x9F"), "");
  EXPECT_EQ(buf.Flush(), "\xF0\x9F");  // stream ended mid-character
  EXPECT_EQ(buf.Flush(), "");
}

TEST(Utf8StreamBufferTest, StreamsByteFallbackTokens) {
  auto tok = MustCreate(SpmSpec());
  const std::string text = "he \xF0\x9F\x98\x80\xE4\xB8\xAD hello";
  Utf8StreamBuffer buf;
  std::string out;
  for (int32_t id : tok->Encode(text, true, false)) {
    const std::string chunk = buf.Push(tok->TokenBytes(id));
    // Every chunk is valid UTF-8 on its own.
    for (size_t pos = 0; pos < chunk.size();) {
      const auto c = unicode::DecodeUtf8(chunk, pos);
      ASSERT_TRUE(c.valid) << "chunk '" << chunk << "' at " << pos;
      pos += c.len;
    }
    out += chunk;
  }
  out += buf.Flush();
  EXPECT_EQ(out, text);
}

// ---------------------------------------------------------------------------------------------
// Spec validation.

void ExpectInvalid(TokenizerSpec spec, std::string_view needle) {
  auto tok = Tokenizer::Create(std::move(spec));
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr(std::string(needle)));
}

TEST(SpecValidationTest, Errors) {
  ExpectInvalid(TokenizerSpec{}, "'tokens' (the vocabulary) is empty");
  {
    TokenizerSpec s = SpmSpec();
    s.types.pop_back();
    ExpectInvalid(std::move(s), "'types' has 281 entries but 'tokens' has 282");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.scores.resize(3);
    ExpectInvalid(std::move(s), "'scores' has 3 entries");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.types[7] = static_cast<TokenType>(9);
    ExpectInvalid(std::move(s), "'types[7]' = 9");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.bos_id = 282;
    ExpectInvalid(std::move(s), "'bos_id' = 282 is out of range");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.bos_id = -1;
    ExpectInvalid(std::move(s), "'add_bos' is set but 'bos_id' is -1");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.eog_ids.push_back(-3);
    ExpectInvalid(std::move(s), "'eog_ids[1]' = -3");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.unk_id = -1;
    s.types[Byte(0x41)] = TokenType::kNormal;
    ExpectInvalid(std::move(s), "no byte-fallback token <0x41>");
  }
  {
    TokenizerSpec s = SpmSpec();
    s.tokens[Byte(0x41)] = "<0xZZ>";
    ExpectInvalid(std::move(s), "'tokens[71]' = '<0xZZ>' has type BYTE");
  }
  {
    TokenizerSpec s = ByteLevelSpec("gpt2");
    s.merges[2] = "\u0120t hx";
    ExpectInvalid(std::move(s), "'merges[2]' = '\u0120t hx': unknown token 'hx'");
  }
  {
    TokenizerSpec s = ByteLevelSpec("gpt2");
    s.merges[0] = "\u0120t";
    ExpectInvalid(std::move(s), "'merges[0]' = '\u0120t': not of the form 'left right'");
  }
  {
    TokenizerSpec s = ByteLevelSpec("gpt2");
    s.merges.push_back("a b");  // "ab" is not a token
    ExpectInvalid(std::move(s), "result 'ab' is not in the vocabulary");
  }
  {
    TokenizerSpec s = ByteLevelSpec("gpt2");
    s.pre = "falcon";
    ExpectInvalid(std::move(s), "'pre' = 'falcon' is not a supported pre-tokenizer");
  }
  {
    TokenizerSpec s = ByteLevelSpec("gpt2");
    s.types['A'] = TokenType::kControl;
    ExpectInvalid(std::move(s), "no normal token for byte 0x41");
  }
  {
    TokenizerSpec s = ByteLevelSpec("gpt2");
    s.scores = {1.0f};
    ExpectInvalid(std::move(s), "expected 0 or 268");
  }
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json.

class HfTokenizerJsonTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(testing::TempDir()) /
           (std::string("hf_tok_") + testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }

  // A Llama-3-style byte-level tokenizer.json over the ByteLevelSpec vocabulary.
  static Json ByteLevelJson() {
    const TokenizerSpec spec = ByteLevelSpec("llama3");
    Json vocab = Json::object();
    for (int32_t id = 0; id < kEndOfText; ++id) vocab[spec.tokens[id]] = id;
    Json merges = Json::array();
    for (const std::string& m : spec.merges) merges.push_back(m);
    const std::string regex = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
                              R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    return Json{
        {"version", "1.0"},
        {"added_tokens",
         {{{"id", kEndOfText}, {"content", "<|endoftext|>"}, {"special", true}},
          {{"id", kImEnd}, {"content", "<|im_end|>"}, {"special", true}},
          {{"id", kUd}, {"content", "<ud>"}, {"special", false}}}},
        {"normalizer", nullptr},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", regex}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
        {"post_processor",
         {{"type", "TemplateProcessing"},
          {"single",
           {{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
            {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}}},
        {"model",
         {{"type", "BPE"}, {"byte_fallback", false}, {"vocab", vocab}, {"merges", merges}}},
    };
  }

  // A Gemma-style SentencePiece-like tokenizer.json: byte_fallback, merges instead of scores.
  static Json SpmJson() {
    Json vocab = Json::object();
    int32_t id = 0;
    for (const char* t : {"<pad>", "<eos>", "<bos>", "<unk>"}) vocab[t] = id++;
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      vocab[name] = id++;
    }
    // ids 260..: ▁ h e l o ll llo he ▁h ▁he xyz
    for (const char* t :
         {"\u2581", "h", "e", "l", "o", "ll", "llo", "he", "\u2581h", "\u2581he", "xyz"}) {
      vocab[t] = id++;
    }
    return Json{
        {"added_tokens",
         {{{"id", 0}, {"content", "<pad>"}, {"special", true}},
          {{"id", 1}, {"content", "<eos>"}, {"special", true}},
          {{"id", 2}, {"content", "<bos>"}, {"special", true}},
          {{"id", 3}, {"content", "<unk>"}, {"special", true}},
          {{"id", 271}, {"content", "<end_of_turn>"}, {"special", true}}}},
        {"normalizer",
         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}},
        {"pre_tokenizer", nullptr},
        {"post_processor",
         {{"type", "TemplateProcessing"},
          {"single",
           {{{"SpecialToken", {{"id", "<bos>"}, {"type_id", 0}}}},
            {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}}},
        {"model",
         {{"type", "BPE"},
          {"byte_fallback", true},
          {"unk_token", "<unk>"},
          {"vocab", vocab},
          // Pair form (newer tokenizers) for variety: ranks 0..4.
          {"merges", Json::array({Json::array({"l", "l"}), Json::array({"ll", "o"}),
                                  Json::array({"\u2581", "h"}), Json::array({"\u2581h", "e"}),
                                  Json::array({"h", "e"})})}}},
    };
  }

  std::filesystem::path dir_;
};

TEST_F(HfTokenizerJsonTest, ByteLevel) {
  const std::string path = Write("tokenizer.json", ByteLevelJson().dump());
  Write("tokenizer_config.json", R"({"eos_token": {"content": "<|im_end|>"}})");
  auto spec = Tokenizer::SpecFromHfTokenizerJson(path);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind, TokenizerSpec::Kind::kByteLevelBpe);
  EXPECT_EQ(spec->pre, "llama3");
  EXPECT_EQ(spec->tokens.size(), static_cast<size_t>(kUd + 1));
  EXPECT_EQ(spec->types[kEndOfText], TokenType::kControl);
  EXPECT_EQ(spec->types[kUd], TokenType::kUserDefined);
  EXPECT_EQ(spec->bos_id, kEndOfText);
  EXPECT_TRUE(spec->add_bos);
  EXPECT_EQ(spec->eos_id, kImEnd);
  auto tok = MustCreate(*std::move(spec));
  EXPECT_THAT(tok->spec().eog_ids, ::testing::UnorderedElementsAre(kImEnd, kEndOfText));
  EXPECT_THAT(tok->Encode("the in the", true, false), ElementsAre(kEndOfText, kThe, kGin, kGthe));
}

TEST_F(HfTokenizerJsonTest, SentencePieceLike) {
  const std::string path = Write("tokenizer.json", SpmJson().dump());
  auto spec = Tokenizer::SpecFromHfTokenizerJson(path);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->kind, TokenizerSpec::Kind::kSentencePieceBpe);
  EXPECT_FALSE(spec->add_space_prefix);
  EXPECT_EQ(spec->bos_id, 2);
  EXPECT_EQ(spec->eos_id, 1);
  EXPECT_EQ(spec->unk_id, 3);
  EXPECT_EQ(spec->types[4], TokenType::kByte);
  EXPECT_EQ(spec->types[270], TokenType::kUnused);  // "xyz": no merge produces it
  EXPECT_EQ(spec->types[271], TokenType::kControl);
  EXPECT_EQ(spec->tokens[271], "<end_of_turn>");
  EXPECT_FLOAT_EQ(spec->scores[265], 0.0f);   // ll, rank 0
  EXPECT_FLOAT_EQ(spec->scores[269], -3.0f);  // ▁he, rank 3
  auto tok = MustCreate(*std::move(spec));
  EXPECT_THAT(tok->spec().eog_ids, ::testing::UnorderedElementsAre(1, 271));
  // "hello▁he▁xyz": ll(0), llo(-1), ▁h(-2), ▁he(-3), he(-4); the second "he" went stale.
  // "xyz" is unused and "xy" is no piece, so x, y and z fall back to bytes.
  EXPECT_THAT(tok->Encode("hello he xyz<end_of_turn>", true, true),
              ElementsAre(2, 267, 266, 269, 260, 4 + 'x', 4 + 'y', 4 + 'z', 271));
  EXPECT_EQ(tok->Decode(tok->Encode("hello he xyz", true, true)), "hello he xyz");
}

TEST_F(HfTokenizerJsonTest, SpacePrefixFromNormalizerOrMetaspace) {
  Json j = SpmJson();
  j["normalizer"] = {
      {"type", "Sequence"},
      {"normalizers",
       {{{"type", "Prepend"}, {"prepend", "\u2581"}},
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}};
  auto spec = Tokenizer::SpecFromHfTokenizerJson(Write("tokenizer.json", j.dump()));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->add_space_prefix);
  j = SpmJson();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"},
                        {"replacement", "\u2581"},
                        {"prepend_scheme", "first"},
                        {"split", false}};
  spec = Tokenizer::SpecFromHfTokenizerJson(Write("tokenizer.json", j.dump()));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->add_space_prefix);
}

TEST_F(HfTokenizerJsonTest, Errors) {
  auto expect_error = [&](const Json& j, absl::StatusCode code, const std::string& needle) {
    const std::string path =
        Write("tokenizer.json", j.is_string() ? j.get<std::string>() : j.dump());
    auto spec = Tokenizer::SpecFromHfTokenizerJson(path);
    ASSERT_FALSE(spec.ok()) << needle;
    EXPECT_EQ(spec.status().code(), code) << spec.status();
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(path));
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(needle));
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  expect_error(Json("{\"model\": "), kInvalid, "not valid JSON");
  expect_error(Json::array(), kInvalid, "top level is not a JSON object");
  expect_error(Json::object(), kInvalid, "field 'model' is missing");
  Json j = ByteLevelJson();
  j["model"].erase("vocab");
  expect_error(j, kInvalid, "field 'model.vocab' is missing");
  j["model"]["vocab"] = Json::array({"a", "b"});
  expect_error(j, kInvalid, "field 'model.vocab' is not an object");
  j["model"]["vocab"] = {{"a", "zero"}};
  expect_error(j, kInvalid, "field 'model.vocab[\"a\"]' is not a non-negative integer id");
  j = ByteLevelJson();
  j["model"]["merges"] = "h e";
  expect_error(j, kInvalid, "field 'model.merges' is not an array");
  j["model"]["merges"] = {"h e", 7};
  expect_error(j, kInvalid, "field 'model.merges[1]'");
  j = ByteLevelJson();
  j["added_tokens"][1].erase("id");
  expect_error(j, kInvalid, "field 'added_tokens[1].id'");
  j = ByteLevelJson();
  j["model"]["type"] = "Unigram";
  expect_error(j, kInvalid, "field 'model.type' 'Unigram' is not supported");
  j = ByteLevelJson();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+";
  expect_error(j, kInvalid, "is not a supported pre-tokenizer regex");
  j = ByteLevelJson();
  j["pre_tokenizer"] = nullptr;
  expect_error(j, kInvalid, "field 'pre_tokenizer' has no ByteLevel step");
  j = ByteLevelJson();
  j["post_processor"]["single"][0]["SpecialToken"]["id"] = "<nope>";
  expect_error(j, kInvalid, "names '<nope>', which is not a token");

  auto missing = Tokenizer::SpecFromHfTokenizerJson((dir_ / "absent.json").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(HfTokenizerJsonTest, InvalidMergeIsReportedByCreate) {
  Json j = ByteLevelJson();
  j["model"]["merges"].push_back("h zz");
  auto spec = Tokenizer::SpecFromHfTokenizerJson(Write("tokenizer.json", j.dump()));
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto tok = Tokenizer::Create(*std::move(spec));
  ASSERT_FALSE(tok.ok());
  EXPECT_THAT(std::string(tok.status().message()), HasSubstr("merges[9]' = 'h zz': unknown token"));
}

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
