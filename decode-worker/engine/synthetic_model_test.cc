// The synthetic models (decode-worker/model/synthetic_model.h): written files load as models of
// the asked shape, their matrices have the stated scale for every block type, the bytes are
// reproducible, and the engine runs them in every mode, also from random KV in place of a
// prefill (Engine::PrefillSynthetic).
#include "decode-worker/model/synthetic_model.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dd/kernels/cpu_ops.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/engine_test_util.h"
#include "decode-worker/engine/sampler.h"
#include "decode-worker/model/weights.h"
#include "gtest/gtest.h"

namespace dd::model {
namespace {

using kernels::DType;

class SyntheticModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("synthetic-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A small model of each architecture, rows long enough for every block type (multiples of 256).
  static SyntheticShape Small(const std::string& arch) {
    SyntheticShape s;
    s.name = "small-" + arch;
    s.arch = arch;
    s.n_layer = arch == "gemma3" ? 6 : 2, s.n_embd = 256, s.n_head = 4, s.n_head_kv = 2, s.head_dim = 64;
    s.n_ff = 512, s.n_vocab = 300, s.n_ctx = 4096;
    if (arch == "gemma3") s.sliding_window = 64, s.tied = true;
    if (arch == "llama") s.llama3_rope = true;
    return s;
  }

  std::string Write(const SyntheticShape& s, uint64_t seed = 1) {
    const std::string path = (dir_ / (s.name + "-" + std::to_string(seed) + ".gguf")).string();
    const absl::Status st = WriteSyntheticGguf(s, {.seed = seed}, path);
    EXPECT_TRUE(st.ok()) << st;
    return path;
  }

  static std::string Bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }

  std::filesystem::path dir_;
};

TEST_F(SyntheticModelTest, TheNamedShapesAreTheRealModelsAndSizedLikeTheirFiles) {
  auto llama = SyntheticShapeNamed("llama-3.1-8b");
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->n_layer, 32);
  EXPECT_EQ(llama->n_head_kv, 8);
  EXPECT_EQ(llama->n_ff, 14336);
  // Q4_K layers and embedding, Q6_K output: a Q4_K_M 8B file is 4.6-4.9 GB.
  auto bytes = SyntheticGgufBytes(*llama, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_GT(*bytes, 4'400'000'000);
  EXPECT_LT(*bytes, 4'900'000'000);
  // The real Gemma file (Q4_K_M) is 253 MB; the synthetic one differs only where llama.cpp
  // mixes in Q6_K / Q8_0 for some layers.
  auto gemma = SyntheticShapeNamed("gemma3-270m");
  ASSERT_TRUE(gemma.ok());
  bytes = SyntheticGgufBytes(*gemma, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_GT(*bytes, 230'000'000);
  EXPECT_LT(*bytes, 260'000'000);
  auto bad = SyntheticShapeNamed("llama-70b");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("known: llama-3.1-8b, gemma3-270m, smollm2-135m"), std::string::npos);
}

TEST_F(SyntheticModelTest, LoadsAsAModelOfItsShape) {
  for (const std::string arch : {"llama", "gemma3"}) {
    SCOPED_TRACE(arch);
    const SyntheticShape s = Small(arch);
    auto m = LoadGguf(Write(s));
    ASSERT_TRUE(m.ok()) << m.status();
    const ModelConfig& c = (*m)->config;
    EXPECT_EQ(c.arch_name, arch);
    EXPECT_EQ(c.n_layer, s.n_layer);
    EXPECT_EQ(c.n_embd, s.n_embd);
    EXPECT_EQ(c.n_head_kv, s.n_head_kv);
    EXPECT_EQ(c.n_vocab, s.n_vocab);
    EXPECT_EQ(c.n_ctx_train, s.n_ctx);
    EXPECT_EQ(c.tied_embeddings, s.tied);
    EXPECT_EQ(c.sliding_window, s.sliding_window);
    // One token per byte.
    EXPECT_EQ((*m)->tokenizer->Encode("hello", false, false).size(), 5u);
    EXPECT_EQ((*m)->weights.layers[0].wq.type, DType::kQ4_K);
  }
}

TEST_F(SyntheticModelTest, EveryBlockTypeGivesUnitScaleOutputs) {
  for (DType t : {DType::kQ4_K, DType::kQ6_K, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1, DType::kQ5_0}) {
    SCOPED_TRACE(static_cast<int>(t));
    SyntheticShape s = Small("llama");
    s.name += std::to_string(static_cast<int>(t));
    s.matrices = s.fallback = t;
    auto m = LoadGguf(Write(s));
    ASSERT_TRUE(m.ok()) << m.status();
    const kernels::WeightView& w = (*m)->weights.layers[0].w_down;  // n_ff inputs
    ASSERT_EQ(w.type, t);
    std::vector<float> row(w.cols);
    double sum = 0, sq = 0;
    for (int64_t r = 0; r < w.rows; ++r) {
      kernels::DequantizeRow(t, static_cast<const uint8_t*>(w.data) + r * w.row_bytes, row.data(), w.cols);
      for (float v : row) {
        ASSERT_TRUE(std::isfinite(v));
        sum += v, sq += static_cast<double>(v) * v;
      }
    }
    const double n = static_cast<double>(w.rows * w.cols);
    const double mean = sum / n, stddev = std::sqrt(sq / n - mean * mean);
    // std ≈ 1/sqrt(cols): a unit-RMS input gives about unit-RMS outputs.
    const double want = 1.0 / std::sqrt(static_cast<double>(w.cols));
    EXPECT_NEAR(stddev / want, 1.0, 0.15);
    EXPECT_LT(std::abs(mean), 0.2 * want);
  }
}

TEST_F(SyntheticModelTest, TheSameSeedGivesTheSameBytes) {
  const SyntheticShape s = Small("llama");
  const std::string a = Bytes(Write(s, 7)), b = Bytes(Write(s, 7)), c = Bytes(Write(s, 8));
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), c.size());
  EXPECT_NE(a, c);
  auto bytes = SyntheticGgufBytes(s, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, static_cast<int64_t>(a.size()));
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {  // no temporary file left
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();
  }
}

TEST_F(SyntheticModelTest, BadShapesAndPathsAreRefusedNamingTheProblem) {
  SyntheticShape s = Small("llama");
  s.arch = "mamba";
  absl::Status st = WriteSyntheticGguf(s, {}, (dir_ / "x.gguf").string());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("arch 'mamba'"), std::string::npos) << st;
  s = Small("llama");
  s.matrices = DType::kF16;
  st = WriteSyntheticGguf(s, {}, (dir_ / "x.gguf").string());
  EXPECT_NE(st.message().find("is not one of Q4_K"), std::string::npos) << st;
  s = Small("llama");
  s.n_embd = 100, s.matrices = s.fallback = DType::kQ4_K;  // rows of 100 hold no whole blocks
  st = WriteSyntheticGguf(s, {}, (dir_ / "x.gguf").string());
  EXPECT_NE(st.message().find("hold whole blocks"), std::string::npos) << st;
  s = Small("llama");
  s.n_layer = 1 << 20;
  EXPECT_EQ(WriteSyntheticGguf(s, {}, (dir_ / "x.gguf").string()).code(), absl::StatusCode::kInvalidArgument);
  st = WriteSyntheticGguf(Small("llama"), {}, (dir_ / "no-such-dir" / "x.gguf").string());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("cannot create"), std::string::npos) << st;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "x.gguf"));
}

// The engine runs a synthetic model in every mode; with a budget covering every chunk the
// sparse modes' tokens are full's (the selection is exact), and logits stay finite.
TEST_F(SyntheticModelTest, TheEngineRunsItInEveryMode) {
  for (const std::string arch : {"llama", "gemma3"}) {
    SCOPED_TRACE(arch);
    auto m = LoadGguf(Write(Small(arch)));
    ASSERT_TRUE(m.ok()) << m.status();
    std::vector<int32_t> prompt;
    for (int i = 0; i < 200; ++i) prompt.push_back(static_cast<int32_t>((i * 37) % 256));
    std::vector<int32_t> want;
    for (engine::DecodeMode mode : {engine::DecodeMode::kFull, engine::DecodeMode::kSparse,
                                    engine::DecodeMode::kSparseCached, engine::DecodeMode::kDualDecoder}) {
      engine::EngineOptions o{.mode = mode, .threads = 1};
      o.sparse.budget_tokens = 256;
      auto e = engine::Engine::Create(**m, o);
      ASSERT_TRUE(e.ok()) << e.status();
      engine::GenerateOptions g;
      g.max_new_tokens = 6;
      g.stop_at_eos = false;
      auto r = (*e)->Generate(prompt, g, nullptr);
      ASSERT_TRUE(r.ok()) << r.status();
      if (want.empty()) want = r->tokens;
      EXPECT_EQ(r->tokens, want) << engine::DecodeModeName(mode);
    }
    EXPECT_EQ(want.size(), 6u);
    auto full_owner = engine::testing_util::NewEngine(**m, {.threads = 1});
    engine::Engine& full = *full_owner;
    auto logits = full.PromptLogits(0, prompt, {199});
    ASSERT_TRUE(logits.ok());
    for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
  }
}

// Random KV stands in for a prefill (the long-context benchmarks): every cache holds the same
// rows, so a sparse budget covering the context gives full's logits bit for bit; the sparse
// modes stay bit-identical under the selection model; the seed decides the rows; bad calls
// are refused, naming the problem.
TEST_F(SyntheticModelTest, RandomKvStandsInForAPrefill) {
  for (const std::string arch : {"llama", "gemma3"}) {
    SCOPED_TRACE(arch);
    auto m = LoadGguf(Write(Small(arch)));
    ASSERT_TRUE(m.ok()) << m.status();
    const int64_t n = 1500, V = (*m)->config.n_vocab;
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < n; ++i) prompt.push_back(static_cast<int32_t>((i * 37) % 256));
    auto run = [&](engine::DecodeMode mode, int64_t budget, const char* selection, uint64_t seed) {
      engine::EngineOptions o{.mode = mode, .threads = 1};
      o.sparse.budget_tokens = budget;
      o.sparse.selection_model = *engine::SelectionModel::Parse(selection);
      auto e = engine::Engine::Create(**m, o);
      EXPECT_TRUE(e.ok()) << e.status();
      EXPECT_TRUE((*e)->Admit(0, n, n + 8).ok());
      const absl::Status st = (*e)->PrefillSynthetic(0, prompt, n - 1, seed);
      EXPECT_TRUE(st.ok()) << st;
      EXPECT_EQ((*e)->Length(0), n - 1);
      std::vector<std::vector<float>> last;
      const engine::Engine::PrefillPiece piece{0, prompt, n - 1, n};
      EXPECT_TRUE((*e)->PrefillParts({&piece, 1}, &last).ok());
      std::vector<float> all = last[0], logits;
      int32_t seq = 0, t = engine::Argmax(all.data(), V);
      for (int step = 0; step < 5; ++step) {
        EXPECT_TRUE((*e)->DecodeStep({&seq, 1}, {&t, 1}, &logits).ok());
        all.insert(all.end(), logits.begin(), logits.end());
        t = engine::Argmax(logits.data(), V);
      }
      return all;
    };
    using engine::DecodeMode;
    const auto full = run(DecodeMode::kFull, 256, "off", 5);
    const auto covering = run(DecodeMode::kSparse, 2048, "off", 5);
    ASSERT_EQ(full.size(), covering.size());
    EXPECT_EQ(0, std::memcmp(full.data(), covering.data(), full.size() * sizeof(float)));
    EXPECT_NE(full, run(DecodeMode::kFull, 256, "off", 6)) << "the seed changed nothing";
    const auto cached = run(DecodeMode::kSparseCached, 256, "0.8:0.9", 5);
    const auto dual = run(DecodeMode::kDualDecoder, 256, "0.8:0.9", 5);
    EXPECT_EQ(0, std::memcmp(cached.data(), dual.data(), cached.size() * sizeof(float)));
    EXPECT_NE(cached, full);  // 256 of 1500 tokens do not give full's logits

    auto e_owner = engine::testing_util::NewEngine(**m, {.threads = 1});
    engine::Engine& e = *e_owner;
    EXPECT_EQ(e.PrefillSynthetic(0, prompt, 10, 1).code(), absl::StatusCode::kFailedPrecondition);  // not admitted
    ASSERT_TRUE(e.Admit(0, n, n).ok());
    for (int64_t upto : {int64_t{0}, n}) {
      const absl::Status st = e.PrefillSynthetic(0, prompt, upto, 1);
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(st.message().find("want 1 to 1499"), absl::string_view::npos) << st;
    }
    ASSERT_TRUE(e.PrefillSynthetic(0, prompt, 100, 1).ok());
    EXPECT_EQ(e.PrefillSynthetic(0, prompt, 100, 1).code(), absl::StatusCode::kFailedPrecondition);  // not empty
  }
}

}  // namespace
}  // namespace dd::model
