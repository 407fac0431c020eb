// GPU kernels against the CPU reference. Skips when no CUDA device is usable (ctest label gpu).
#include <cstring>
#include <random>
#include <vector>

#include "dd/kernels/backend.h"
#include "dd/kernels/cpu_ops.h"
#include "gtest/gtest.h"

namespace dd::kernels {
namespace {

TEST(GpuKernelsTest, BackendListAlwaysHasCpu) {
  auto backends = ListBackends();
  ASSERT_GE(backends.size(), 2u);
  EXPECT_EQ(backends[0].name, "cpu");
  EXPECT_TRUE(backends[0].usable);
}

class GpuDequantTest : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(GpuDequantTest, MatchesCpuExactly) {
  if (!CudaUsable()) GTEST_SKIP() << "no CUDA device";
  const auto [type, rows] = GetParam();
  const int64_t cols = 1024;
  const int64_t row_bytes = *RowBytes(type, cols);
  std::vector<uint8_t> data(rows * row_bytes);
  std::mt19937 rng(3);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  // Keep the f16 scale fields finite: rewrite them with small values.
  const auto info = *GetDTypeInfo(static_cast<uint32_t>(type));
  for (int64_t off = 0; off < static_cast<int64_t>(data.size()); off += info.block_bytes) {
    const uint16_t h = F32ToF16(0.01f), hm = F32ToF16(0.002f);
    std::memcpy(&data[off], &h, 2);
    if (type == DType::kQ4_K) std::memcpy(&data[off + 2], &hm, 2);
  }
  std::vector<float> gpu(rows * cols), cpu(rows * cols);
  ASSERT_TRUE(CudaDequantizeRows(type, data.data(), rows, cols, gpu.data()).ok());
  for (int64_t r = 0; r < rows; ++r) DequantizeRow(type, &data[r * row_bytes], &cpu[r * cols], cols);
  // Same formulas as the CPU code; only an FMA contraction of d*q - m may differ, by about
  // one rounding of the result, hence a relative bound of 1e-6.
  for (int64_t i = 0; i < rows * cols; ++i) {
    ASSERT_NEAR(gpu[i], cpu[i], 1e-6f * (1 + std::abs(cpu[i]))) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Types, GpuDequantTest,
                         ::testing::Combine(::testing::Values(DType::kQ8_0, DType::kQ4_K),
                                            ::testing::Values(1, 33)));

}  // namespace
}  // namespace dd::kernels
