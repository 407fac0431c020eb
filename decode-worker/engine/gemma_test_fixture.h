// Test fixture that loads the real Gemma 3 270M once per suite (fetched by scripts/fetch-model).
// Tests skip when the model is absent unless DD_REQUIRE_MODEL=1 (as in CI): then they fail.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "decode-worker/model/weights.h"
#include "gtest/gtest.h"

namespace dd::engine::testing_util {

inline std::string GemmaPath() {
  if (const char* p = std::getenv("DD_MODEL"); p && *p) return p;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/dualdecoder/models/gemma-3-270m-q4_k_m.gguf";
}

class GemmaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(GemmaPath())) return;
    auto m = model::LoadModel(GemmaPath());
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
      if (req && std::string(req) == "1") FAIL() << "model missing at " << GemmaPath() << "; run scripts/fetch-model";
      GTEST_SKIP() << "model not fetched: " << GemmaPath();
    }
  }
  std::vector<int32_t> Encode(const std::string& s) { return model_->tokenizer->Encode(s, true, true); }
  static inline model::LoadedModel* model_ = nullptr;
};

}  // namespace dd::engine::testing_util
