#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/tokenizer_test_util.h"
#include "decode-worker/model/unicode_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dd::model {
namespace {

using namespace ::dd::model::testing_util;  // NOLINT(build/namespaces)
using ::testing::HasSubstr;

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

}  // namespace
}  // namespace dd::model

namespace dd::model {
namespace {

// A byte-level vocabulary without a token for some non-printable byte (SmolLM2 lacks 0x04 among
// others) drops that byte when encoding, as llama.cpp does; its neighbours never merge across it.
TEST(ByteLevelMissingByteTest, DroppedOnEncode) {
  TokenizerSpec s = testing_util::ByteLevelSpec("gpt2");
  s.types[0x04] = TokenType::kControl;  // byte 0x04's token is no longer a normal token
  auto tok = Tokenizer::Create(std::move(s));
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int32_t> with = (*tok)->Encode("th\x04" "e", false, false);
  EXPECT_EQ((*tok)->Decode(with), "the") << "the byte is dropped";
  EXPECT_EQ(with.size(), 2u) << "'th' merges, 'e' does not join it across the dropped byte";
  EXPECT_TRUE((*tok)->Encode("\x04", false, false).empty());
}

}  // namespace
}  // namespace dd::model
