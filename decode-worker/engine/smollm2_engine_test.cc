// Engine tests on the real SmolLM2-135M-Instruct (Llama architecture, Q4_1 weights, every layer
// global; fetched by scripts/fetch-model). They skip when the model is absent unless
// DD_REQUIRE_MODEL=1 (as in CI), where absence is a failure. Logits against the independent
// numpy reference are in tests/reference; tokenization against Hugging Face `tokenizers` there too.
#include <algorithm>
#include <cstring>

#include "decode-worker/engine/dense_kv_cache.h"
#include "decode-worker/engine/spec_head.h"

#include "dd/backend/cpu_device.h"
#include "dd/backend/registry.h"
#include "dd/kernels/cpu_ops.h"
#include "decode-worker/model/device_weights.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/engine_test_util.h"
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

// The default speculative head on SmolLM2 is the full head: its LM head (49152 x 576) is a
// quarter of its 30 layers' multiply-adds. Head names parse; a wrong one names the choices.
TEST_F(SmolLM2EngineTest, AutoSpecHeadIsTheFullHead) {
  EXPECT_EQ(ResolveSpecHead(SpecHead::kAuto, model_->config), SpecHead::kFull);
  EXPECT_EQ(ResolveSpecHead(SpecHead::kContext, model_->config), SpecHead::kContext);
  auto dual_owner = testing_util::NewEngine(*model_, {.mode = DecodeMode::kDualDecoder});
  Engine& dual = *dual_owner;
  EXPECT_EQ(dual.spec_head(), SpecHead::kFull);
  EXPECT_EQ(dual.spec_candidates(), SparseOptions::kFullHeadSpecCandidates);  // the default shortlist
  for (SpecHead h : {SpecHead::kFull, SpecHead::kContext, SpecHead::kAuto}) {
    EXPECT_EQ(*ParseSpecHead(SpecHeadName(h)), h);
  }
  const auto bad = ParseSpecHead("fast");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("full, context, auto"), std::string::npos);
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
  auto engine_owner = testing_util::NewEngine(*model_, {});
  Engine& engine = *engine_owner;
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

// Batch invariance (docs/decisions/0001-batch-invariant-cpu-kernels.md): a request alone and the
// same request in a batch of 6 give identical logits (the Q4_1 int8 kernels included).
TEST_F(SmolLM2EngineTest, DecodeIsBatchInvariant) {
  std::vector<std::vector<int32_t>> prompts;
  for (const char* p : {"The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def main():", "Water boils at",
                        "The quick brown fox"}) {
    prompts.push_back(Encode(p));
  }
  testing_util::ExpectDecodeBatchInvariant(*model_, prompts, 4);
}

// The context head: the shortlist holds each seen token once, in first-seen order, and its
// argmax is the full LM head's argmax restricted to those tokens (the real logits of a prompt,
// softcap-free on this model).
// The full speculative head's tokens computed on the device (Forward's spec_tokens) are the
// host's argmax of the logits the same pass gives without them, and the real rows' logits are
// the same bits: 80 sequences of a real row then a speculative one (more than kLogitRows
// speculative rows), some real rows wanting no logits, on the cpu device and the simulated one.
TEST_F(SmolLM2EngineTest, SpeculativeTokensOnTheDeviceAreTheArgmaxOfTheirLogits) {
  const int64_t V = model_->config.n_vocab;
  const auto text = Encode("The cat sat on the mat. The dog sat on the log. A bird sang in the tall old tree by the "
                           "river while the keeper counted every ship that passed the light.");
  ASSERT_GE(text.size(), 20u);
  std::vector<model::BatchRow> rows;
  for (int32_t s = 0; s < 80; ++s) {
    const bool real_logits = s % 5 != 0;
    rows.push_back({s, 0, text[s % text.size()], real_logits, false});
    rows.push_back({s, 1, text[(s * 7 + 3) % text.size()], true, /*speculative=*/true});
  }
  ASSERT_GT(80, model::Transformer::kLogitRows);
  ThreadPool pool(2);
  backend::CpuDevice cpu(0, pool);
  auto sim = backend::CreateDevice("sim", {.budget_bytes = 0, .pool = &pool});
  ASSERT_TRUE(sim.ok()) << sim.status();
  for (backend::Device* dev : {static_cast<backend::Device*>(&cpu), sim->get()}) {
    SCOPED_TRACE(std::string(dev->name()));
    auto tf = model::Transformer::Create(*model_, *dev);
    ASSERT_TRUE(tf.ok()) << tf.status();
    std::vector<float> all, real;
    std::vector<int32_t> tokens;
    {
      DenseKvCache kv(model_->config, *dev);
      ASSERT_TRUE((*tf)->Forward(rows, kv, &all).ok());
    }
    {
      DenseKvCache kv(model_->config, *dev);
      ASSERT_TRUE((*tf)->Forward(rows, kv, &real, nullptr, nullptr, &tokens).ok());
    }
    ASSERT_EQ(tokens.size(), 80u);
    int64_t a = 0, r = 0;  // rows of `all` and of `real`
    for (int32_t s = 0; s < 80; ++s) {
      if (s % 5 != 0) {
        ASSERT_EQ(0, std::memcmp(&all[a * V], &real[r * V], V * sizeof(float))) << "real row of sequence " << s;
        ++a, ++r;
      }
      EXPECT_EQ(tokens[s], kernels::ArgmaxFirst(&all[a * V], V)) << "speculative row of sequence " << s;
      ++a;
    }
    EXPECT_EQ(static_cast<size_t>(r * V), real.size());
    EXPECT_EQ(static_cast<size_t>(a * V), all.size());
  }
}

TEST_F(SmolLM2EngineTest, ContextShortlistPicksTheBestSeenToken) {
  const int64_t V = model_->config.n_vocab, d = model_->config.n_embd;
  const auto prompt = Encode("The cat sat on the mat. The dog sat on the log. The cat");
  ContextShortlist list(V);
  list.Note(3, prompt);
  list.Note(3, {-1, static_cast<int32_t>(V)});  // outside the vocabulary: ignored
  std::vector<int32_t> unique;
  for (int32_t t : prompt) {
    if (std::find(unique.begin(), unique.end(), t) == unique.end()) unique.push_back(t);
  }
  EXPECT_EQ(list.size(3), static_cast<int64_t>(unique.size()));
  // The final hidden state of the last prompt row, and the full head's logits for it.
  auto engine_owner = testing_util::NewEngine(*model_, {.matmul = model::Transformer::MatMulKind::kF32});
  Engine& engine = *engine_owner;
  auto logits = engine.PromptLogits(0, prompt, {static_cast<int64_t>(prompt.size()) - 1});
  ASSERT_TRUE(logits.ok());
  int32_t want = unique[0];
  for (int32_t t : unique) {
    if ((*logits)[t] > (*logits)[want]) want = t;
  }
  // Recover the hidden state by running the rows through a transformer with spec_hidden.
  ThreadPool pool(1);
  backend::CpuDevice device(0, pool);
  auto tf = model::Transformer::Create(*model_, device, model::Transformer::MatMulKind::kF32);
  ASSERT_TRUE(tf.ok()) << tf.status();
  DenseKvCache kv(model_->config, device);
  std::vector<model::BatchRow> rows;
  for (size_t i = 0; i < prompt.size(); ++i) {
    rows.push_back({0, static_cast<int64_t>(i), prompt[i], i + 1 == prompt.size(), i + 1 == prompt.size()});
  }
  std::vector<float> none, hidden;
  ASSERT_TRUE((*tf)->Forward(rows, kv, &none, &hidden).ok());
  ASSERT_EQ(static_cast<int64_t>(hidden.size()), d);
  EXPECT_TRUE(none.empty());
  // On the cpu device (two threads) and on the simulated one: the same answers.
  ThreadPool two_threads(2);
  backend::CpuDevice cpu(0, two_threads);
  auto sim = backend::CreateDevice("sim", {.budget_bytes = 0, .pool = &two_threads});
  ASSERT_TRUE(sim.ok()) << sim.status();
  for (backend::Device* dev : {static_cast<backend::Device*>(&cpu), sim->get()}) {
    SCOPED_TRACE(dev->name());
    // The output matrix where this device keeps it.
    auto weights = model::DeviceWeights::Upload(*model_, *dev);
    ASSERT_TRUE(weights.ok()) << weights.status();
    const kernels::WeightView& out = (*weights)->output;
    ContextShortlist list(V);
    list.Note(3, prompt);
    EXPECT_EQ(list.Argmax(3, out, hidden.data()).status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(list.Attach(*dev, d).ok());
    EXPECT_EQ(*list.Argmax(3, out, hidden.data()), want);
    EXPECT_EQ(list.cached_rows(), static_cast<int64_t>(unique.size()));  // every row cached once
    EXPECT_EQ(*list.Argmax(3, out, hidden.data()), want);                 // from the cache
    EXPECT_EQ(list.cached_rows(), static_cast<int64_t>(unique.size()));
    // A cap below the set: the first rows cached, the rest dequantized per call, same answer.
    for (int64_t cap_rows : {int64_t{0}, int64_t{3}}) {
      ContextShortlist capped(V, cap_rows * d * static_cast<int64_t>(sizeof(float)));
      ASSERT_TRUE(capped.Attach(*dev, d).ok());
      capped.Note(3, prompt);
      EXPECT_EQ(*capped.Argmax(3, out, hidden.data()), want) << cap_rows;
      EXPECT_EQ(capped.cached_rows(), cap_rows);
    }
    list.Copy(3, 5);
    EXPECT_EQ(*list.Argmax(5, out, hidden.data()), want);
    list.Reset(3);
    EXPECT_EQ(list.size(3), 0);
    EXPECT_EQ(*list.Argmax(3, out, hidden.data()), -1);
  }
}

// The speculative chain's resync (EngineOptions::spec_resync): text that repeats and then
// jumps back to its start. The real tokens are fed (a copy of the prompt's text, then its first
// tokens again), so the step after the jump misses for certain; with the resync the next
// speculative token is the context's continuation and the chain is back in step, without it the
// row's output from the wrong token. Results never change: the logits are identical either way.
TEST_F(SmolLM2EngineTest, SpecResyncPutsTheChainBackInStepAfterAJump) {
  const std::vector<int32_t> text = Encode(testing_util::LicenseText());
  ASSERT_GT(text.size(), 400u);
  const std::vector<int32_t> p(text.begin(), text.begin() + 300);
  std::vector<int32_t> prompt = p;
  prompt.insert(prompt.end(), p.begin(), p.begin() + 100);
  std::vector<int32_t> fed(p.begin() + 100, p.begin() + 140);  // the copy goes on
  fed.insert(fed.end(), p.begin(), p.begin() + 30);            // then jumps back to its start
  const int64_t V = model_->config.n_vocab;
  struct Run {
    std::vector<float> logits;
    int64_t hits = 0, resyncs = 0;
  };
  auto run = [&](bool resync) {
    EngineOptions o;
    o.mode = DecodeMode::kDualDecoder;
    o.sparse.budget_tokens = 128;
    o.spec_resync = resync;
    auto engine_owner = testing_util::NewEngine(*model_, o);
    Engine& engine = *engine_owner;
    Run r;
    EXPECT_TRUE(engine.Prefill(0, prompt).ok());
    const int32_t seq = 0;
    std::vector<float> step;
    for (int32_t t : fed) {
      EXPECT_TRUE(engine.DecodeStep({&seq, 1}, {&t, 1}, &step).ok());
      r.logits.insert(r.logits.end(), step.begin(), step.begin() + V);
    }
    r.hits = engine.kv().total_stats().hits;
    r.resyncs = engine.spec_resyncs();
    return r;
  };
  const Run on = run(true), off = run(false);
  ASSERT_EQ(on.logits.size(), off.logits.size());
  EXPECT_EQ(0, std::memcmp(on.logits.data(), off.logits.data(), on.logits.size() * sizeof(float)));
  EXPECT_EQ(off.resyncs, 0);
  EXPECT_GE(on.resyncs, 1);
  EXPECT_LE(on.resyncs, static_cast<int64_t>(fed.size()));
  EXPECT_GT(on.hits, off.hits) << "resyncs " << on.resyncs;
  std::printf("chunk hits: %lld with the resync (%lld resyncs), %lld without\n", static_cast<long long>(on.hits),
              static_cast<long long>(on.resyncs), static_cast<long long>(off.hits));
}

}  // namespace
}  // namespace dd::engine
