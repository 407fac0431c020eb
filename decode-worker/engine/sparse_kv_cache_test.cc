// `sparse` mode on the real Gemma 3 270M: exactness against `full` when the budget covers the
// context, on-demand fetch accounting, device-memory savings, and bad configurations.
#include "decode-worker/engine/sparse_kv_cache.h"

#include <cstring>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

class SparseModeTest : public testing_util::GemmaTest {
 protected:
  std::vector<int32_t> LongPrompt(int variant, size_t min_tokens) {
    std::string text;
    for (int i = 0; static_cast<size_t>(i) < min_tokens / 8; ++i) {
      text += (variant == 0 ? "The river flows past mill number " : "Entry ") + std::to_string(i * (variant + 3)) + ". ";
    }
    return Encode(text);
  }
  // Greedy-decodes `steps` tokens for two prompts in one batch; returns all step logits.
  std::vector<float> Run(Engine& e, int steps, size_t tokens0 = 1200, size_t tokens1 = 900) {
    const std::vector<int32_t> seqs = {0, 1};
    auto first = e.PrefillBatch(seqs, {LongPrompt(0, tokens0), LongPrompt(1, tokens1)});
    EXPECT_TRUE(first.ok()) << first.status();
    const int64_t V = model_->config.n_vocab;
    std::vector<int32_t> tokens = {Argmax((*first)[0].data(), V), Argmax((*first)[1].data(), V)};
    std::vector<float> logits, all;
    for (int i = 0; i < steps; ++i) {
      EXPECT_TRUE(e.DecodeStep(seqs, tokens, &logits).ok());
      all.insert(all.end(), logits.begin(), logits.end());
      for (int s = 0; s < 2; ++s) tokens[s] = Argmax(&logits[s * V], V);
    }
    return all;
  }
};

TEST_F(SparseModeTest, BudgetCoveringContextIsBitIdenticalToFull) {
  Engine full(*model_, {});
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 4096;  // > every selectable chunk
  auto sparse = Engine::Create(*model_, o);
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  const auto a = Run(full, 6);
  const auto b = Run(**sparse, 6);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  EXPECT_GT((*sparse)->fetched_chunks(), 0);  // chunks really came from the store
}

TEST_F(SparseModeTest, SmallBudgetFetchesExactlyTheBudgetAndSavesDeviceMemory) {
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 128;  // 16 chunks per step per KV head per sparse layer
  auto sparse = Engine::Create(*model_, o);
  ASSERT_TRUE(sparse.ok());
  Engine full(*model_, {});
  const auto a = Run(full, 4);
  const auto b = Run(**sparse, 4);
  // 4 steps × 2 sequences × 3 global layers × 1 KV head × 16 chunks.
  EXPECT_EQ((*sparse)->fetched_chunks(), 4 * 2 * 3 * 1 * 16);
  EXPECT_NE(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));  // it is sparse
  EXPECT_LT((*sparse)->kv_bytes(), full.kv_bytes());
}

// DESIGN §5.3 exactness: the dual-token step's real rows are bit-identical to `sparse` over 64
// steps at > 4K context, batch 2, different prompts; prediction only changes what is fetched
// when. Also checks the fetch accounting: every selected chunk is a hit or an urgent fetch.
TEST_F(SparseModeTest, DualDecoderRealRowsAreBitIdenticalToSparse) {
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 512;
  auto sparse = Engine::Create(*model_, o);
  o.mode = DecodeMode::kDualDecoder;
  auto dual = Engine::Create(*model_, o);
  ASSERT_TRUE(sparse.ok() && dual.ok());
  const auto a = Run(**sparse, 64, 4400, 4200);
  const auto b = Run(**dual, 64, 4400, 4200);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  const auto t = (*dual)->sparse_cache()->total_stats();
  const int64_t hits = t.hits, denom = t.predicted_for, selected = t.selected, urgent = t.urgent,
                prefetched = t.prefetched, wasted = t.wasted;
  EXPECT_EQ(selected, 64 * 2 * 3 * 64);  // steps × seqs × global layers × budget/8 chunks
  EXPECT_EQ(denom, selected);            // every step had a prediction (pre-decoding seeds it)
  EXPECT_EQ(hits + urgent, selected);
  // The last step's predictions already issued are never consumed: with d prefetch buffers
  // (default 2, ping-pong) the next d reads' prefetches are out: 2 seqs × d layers × 64 chunks.
  const int64_t issued_ahead = std::min<int64_t>(SparseOptions().prefetch_buffers, 3);
  EXPECT_EQ(prefetched - wasted - 2 * issued_ahead * 64, hits);
  EXPECT_GT(hits, selected / 2) << "hit rate " << double(hits) / denom;
}

TEST_F(SparseModeTest, InvalidConfigurationsAreClearErrors) {
  EngineOptions o;
  o.mode = DecodeMode::kSparse;
  o.sparse.budget_tokens = 4;
  auto small = Engine::Create(*model_, o);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(std::string(small.status().message()).find("smaller than one chunk"), std::string::npos);
  o.sparse.budget_tokens = model_->config.n_ctx_train + 8;
  auto large = Engine::Create(*model_, o);
  ASSERT_FALSE(large.ok());
  EXPECT_NE(std::string(large.status().message()).find("larger than the model context"), std::string::npos);
  EXPECT_EQ(ParseDecodeMode("bogus").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseDecodeMode("dualdecoder"), DecodeMode::kDualDecoder);
  EXPECT_TRUE(ParseDecodeMode("sparse").ok());
}

}  // namespace
}  // namespace dd::engine
