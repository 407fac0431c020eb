// The start-up device check on the real Gemma 3 270M: the sim device (the cpu's kernels behind
// a simulated queue) passes with no difference at all; the same device with a deliberately
// wrong decode-attention op fails, naming the first wrong row.
#include "decode-worker/engine/device_check.h"

#include <cstdlib>

#include "dd/backend/registry.h"
#include "decode-worker/engine/gemma_test_fixture.h"
#include "gtest/gtest.h"

namespace dd::engine {
namespace {

using testing_util::GemmaTest;

EngineOptions On(const std::string& device, DecodeMode mode) {
  EngineOptions o;
  o.device = device;
  o.mode = mode;
  o.threads = 2;
  return o;
}

// Sets $DD_SIM_FAULT for one scope.
class SimFault {
 public:
  explicit SimFault(const char* name) { setenv("DD_SIM_FAULT", name, 1); }
  ~SimFault() { unsetenv("DD_SIM_FAULT"); }
};

TEST_F(GemmaTest, TheSimDevicePassesWithTheCpusBitsInEveryMode) {
  for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparseCached, DecodeMode::kDualDecoder}) {
    auto r = CheckDevice(*model_, On("sim", mode));
    ASSERT_TRUE(r.ok()) << r.status();
    SCOPED_TRACE(r->Table());
    EXPECT_TRUE(r->passed) << r->reason;
    EXPECT_EQ(r->rows.size(), 2u * 17u);
    EXPECT_EQ(r->worst_relative_diff, 0.0);  // the same kernels: the same bits
    EXPECT_EQ(r->token_mismatches, 0);
    EXPECT_EQ(r->prompt_tokens, (std::vector<int64_t>{192, 160}));
    EXPECT_GT(r->cpu_seconds, 0);
    EXPECT_GT(r->device_seconds, 0);
    EXPECT_NE(r->Summary().find("device check passed: sim against cpu"), std::string::npos) << r->Summary();
  }
}

TEST_F(GemmaTest, AWrongDecodeAttentionOpFailsTheCheckAtTheFirstDecodeStep) {
  SimFault fault("decode_attention_off_by_one");
  for (DecodeMode mode : {DecodeMode::kFull, DecodeMode::kSparse, DecodeMode::kDualDecoder}) {
    auto r = CheckDevice(*model_, On("sim", mode));
    ASSERT_TRUE(r.ok()) << r.status();
    SCOPED_TRACE(r->Table());
    EXPECT_FALSE(r->passed);
    // Prefill is untouched by the fault: the prompts' rows agree; the first decode step does not.
    for (const DeviceCheckRow& row : r->rows) {
      if (row.step == 0) {
        EXPECT_TRUE(row.ok) << "seq " << row.seq;
      }
    }
    EXPECT_NE(r->reason.find("sequence 0, decode step 1: logits differ"), std::string::npos) << r->reason;
    EXPECT_GT(r->worst_relative_diff, 0.5);  // an order of magnitude past the tolerance
    EXPECT_NE(r->Summary().find("device check FAILED"), std::string::npos);
  }
}

TEST_F(GemmaTest, AnUnknownFaultOrABadToleranceIsAnErrorNotAVerdict) {
  {
    SimFault fault("everything_wrong");
    auto r = CheckDevice(*model_, On("sim", DecodeMode::kFull));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("unknown sim fault 'everything_wrong'"), std::string::npos) << r.status();
  }
  auto r = CheckDevice(*model_, On("sim", DecodeMode::kFull), {.tolerance = 0});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GemmaTest, ADeviceThatCannotRunReturnsItsOwnError) {
  if (backend::CudaUsable()) GTEST_SKIP() << "a CUDA device is usable here";
  auto r = CheckDevice(*model_, On("cuda", DecodeMode::kFull));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("--device cuda: "), std::string::npos) << r.status();
}

}  // namespace
}  // namespace dd::engine
