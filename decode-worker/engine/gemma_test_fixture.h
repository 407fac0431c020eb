// Test fixtures that load a real fetched model once per suite (scripts/fetch-model): GemmaTest
// (Gemma 3 270M, 3 of 18 layers global) and SmolLM2Test (SmolLM2-135M-Instruct, all 30 layers
// global). Tests skip when the model is absent unless DD_REQUIRE_MODEL=1 (as in CI): then they
// fail.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "decode-worker/model/model_paths.h"
#include "decode-worker/model/weights.h"
#include "gtest/gtest.h"

namespace dd::engine::testing_util {

inline std::string RealModelPath(const char* name) { return *model::KnownModelPath(name); }

// Long natural English every Debian machine has (package base-files): the GPL-3 text.
inline std::string LicenseText() {
  std::ifstream f("/usr/share/common-licenses/GPL-3");
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_GT(ss.str().size(), 30000u) << "/usr/share/common-licenses/GPL-3 is missing or short";
  return ss.str();
}
inline std::string GemmaPath() { return RealModelPath("gemma"); }

template <const char* kName>
class RealModelTest : public ::testing::Test {
 protected:
  static std::string Path() { return RealModelPath(kName); }
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(Path())) return;
    auto m = model::LoadModel(Path());
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  void SetUp() override {
    if (model_ == nullptr) {
      const char* req = std::getenv("DD_REQUIRE_MODEL");
      if (req && std::string(req) == "1") FAIL() << "model missing at " << Path() << "; run scripts/fetch-model";
      GTEST_SKIP() << "model not fetched: " << Path();
    }
  }
  // The prompt as ddctl encodes it: the file's own add_bos, special tokens parsed.
  std::vector<int32_t> Encode(const std::string& s) {
    return model_->tokenizer->Encode(s, model_->tokenizer->add_bos(), true);
  }
  static inline model::LoadedModel* model_ = nullptr;
};

inline constexpr char kGemmaName[] = "gemma";
inline constexpr char kSmolLM2Name[] = "smollm2";
using GemmaTest = RealModelTest<kGemmaName>;
using SmolLM2Test = RealModelTest<kSmolLM2Name>;

// Typed tests over both models, named Gemma and SmolLM2.
using RealModels = ::testing::Types<GemmaTest, SmolLM2Test>;
class RealModelNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return std::is_same_v<T, GemmaTest> ? "Gemma" : "SmolLM2";
  }
};

}  // namespace dd::engine::testing_util
