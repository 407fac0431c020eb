// Device-memory accounting: the plan's projection against the caches' real bytes, and
// admission against --device-memory, on the real Gemma 3 270M.
#include "decode-worker/engine/memory_plan.h"

#include <utility>
#include <vector>

#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

using testing_util::GemmaTest;

class MemoryPlanTest : public GemmaTest {
 protected:
  std::vector<int32_t> Prompt(size_t n) {
    std::vector<int32_t> ids = Encode(testing_util::LicenseText());
    EXPECT_GE(ids.size(), n);
    ids.resize(n);
    return ids;
  }
  static EngineOptions Options(DecodeMode mode, int64_t device_memory = 0) {
    EngineOptions o;
    o.mode = mode;
    o.sparse.budget_tokens = 512;
    o.device_memory_bytes = device_memory;
    return o;
  }
};

TEST_F(MemoryPlanTest, TheDeviceHoldsWhatThePlanProjectsInEveryMode) {
  const std::vector<int32_t> prompt = Prompt(1300);
  // Which modes keep a resident set (KvFetch::kResident, set by the engine from the mode).
  const std::vector<std::pair<DecodeMode, bool>> modes = {{DecodeMode::kFull, false},
                                                          {DecodeMode::kSparse, false},
                                                          {DecodeMode::kSparseCached, true},
                                                          {DecodeMode::kDualDecoder, true}};
  using backend::MemoryTag;
  // f32 on both devices; f16 (half the rows' and blocks' bytes) on the cpu, also with every
  // sparse layer's low-rank key cache (key reconstruction).
  struct Run {
    const char* device;
    KvDtype kv;
    bool low_rank;
  };
  const std::vector<Run> runs = {{"cpu", KvDtype::kF32, false},
                                 {"sim", KvDtype::kF32, false},
                                 {"cpu", KvDtype::kF16, false},
                                 {"cpu", KvDtype::kF16, true}};
  for (auto [device_name, kv, low_rank] : runs) {
  for (auto [mode, resident] : modes) {
    if (low_rank && mode == DecodeMode::kFull) continue;  // refused: nothing to rebuild
    SCOPED_TRACE(std::string(device_name) + ", " + std::string(KvDtypeName(kv)) + ": " +
                 std::string(DecodeModeName(mode)) + (low_rank ? ", key reconstruction" : ""));
    EngineOptions o = Options(mode);
    o.device = device_name;
    o.kv_dtype = kv;
    if (low_rank) o.sparse.key_reconstruction.mode = KeyReconstructionMode::kAll;
    auto e = Engine::Create(*model_, o);
    ASSERT_TRUE(e.ok()) << e.status();
    const MemoryPlan& plan = (*e)->memory_plan();
    const backend::Device& device = (*e)->device();
    const auto expect_tags = [&](const KvBytes& want, int64_t prefill_extra) {
      EXPECT_EQ(device.bytes_in_use(MemoryTag::kKv), want.kv + prefill_extra);
      EXPECT_EQ(device.bytes_in_use(MemoryTag::kLandmarks), want.landmarks);
      EXPECT_EQ(device.bytes_in_use(MemoryTag::kResidentSlots), want.resident);
      EXPECT_EQ(device.bytes_in_use(MemoryTag::kLowRankKeys), want.low_rank);
    };
    EXPECT_EQ(plan.DecodeKv(1310).low_rank > 0, low_rank);
    // The weights on the device are what the plan counts, in every mode.
    EXPECT_EQ(device.bytes_in_use(MemoryTag::kWeights), plan.weight_bytes());
    const int64_t idle_workspace = device.bytes_in_use(MemoryTag::kWorkspace);
    // Before any request: the workspace is what the plan shares (the forward workspace, the
    // context head's buffers).
    EXPECT_EQ(idle_workspace, plan.shared_workspace_bytes());
    ASSERT_TRUE((*e)->Admit(0, 1300, 1310).ok());
    const RequestBytes r = plan.Request(1300, 1310);
    // Everything is allocated at admission: exactly the plan, the prompt's rows included.
    expect_tags(plan.DecodeKv(1310), r.prefill_extra);
    // The request's own workspace (sparse modes): its landmark scores, without a resident set
    // its urgent blocks, and in a narrow KV type a speculative row's own K and V.
    const int64_t row = 2 * model_->config.n_head_kv * model_->config.head_dim * KvDtypeBytes(kv);
    const bool sparse = mode != DecodeMode::kFull;
    EXPECT_EQ(device.bytes_in_use(MemoryTag::kWorkspace) - idle_workspace,
              (sparse ? ChunkSelector::ScoresBytes(model_->config, o.sparse, 1310) : 0) +
                  (sparse && !resident ? o.sparse.budget_tokens * row : 0) +
                  (sparse && kv != KvDtype::kF32 ? row : 0));
    EXPECT_EQ((*e)->options().sparse.fetch == KvFetch::kResident, resident && sparse);
    auto logits = (*e)->Prefill(0, prompt);
    ASSERT_TRUE(logits.ok()) << logits.status();
    expect_tags(plan.DecodeKv(1310), r.prefill_extra);  // prefill allocated nothing
    int32_t seq = 0, tok = Argmax(logits->data(), model_->config.n_vocab);
    std::vector<float> out;
    for (int step = 0; step < 4; ++step) {
      ASSERT_TRUE((*e)->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&tok, 1), &out).ok());
      tok = Argmax(out.data(), model_->config.n_vocab);
      // Decoding released the prompt's rows: the steady state of the admitted request.
      expect_tags(plan.DecodeKv(1310), 0);
    }
    // A fork holds what its source holds (every buffer duplicated, none shared) and decodes on.
    ASSERT_TRUE((*e)->Fork(0, 1).ok());
    const KvBytes one = plan.DecodeKv(1310);
    const KvBytes two{2 * one.kv, 2 * one.landmarks, 2 * one.resident, 2 * one.low_rank};
    expect_tags(two, 0);
    const std::vector<int32_t> both = {0, 1}, toks = {tok, tok};
    ASSERT_TRUE((*e)->DecodeStep(both, toks, &out).ok());
    expect_tags(two, 0);
    (*e)->Release(0);
    expect_tags(one, 0);
    (*e)->Release(1);
    expect_tags(KvBytes{}, 0);
    EXPECT_EQ(device.bytes_in_use(MemoryTag::kWorkspace), idle_workspace);
  }
  }
}

// A decode step allocates nothing: with passes of 2 rows, a dualdecoder step of 3 requests
// (6 rows) finds its workspace grown at admission, and the device's bytes do not move.
TEST_F(MemoryPlanTest, ADecodeStepAllocatesNothing) {
  const std::vector<std::pair<const char*, KvDtype>> runs = {
      {"cpu", KvDtype::kF32}, {"sim", KvDtype::kF32}, {"cpu", KvDtype::kF16}};
  for (auto [device_name, kv] : runs) {
    SCOPED_TRACE(std::string(device_name) + ", " + std::string(KvDtypeName(kv)));
    EngineOptions o = Options(DecodeMode::kDualDecoder);
    o.device = device_name;
    o.kv_dtype = kv;
    o.prefill_chunk = 2;
    auto e = Engine::Create(*model_, o);
    ASSERT_TRUE(e.ok()) << e.status();
    const std::vector<int32_t> seqs = {0, 1, 2};
    for (int32_t s : seqs) ASSERT_TRUE((*e)->Admit(s, 40, 60).ok());
    // The workspace grown past its first 2 rows stays within what the plan charged for it.
    const MemoryPlan& plan = (*e)->memory_plan();
    EXPECT_LE((*e)->device().bytes_in_use(backend::MemoryTag::kWorkspace),
              plan.shared_workspace_bytes() + 3 * plan.Request(40, 60).workspace);
    std::vector<int32_t> tokens;
    for (int32_t s : seqs) {
      auto logits = (*e)->Prefill(s, Prompt(40));
      ASSERT_TRUE(logits.ok()) << logits.status();
      tokens.push_back(Argmax(logits->data(), model_->config.n_vocab));
    }
    std::vector<float> out;
    const backend::Device& device = (*e)->device();
    const int64_t workspace = device.bytes_in_use(backend::MemoryTag::kWorkspace);
    ASSERT_TRUE((*e)->DecodeStep(seqs, tokens, &out).ok());  // the prompts' rows released here
    EXPECT_EQ(device.bytes_in_use(backend::MemoryTag::kWorkspace), workspace);
    for (int step = 0; step < 3; ++step) {
      const int64_t before = device.bytes_in_use();
      ASSERT_TRUE((*e)->DecodeStep(seqs, tokens, &out).ok());
      EXPECT_EQ(device.bytes_in_use(), before) << "step " << step;
    }
  }
}

TEST_F(MemoryPlanTest, SparseModesNeedLessThanFullAtLongContext) {
  const SparseOptions so{.budget_tokens = 2048};
  const MemoryPlan full(*model_, DecodeMode::kFull, so), sparse(*model_, DecodeMode::kSparse, so),
      dual(*model_, DecodeMode::kDualDecoder, so);
  const int64_t n = 32000;
  EXPECT_LT(sparse.DecodeKvBytes(n), full.DecodeKvBytes(n) / 4);
  EXPECT_LT(sparse.DecodeKvBytes(n), dual.DecodeKvBytes(n));  // the resident sets
  // The resident sets (one budget per global layer) still leave room for 4× the requests.
  const MemoryPlan cached(*model_, DecodeMode::kSparseCached, so);
  EXPECT_LT(cached.DecodeKvBytes(n), full.DecodeKvBytes(n) / 4);
  EXPECT_EQ(cached.DecodeKvBytes(n), dual.DecodeKvBytes(n));  // the prefetch lands in the resident set
  EXPECT_GT(cached.DecodeKvBytes(n), sparse.DecodeKvBytes(n));
  // Prefill holds the prompt densely, so a sparse request's peak matches full's.
  const RequestBytes rs = sparse.Request(n, n), rf = full.Request(n, n);
  EXPECT_GE(rs.kv + rs.prefill_extra, rf.kv - 3 * (16 + 64 + 8) * 2 * 256 * 4);
}

TEST_F(MemoryPlanTest, AdmissionStopsAtTheBudget) {
  const MemoryPlan plan(*model_, DecodeMode::kSparse, SparseOptions{.budget_tokens = 512});
  const RequestBytes r = plan.Request(16, 1100);
  // Three requests fit even while all three are still prefilling.
  const int64_t budget = plan.weight_bytes() + plan.shared_workspace_bytes() + 3 * (r.steady() + r.prefill_extra) + 1;
  EXPECT_EQ(plan.MaxBatch(budget, 16, 1100), 3);
  auto e = Engine::Create(*model_, Options(DecodeMode::kSparse, budget));
  ASSERT_TRUE(e.ok()) << e.status();
  Engine& eng = **e;
  for (int32_t s = 0; s < 3; ++s) ASSERT_TRUE(eng.Admit(s, 16, 1100).ok()) << s;
  absl::Status fourth = eng.Admit(3, 16, 1100);
  EXPECT_EQ(fourth.code(), absl::StatusCode::kResourceExhausted) << fourth;
  EXPECT_NE(fourth.message().find("device memory full"), std::string::npos) << fourth;
  EXPECT_EQ(eng.admitted(), 3);
  eng.Release(1);
  EXPECT_EQ(eng.admitted(), 2);
  EXPECT_TRUE(eng.Admit(3, 16, 1100).ok());
  EXPECT_EQ(eng.Admit(3, 16, 1100).code(), absl::StatusCode::kFailedPrecondition);
  // A long prompt's prefill transient counts while it is prefilling.
  eng.Release(3);
  const RequestBytes big = plan.Request(1000, 1100);
  ASSERT_GT(big.prefill_extra, r.steady() + r.prefill_extra) << "test premise";
  EXPECT_EQ(eng.Admit(3, 1000, 1100).code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(MemoryPlanTest, BudgetTooSmallForOneRequestIsAClearError) {
  auto tiny = Engine::Create(*model_, Options(DecodeMode::kFull, 1 << 20));
  ASSERT_FALSE(tiny.ok());
  EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tiny.status().message().find("too small for even one request"), std::string::npos) << tiny.status();

  // Fits a short request, not a 32K one in full mode: Generate is refused before any work.
  const MemoryPlan plan(*model_, DecodeMode::kFull, SparseOptions{});
  const int64_t budget = plan.weight_bytes() + plan.shared_workspace_bytes() + plan.Request(64, 128).steady() * 2;
  auto e = Engine::Create(*model_, Options(DecodeMode::kFull, budget));
  ASSERT_TRUE(e.ok()) << e.status();
  absl::Status big = (*e)->Admit(0, 30000, 32000);
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.message().find("cannot hold even one request of 32000 tokens"), std::string::npos) << big;
  GenerateOptions g;
  g.max_new_tokens = 4;
  auto ok = (*e)->Generate(Prompt(64), g, nullptr);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(MemoryPlanTest, DecodeBeyondTheAdmittedLengthIsRefused) {
  auto e = Engine::Create(*model_, Options(DecodeMode::kFull));
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->Admit(0, 16, 17).ok());
  auto logits = (*e)->Prefill(0, Prompt(16));
  ASSERT_TRUE(logits.ok()) << logits.status();
  int32_t seq = 0, tok = 1;
  std::vector<float> out;
  ASSERT_TRUE((*e)->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&tok, 1), &out).ok());
  absl::Status st = (*e)->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&tok, 1), &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange) << st;
  seq = 5;
  EXPECT_EQ((*e)->DecodeStep(absl::MakeConstSpan(&seq, 1), absl::MakeConstSpan(&tok, 1), &out).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ParseByteSizeTest, UnitsAndErrors) {
  EXPECT_EQ(*ParseByteSize("4096", "device_memory"), 4096);
  EXPECT_EQ(*ParseByteSize("512MiB", "device_memory"), int64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize("1.5G", "device_memory"), int64_t{3} << 29);
  EXPECT_EQ(*ParseByteSize("2 gib", "device_memory"), int64_t{2} << 30);
  EXPECT_EQ(*ParseByteSize("12TiB", "device_memory"), int64_t{12} << 40);
  // Each refusal names the flag and the actual reason.
  for (auto [bad, reason] : std::vector<std::pair<const char*, const char*>>{{"", "non-negative size"},
                                                                            {"abc", "non-negative size"},
                                                                            {"-1G", "non-negative size"},
                                                                            {"12PiB", "unknown unit 'pib'"},
                                                                            {"1e30", "larger than 8 EiB"}}) {
    auto r = ParseByteSize(bad, "device_memory");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--device_memory"), std::string::npos);
    EXPECT_NE(r.status().message().find(reason), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace dd::engine
