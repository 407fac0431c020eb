// Engine tests on the real SmolLM2-135M-Instruct (Llama architecture, Q4_1 weights, every layer
// global; fetched by scripts/fetch-model). They skip when the model is absent unless
// DD_REQUIRE_MODEL=1 (as in CI), where absence is a failure. Logits against the independent
// numpy reference are in tests/reference; tokenization against Hugging Face `tokenizers` there too.
#include <cstring>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

using SmolLM2EngineTest = testing_util::SmolLM2Test;

TEST_F(SmolLM2EngineTest, ConfigFromMetadata) {
  const auto& c = model_->config;
  EXPECT_EQ(c.arch_name, "llama");
  EXPECT_EQ(c.n_layer, 30);
  EXPECT_EQ(c.n_head, 9);
  EXPECT_EQ(c.n_head_kv, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.n_vocab, 49152);
  EXPECT_EQ(c.n_ctx_train, 8192);
  EXPECT_TRUE(c.tied_embeddings);
  for (int64_t l = 0; l < c.n_layer; ++l) EXPECT_FALSE(c.layer_is_swa[l]) << "layer " << l;
}

// The file says add_bos_token = false; ChatML markers written in a prompt are single control
// tokens (<|im_start|> 1, <|im_end|> 2) when special tokens are parsed, plain text otherwise.
TEST_F(SmolLM2EngineTest, TokenizerOnRealVocabulary) {
  const auto& tok = *model_->tokenizer;
  EXPECT_FALSE(tok.add_bos());
  const auto chat = tok.Encode("<|im_start|>user\nHi<|im_end|>", tok.add_bos(), true);
  ASSERT_GE(chat.size(), 3u);
  EXPECT_EQ(chat.front(), 1);
  EXPECT_EQ(chat.back(), 2);
  const auto plain = tok.Encode("<|im_start|>user", false, false);
  EXPECT_GT(plain.size(), 2u);
  EXPECT_NE(plain.front(), 1);
  // Digits are split one by one (the `smollm` pre-tokenizer).
  EXPECT_EQ(tok.Encode("2024", false, false).size(), 4u);
  std::string text;
  for (int i = 0; i < 50; ++i) text += "Grüße, 世界! \t  naïve café 🙂 line " + std::to_string(i) + "\n";
  EXPECT_EQ(tok.Decode(tok.Encode(text, false, false)), text);
}

TEST_F(SmolLM2EngineTest, GreedyChatAnswers) {
  Engine engine(*model_, {});
  GenerateOptions opt;
  opt.max_new_tokens = 12;
  const std::pair<const char*, const char*> cases[] = {
      {"What is the capital of France?", "Paris"},
      {"What is the capital of Japan?", "Tokyo"},
  };
  for (const auto& [question, want] : cases) {
    const std::string prompt = std::string("<|im_start|>user\n") + question + "<|im_end|>\n<|im_start|>assistant\n";
    auto r = engine.Generate(Encode(prompt), opt, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NE(r->text.find(want), std::string::npos) << question << " -> '" << r->text << "'";
  }
}

// DESIGN §5: a request alone and the same request in a batch of 6 give identical logits (the
// Q4_1 int8 kernels included).
TEST_F(SmolLM2EngineTest, DecodeIsBatchInvariant) {
  const std::vector<std::string> prompts = {"The capital of France is", "Once upon a time", "1, 2, 3, 4,",
                                            "def main():", "Water boils at", "The quick brown fox"};
  const int64_t V = model_->config.n_vocab;
  Engine batched(*model_, {});
  std::vector<int32_t> seqs, tokens;
  for (int s = 0; s < 6; ++s) {
    auto l = batched.Prefill(s, Encode(prompts[s]));
    ASSERT_TRUE(l.ok());
    seqs.push_back(s);
    tokens.push_back(Argmax(l->data(), V));
  }
  std::vector<float> batch_logits;
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(batched.DecodeStep(seqs, tokens, &batch_logits).ok());
    for (int s = 0; s < 6; ++s) tokens[s] = Argmax(&batch_logits[s * V], V);
  }
  Engine alone(*model_, {.threads = 1});
  auto l = alone.Prefill(0, Encode(prompts[4]));
  ASSERT_TRUE(l.ok());
  int32_t t = Argmax(l->data(), V);
  std::vector<float> one;
  for (int step = 0; step < 3; ++step) {
    const int32_t seq0 = 0;
    ASSERT_TRUE(alone.DecodeStep({&seq0, 1}, {&t, 1}, &one).ok());
    t = Argmax(one.data(), V);
  }
  EXPECT_EQ(0, std::memcmp(one.data(), &batch_logits[4 * V], one.size() * 4));
}

}  // namespace
}  // namespace dd::engine
