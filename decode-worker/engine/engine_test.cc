// Engine tests on the real Gemma 3 270M (fetched by scripts/fetch-model). They skip when the
// model is absent unless DD_REQUIRE_MODEL=1 (as in CI), where absence is a failure.
#include "decode-worker/engine/engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

#include "decode-worker/engine/engine_test_util.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

using GemmaEngineTest = testing_util::GemmaTest;

TEST_F(GemmaEngineTest, ConfigFromMetadata) {
  const auto& c = model_->config;
  EXPECT_EQ(c.arch_name, "gemma3");
  EXPECT_EQ(c.n_layer, 18);
  EXPECT_EQ(c.sliding_window, 512);
  std::vector<int64_t> global;
  for (int64_t l = 0; l < c.n_layer; ++l)
    if (!c.layer_is_swa[l]) global.push_back(l);
  EXPECT_EQ(global, (std::vector<int64_t>{5, 11, 17}));
}

// The default speculative head on Gemma 3 270M is the context head: its LM head (262144 x 640)
// has more multiply-adds than its 18 layers. Named heads stay as they are. The default
// landmark shortlist follows the head: every chunk with the context head (its query does not
// rank chunks as the real row's did), 4 x budget with the full head; a set value stays.
TEST_F(GemmaEngineTest, AutoSpecHeadIsTheContextHead) {
  const auto& c = model_->config;
  EXPECT_EQ(ResolveSpecHead(SpecHead::kAuto, c), SpecHead::kContext);
  EXPECT_EQ(ResolveSpecHead(SpecHead::kFull, c), SpecHead::kFull);
  auto dual_owner = testing_util::NewEngine(*model_, {.mode = DecodeMode::kDualDecoder});
  Engine& dual = *dual_owner;
  EXPECT_EQ(dual.spec_head(), SpecHead::kContext);
  EXPECT_EQ(dual.spec_candidates(), 0);
  auto full_head_owner = testing_util::NewEngine(*model_, {.mode = DecodeMode::kDualDecoder, .spec_head = SpecHead::kFull});
  Engine& full_head = *full_head_owner;
  EXPECT_EQ(full_head.spec_head(), SpecHead::kFull);
  EXPECT_EQ(full_head.spec_candidates(), SparseOptions::kFullHeadSpecCandidates);
  EngineOptions set{.mode = DecodeMode::kDualDecoder};
  set.sparse.spec_candidates = 2;
  EXPECT_EQ(testing_util::NewEngine(*model_, set)->spec_candidates(), 2);
}

// Ids checked by hand against the GGUF vocabulary: <bos>, "The", "▁capital", "▁of",
// "▁France", "▁is"; <start_of_turn> (105) is a control token, split out only when asked.
TEST_F(GemmaEngineTest, TokenizerOnRealVocabulary) {
  const auto& tok = *model_->tokenizer;
  EXPECT_EQ(tok.Encode("The capital of France is", true, true),
            (std::vector<int32_t>{2, 818, 5279, 529, 7001, 563}));
  EXPECT_EQ(tok.Encode("<start_of_turn>user", false, true).front(), 105);
  EXPECT_NE(tok.Encode("<start_of_turn>user", false, false).front(), 105);
  std::string text;
  for (int i = 0; i < 50; ++i) text += "Grüße, 世界! \t  naïve café 🙂 line " + std::to_string(i) + "\n";
  EXPECT_EQ(tok.Decode(tok.Encode(text, false, false)), text);
}

TEST_F(GemmaEngineTest, GreedyFactualContinuations) {
  auto engine_owner = testing_util::NewEngine(*model_, {});
  Engine& engine = *engine_owner;
  GenerateOptions opt;
  opt.max_new_tokens = 6;
  const std::pair<const char*, const char*> cases[] = {
      {"Question: What is the capital of France?\nAnswer:", "Paris"},
      {"The capital of Japan is", "Tokyo"},
      {"Paris is the capital of", "France"},
      {"The chemical symbol for gold is", "Au"},
      {"The capital city of France is Paris. The capital city of Germany is", "Berlin"},
  };
  for (const auto& [prompt, want] : cases) {
    auto r = engine.Generate(Encode(prompt), opt, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NE(r->text.find(want), std::string::npos) << prompt << " -> '" << r->text << "'";
  }
}

// Chunked prefill must give bit-identical logits to a single chunk (batch invariance).
TEST_F(GemmaEngineTest, ChunkedPrefillIsBitIdentical) {
  std::string text;
  // Long enough (> window + chunk) that the sliding-window ring wraps in the chunked run.
  for (int i = 0; i < 90; ++i) text += "Counting sheep number " + std::to_string(i) + " jumps over the fence. ";
  const auto ids = Encode(text);
  ASSERT_GT(ids.size(), 700u);
  const std::vector<int64_t> pos = {0, 37, 600, static_cast<int64_t>(ids.size()) - 1};
  auto whole_owner = testing_util::NewEngine(*model_, {.threads = 2, .prefill_chunk = 4096});
  Engine& whole = *whole_owner;
  auto chunked_owner = testing_util::NewEngine(*model_, {.threads = 1, .prefill_chunk = 61});
  Engine& chunked = *chunked_owner;
  auto a = whole.PromptLogits(0, ids, pos);
  auto b = chunked.PromptLogits(0, ids, pos);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->size(), b->size());
  EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->size() * 4));
}

// Decoding after a long prefill (the sliding-window rings shrink from prefill size to
// window + 1 rows) gives the logits that prefilling the same tokens gives.
TEST_F(GemmaEngineTest, DecodeAfterLongPrefillMatchesPrefill) {
  std::string text;
  for (int i = 0; i < 120; ++i) text += "Lighthouse keeper log, night " + std::to_string(i) + ": calm sea. ";
  auto ids = Encode(text);
  ASSERT_GT(ids.size(), 905u);
  ids.resize(905);
  auto engine_owner = testing_util::NewEngine(*model_, {.prefill_chunk = 1024});
  Engine& engine = *engine_owner;
  const std::vector<int64_t> last = {904};
  auto want = engine.PromptLogits(0, ids, last);
  ASSERT_TRUE(want.ok());
  auto got = engine.Prefill(1, absl::MakeConstSpan(ids.data(), 900));
  ASSERT_TRUE(got.ok());
  std::vector<float> logits;
  const int32_t seq = 1;
  for (int i = 900; i < 905; ++i) ASSERT_TRUE(engine.DecodeStep({&seq, 1}, {&ids[i], 1}, &logits).ok());
  EXPECT_EQ(0, std::memcmp(want->data(), logits.data(), logits.size() * 4));
}

// Batch invariance (docs/decisions/0001-batch-invariant-cpu-kernels.md): a request alone and the
// same request in a batch of 8 give identical logits.
TEST_F(GemmaEngineTest, DecodeIsBatchInvariant) {
  std::vector<std::vector<int32_t>> prompts;
  for (const char* p : {"The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def main():", "Water boils at",
                        "The quick brown fox", "In 1969, the first", "Roses are red,"}) {
    prompts.push_back(Encode(p));
  }
  testing_util::ExpectDecodeBatchInvariant(*model_, prompts, 5);
}

// The same with KV kept in f16 (docs/decisions/0049-kv-storage-type.md): the narrowing is per
// element, so a row's bits still depend on its own keys only.
TEST_F(GemmaEngineTest, DecodeIsBatchInvariantWithF16Kv) {
  std::vector<std::vector<int32_t>> prompts;
  for (const char* p : {"The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Water boils at"}) {
    prompts.push_back(Encode(p));
  }
  testing_util::ExpectDecodeBatchInvariant(*model_, prompts, 2, {.kv_dtype = KvDtype::kF16});
}

// Several prompts prefilled in shared forward passes give the logits of separate prefills.
TEST_F(GemmaEngineTest, BatchedPrefillMatchesSeparate) {
  const std::vector<std::vector<int32_t>> prompts = {Encode("The capital of France is"),
                                                     Encode(std::string(300, 'a') + " once upon a time"),
                                                     Encode("def fib(n):")};
  auto batched_owner = testing_util::NewEngine(*model_, {.prefill_chunk = 64});
  Engine& batched = *batched_owner;
  auto all = batched.PrefillBatch(std::vector<int32_t>{0, 1, 2}, prompts);
  ASSERT_TRUE(all.ok()) << all.status();
  auto alone_owner = testing_util::NewEngine(*model_, {});
  Engine& alone = *alone_owner;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto one = alone.Prefill(static_cast<int32_t>(i), prompts[i]);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ(0, std::memcmp(one->data(), (*all)[i].data(), one->size() * 4)) << "prompt " << i;
  }
  EXPECT_FALSE(batched.PrefillBatch(std::vector<int32_t>{5, 5}, {prompts[0], prompts[1]}).ok());
}

// A stop string ends generation and is cut from the output, streamed or not.
TEST_F(GemmaEngineTest, StopStringsEndAndAreRemoved) {
  auto engine_owner = testing_util::NewEngine(*model_, {});
  Engine& engine = *engine_owner;
  GenerateOptions opt;
  opt.max_new_tokens = 20;
  auto full = engine.Generate(Encode("Paris is the capital of"), opt, nullptr);
  ASSERT_TRUE(full.ok());
  ASSERT_NE(full->text.find("France"), std::string::npos) << full->text;
  opt.stop_strings = {"France"};
  std::string streamed;
  auto r = engine.Generate(Encode("Paris is the capital of"), opt, [&](absl::string_view s) { streamed.append(s.data(), s.size()); });
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->stop_reason, "stop_string");
  EXPECT_EQ(r->text, full->text.substr(0, full->text.find("France")));
  EXPECT_EQ(streamed, r->text);
}

TEST_F(GemmaEngineTest, BadInputsGiveClearErrors) {
  auto engine_owner = testing_util::NewEngine(*model_, {});
  Engine& engine = *engine_owner;
  GenerateOptions opt;
  std::vector<int32_t> too_long(model_->config.n_ctx_train + 5, 100);
  auto r = engine.Generate(too_long, opt, nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("context"), std::string::npos);
  EXPECT_EQ(engine.Generate({}, opt, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<int32_t> bad_id = {2, static_cast<int32_t>(model_->config.n_vocab)};
  EXPECT_EQ(engine.Generate(bad_id, opt, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  GenerateOptions neg = opt;
  neg.sampling.temperature = -1;
  auto s = engine.Generate(Encode("hi"), neg, nullptr);
  EXPECT_NE(std::string(s.status().message()).find("temperature"), std::string::npos);
  GenerateOptions zero = opt;
  zero.max_new_tokens = 0;
  EXPECT_EQ(engine.Generate(Encode("hi"), zero, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SamplerTest, ValidatesParameters) {
  EXPECT_FALSE((SamplingParams{.temperature = -0.1f}).Validate().ok());
  EXPECT_FALSE((SamplingParams{.top_k = -1}).Validate().ok());
  EXPECT_FALSE((SamplingParams{.top_p = 0.0f}).Validate().ok());
  EXPECT_FALSE((SamplingParams{.top_p = 1.5f}).Validate().ok());
  EXPECT_TRUE((SamplingParams{.temperature = 0.7f, .top_k = 40, .top_p = 0.9f}).Validate().ok());
}

TEST(SamplerTest, TopKOneIsGreedyAndSeedsReproduce) {
  std::vector<float> logits = {0.1f, 2.0f, 1.9f, -1.0f};
  Sampler k1({.temperature = 1.0f, .top_k = 1, .seed = 5});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(k1.Sample(logits.data(), 4), 1);
  Sampler a({.temperature = 1.0f, .seed = 42}), b({.temperature = 1.0f, .seed = 42});
  std::vector<int32_t> sa, sb;
  for (int i = 0; i < 50; ++i) {
    sa.push_back(a.Sample(logits.data(), 4));
    sb.push_back(b.Sample(logits.data(), 4));
  }
  EXPECT_EQ(sa, sb);
  // Small top_p keeps only the best token.
  Sampler p({.temperature = 1.0f, .top_p = 0.3f, .seed = 1});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(p.Sample(logits.data(), 4), 1);
}

}  // namespace
}  // namespace dd::engine
