#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/tokenizer_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dd::model {
namespace {

using namespace ::dd::model::testing_util;  // NOLINT(build/namespaces)
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

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

}  // namespace
}  // namespace dd::model
