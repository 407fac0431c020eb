#include "decode-worker/model/tokenizer.h"

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "decode-worker/model/tokenizer_test_util.h"
#include "decode-worker/model/unicode_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dd::model {
namespace {

using namespace ::dd::model::testing_util;  // NOLINT(build/namespaces)
using ::testing::ElementsAre;
using ::testing::Not;

// Hand-made SentencePiece vocabulary: SpmSpec() in tokenizer_test_util.h.

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

// Hand-made byte-level vocabulary: ByteLevelSpec() in tokenizer_test_util.h.

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

// SmolLM: digits one by one, and the GPT-2 regex sees each stretch between digits alone, so a
// space before a digit stays a piece of its own and a space run before a digit keeps its last
// space (no \S follows inside the stretch).
TEST(PreTokenizerTest, SmollmDigitsThenGpt2) {
  const auto k = internal::PreTokenizer::kSmollm;
  EXPECT_THAT(Split("ab 2024!", k), ElementsAre("ab", " ", "2", "0", "2", "4", "!"));
  EXPECT_THAT(Split("x  12 y", k), ElementsAre("x", "  ", "1", "2", " y"));
  EXPECT_THAT(Split("it's 3's", k), ElementsAre("it", "'s", " ", "3", "'s"));
  EXPECT_THAT(Split("a1b", k), ElementsAre("a", "1", "b"));
  // GPT-2 alone keeps " 2024" whole and gives the run before it all but its last space.
  EXPECT_THAT(Split("x  12 y", internal::PreTokenizer::kGpt2), ElementsAre("x", " ", " 12", " y"));
}

TEST(PreTokenizerTest, Names) {
  EXPECT_EQ(internal::PreTokenizerFromName("smollm"), internal::PreTokenizer::kSmollm);
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

}  // namespace
}  // namespace dd::model
