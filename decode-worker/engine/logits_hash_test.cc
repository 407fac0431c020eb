// The engine's bit-exactness gate: per-step logits hashes of every decode mode × both real
// models × batch 1 and 4, plus a slow-link dualdecoder run, compared with hashes recorded in
// engine/testdata/logits_hashes.txt. Any change to the engine (moving it onto another compute
// backend, splitting a class) must reproduce them bit for bit; a change that is meant to alter
// the numbers re-records them (below) and says why in its commit.
//
// The kernels are compiled with -march=native, so each line is keyed by the instruction set
// (KernelIsa()). AVX-512 and AVX2 (an AVX-512 host built with CXXFLAGS=-mno-avx512f) recorded
// the same hashes at 8f577b9; the portable path is not recorded. A kernel path
// with no recorded line skips the comparison, saying so; the checks between modes (sparse ==
// sparse-cached == dualdecoder real rows, batch 1 == row 0 of batch 4) run everywhere.
//
// Every case runs on the simulated device as well, against the same lines: a device must not
// change a bit, and the sim aborts on any missing wait.
//
// KV kept in f16 (--kv_dtype f16) has lines of its own (names ending in /f16): AVX-512 and AVX2
// (-mno-avx512f) recorded the same ones at b2cb903.
//
// Re-record: DD_RECORD_LOGITS_HASHES=1 build/bin/logits_hash_test, then commit the file.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "dd/backend/registry.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

// The instruction set the kernels were compiled for (the key of a recorded line).
std::string KernelIsa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

uint64_t Fnv1a(const void* data, size_t bytes, uint64_t h = 0xcbf29ce484222325ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

constexpr int kSteps = 12;
constexpr size_t kPromptTokens = 320;

struct Case {
  DecodeMode mode;
  int batch;
  bool slow_link;
  std::string device = "cpu";
  bool graphs = false;  // cuda: static segments as CUDA graphs
  KvDtype kv = KvDtype::kF32;
  // The recorded line's name (the same for every device).
  std::string Name() const {
    return absl::StrCat(DecodeModeName(mode), "/b", batch, slow_link ? "/slow-link" : "",
                        kv == KvDtype::kF32 ? "" : absl::StrCat("/", KvDtypeName(kv)));
  }
  std::string Label() const {
    return device == "cpu" ? Name() : absl::StrCat(Name(), "@", device, graphs ? "+graphs" : "");
  }
};

// Per step, one hash per row: hashes[step][row].
using StepHashes = std::vector<std::vector<uint64_t>>;

std::string Format(const StepHashes& h) {
  std::string s;
  for (const auto& step : h) {
    absl::StrAppend(&s, s.empty() ? "" : " ");
    uint64_t all = 0xcbf29ce484222325ULL;
    for (uint64_t r : step) all = Fnv1a(&r, sizeof(r), all);
    absl::StrAppend(&s, absl::StrFormat("%016x", all));
  }
  return s;
}

std::string GoldenPath() { return DD_LOGITS_GOLDEN; }

std::map<std::string, std::string> ReadGolden() {
  std::map<std::string, std::string> lines;
  std::ifstream f(GoldenPath());
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.find(' ');
    if (sp != std::string::npos) lines[line.substr(0, sp)] = line.substr(sp + 1);
  }
  return lines;
}

template <typename ModelFixture>
class LogitsHashTest : public ModelFixture {
 public:  // RunAndCompare runs the cases
  std::vector<int32_t> Prompt(int variant) {
    static const char* const kStarts[] = {"The river flows past mill number ", "Entry ", "Ledger line ",
                                          "A lighthouse keeper counted ship "};
    std::string text;
    std::vector<int32_t> ids;
    for (int i = 0; ids.size() < kPromptTokens; ++i) {
      text += absl::StrCat(kStarts[variant % 4], i * (variant + 3), ". ");
      if (i % 16 == 15) ids = this->Encode(text);
    }
    ids.resize(kPromptTokens);
    return ids;
  }

  // Greedy-decodes kSteps tokens for `c.batch` prompts in one batch.
  StepHashes Run(const Case& c) {
    EngineOptions o;
    o.mode = c.mode;
    o.threads = 2;
    o.device = c.device;
    o.cuda_graphs = c.graphs;
    o.kv_dtype = c.kv;
    o.sparse.budget_tokens = 32;  // 4 of ~30 selectable chunks: selection matters
    if (c.slow_link) o.link = kvpool::LinkModel{.bandwidth_gbps = 0.1, .latency_us = 50};
    auto e = Engine::Create(*this->model_, o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return {};
    std::vector<int32_t> seqs;
    std::vector<std::vector<int32_t>> prompts;
    for (int s = 0; s < c.batch; ++s) {
      seqs.push_back(s);
      prompts.push_back(Prompt(s));
    }
    auto first = (*e)->PrefillBatch(seqs, prompts);
    EXPECT_TRUE(first.ok()) << first.status();
    if (!first.ok()) return {};
    const int64_t V = this->model_->config.n_vocab;
    std::vector<int32_t> tokens;
    for (int s = 0; s < c.batch; ++s) tokens.push_back(Argmax((*first)[s].data(), V));
    StepHashes out;
    std::vector<float> logits;
    for (int i = 0; i < kSteps; ++i) {
      const absl::Status st = (*e)->DecodeStep(seqs, tokens, &logits);
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok()) return {};
      out.emplace_back();
      for (int s = 0; s < c.batch; ++s) {
        out.back().push_back(Fnv1a(&logits[s * V], V * sizeof(float)));
        tokens[s] = Argmax(&logits[s * V], V);
      }
      greedy_[c.Label()].push_back(tokens);
    }
    return out;
  }
  // Per case label, per step, the greedy tokens the run chose.
  std::map<std::string, std::vector<std::vector<int32_t>>> greedy_;
};

// Between modes, on any device and kernel path (cases by Name()): the sparse modes give the
// same bits (cached or prefetched chunks are attended exactly as fetched ones), and a row alone
// gives the bits it gives as row 0 of a batch.
// `t`: the names' KV type suffix ("" for f32, "/f16").
void ExpectModesAgree(std::map<std::string, StepHashes>& got, const std::string& device, const std::string& t = "") {
  for (int b : {1, 4}) {
    const std::string sparse = absl::StrCat("sparse/b", b, t);
    EXPECT_EQ(got[sparse], got[absl::StrCat("sparse-cached/b", b, t)])
        << device << ": sparse-cached != sparse at batch " << b << t;
    EXPECT_EQ(got[sparse], got[absl::StrCat("dualdecoder/b", b, t)]) << device << ": dualdecoder != sparse at batch " << b << t;
  }
  EXPECT_EQ(got["sparse/b4" + t], got["dualdecoder/b4/slow-link" + t]) << device << ": dualdecoder over a slow link != sparse" << t;
  for (const char* mode : {"full", "sparse"}) {
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_EQ(got[absl::StrCat(mode, "/b1", t)][i][0], got[absl::StrCat(mode, "/b4", t)][i][0])
          << device << " " << mode << t << ": row 0 alone != row 0 of a batch of 4 at step " << i;
    }
  }
  // Full attention must differ from a 32-token budget, or the sparse cases test nothing.
  EXPECT_NE(got["full/b4" + t], got["sparse/b4" + t]) << device << t;
}

using Models = ::testing::Types<testing_util::GemmaTest, testing_util::SmolLM2Test>;
class ModelNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return std::is_same_v<T, testing_util::GemmaTest> ? "gemma" : "smollm2";
  }
};
TYPED_TEST_SUITE(LogitsHashTest, Models, ModelNames);

// Every mode at batch 1 and 4 and dualdecoder over a slow link, KV kept in `kv`, on the cpu
// device; again on the simulated device (every case, or with `sim_dual_only` the dual-token
// step at batch 4, where a narrow type adds its own writes).
std::vector<Case> CasesOf(KvDtype kv, bool sim_dual_only) {
  std::vector<Case> cases;
  for (DecodeMode m : {DecodeMode::kFull, DecodeMode::kSparse, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    for (int b : {1, 4}) cases.push_back({.mode = m, .batch = b, .slow_link = false, .kv = kv});
  }
  cases.push_back({.mode = DecodeMode::kDualDecoder, .batch = 4, .slow_link = true, .kv = kv});
  const size_t on_cpu = cases.size();
  for (size_t i = 0; i < on_cpu; ++i) {
    Case c = cases[i];
    if (sim_dual_only && !(c.mode == DecodeMode::kDualDecoder && c.batch == 4 && !c.slow_link)) continue;
    c.device = "sim";
    cases.push_back(c);
  }
  return cases;
}

// Runs `cases`, checks that every device gives the cpu's bits and the modes agree (names ending
// in `t`), then compares the cpu's lines with the recorded ones, or records them
// (DD_RECORD_LOGITS_HASHES=1). Skips, saying so, where this kernel path has no line recorded.
template <typename Fixture>
void RunAndCompare(Fixture& fixture, const std::string& model, const std::vector<Case>& cases, const std::string& t,
                   std::map<std::string, StepHashes>& got) {
  for (const Case& c : cases) {
    got[c.Label()] = fixture.Run(c);
    ASSERT_EQ(got[c.Label()].size(), static_cast<size_t>(kSteps)) << c.Label();
  }
  for (const Case& c : cases) {
    if (c.device != "cpu") {
      EXPECT_EQ(got[c.Label()], got[c.Name()]) << c.Label() << " != the cpu device's bits";
    }
  }
  ExpectModesAgree(got, "cpu", t);
  const std::string isa = KernelIsa();
  if (const char* rec = std::getenv("DD_RECORD_LOGITS_HASHES"); rec != nullptr && std::string(rec) == "1") {
    std::ofstream f(GoldenPath(), std::ios::app);
    for (const Case& c : cases) {
      if (c.device == "cpu") f << isa << '/' << model << '/' << c.Name() << ' ' << Format(got[c.Name()]) << '\n';
    }
    GTEST_SKIP() << "recorded the cpu device's lines for " << isa << "/" << model << t << " in " << GoldenPath();
  }
  const auto golden = ReadGolden();
  int compared = 0;
  for (const Case& c : cases) {
    const std::string key = absl::StrCat(isa, "/", model, "/", c.Name());
    const auto it = golden.find(key);
    if (it == golden.end()) continue;
    ++compared;
    EXPECT_EQ(it->second, Format(got[c.Label()])) << key << " on " << c.device << ": logits differ from the "
                                                  << "recorded ones (per step, first differing word = first "
                                                  << "differing step)";
  }
  if (compared == 0) {
    GTEST_SKIP() << "no hashes recorded for kernel path " << isa << t << " in " << GoldenPath()
                 << " (the checks between modes ran); record them with DD_RECORD_LOGITS_HASHES=1";
  }
  EXPECT_EQ(compared, static_cast<int>(cases.size())) << "some cases of " << isa << "/" << model << t
                                                      << " are not recorded";
}

TYPED_TEST(LogitsHashTest, EveryModeReproducesTheRecordedHashes) {
  std::map<std::string, StepHashes> got;
  RunAndCompare(*this, ModelNames::GetName<TypeParam>(0), CasesOf(KvDtype::kF32, /*sim_dual_only=*/false), "", got);
}

// KV kept in f16 (docs/decisions/0049-kv-storage-type.md): the same exactness between modes and
// batches within the type, and hashes of its own, recorded like the f32 ones; and they are not
// f32's (the type is in effect).
TYPED_TEST(LogitsHashTest, F16KvKeepsTheModesExactAndReproducesItsHashes) {
  const Case f32{DecodeMode::kFull, 1, false};
  const StepHashes f32_full = this->Run(f32);
  std::map<std::string, StepHashes> got;
  RunAndCompare(*this, ModelNames::GetName<TypeParam>(0), CasesOf(KvDtype::kF16, /*sim_dual_only=*/true), "/f16", got);
  EXPECT_NE(f32_full, got["full/b1/f16"]) << "f16 KV gives f32's logits";
}

// On a GPU the bits differ from the cpu's (other reduction orders), so there the checks are
// the ones between modes and batches, and the greedy tokens of `full` against the cpu's.
TYPED_TEST(LogitsHashTest, OnTheCudaDeviceTheModesAgreeBitForBit) {
  if (!backend::CudaUsable()) GTEST_SKIP() << "no usable CUDA device: the engine's CUDA runs are not done here";
  std::map<std::string, StepHashes> got;
  for (DecodeMode m : {DecodeMode::kFull, DecodeMode::kSparse, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    for (int b : {1, 4}) {
      const Case c{m, b, false, "cuda"};
      got[c.Name()] = this->Run(c);
      ASSERT_EQ(got[c.Name()].size(), static_cast<size_t>(kSteps)) << c.Label();
    }
  }
  const Case slow{DecodeMode::kDualDecoder, 4, true, "cuda"};
  got[slow.Name()] = this->Run(slow);
  ExpectModesAgree(got, "cuda");
  // CUDA graphs launch the same kernels: the same bits, full and dual-token, slow link too.
  for (Case c : {Case{DecodeMode::kFull, 4, false, "cuda"}, slow}) {
    c.graphs = true;
    EXPECT_EQ(this->Run(c), got[c.Name()]) << c.Label() << " != without graphs";
  }
  const Case cpu_full{DecodeMode::kFull, 4, false, "cpu"};
  this->Run(cpu_full);
  const auto& gpu_tokens = this->greedy_["full/b4@cuda"];
  const auto& cpu_tokens = this->greedy_["full/b4"];
  for (int i = 0; i < kSteps; ++i) {
    ASSERT_EQ(gpu_tokens[i], cpu_tokens[i]) << "cuda full: greedy tokens leave the cpu's at step " << i;
  }
}

}  // namespace
}  // namespace dd::engine
