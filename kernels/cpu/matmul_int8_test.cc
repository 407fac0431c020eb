#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/test_weights.h"
#include "dd/kernels/cpu_ops.h"
#include "gtest/gtest.h"

namespace dd::kernels {
namespace {

// Activations whose magnitude varies from block to block (so the per-block scales differ), with
// one all-zero block in row 0 to cover the d = 0 case.
std::vector<float> RandomActivations(int64_t m, int64_t stride, int64_t k, std::mt19937& rng) {
  std::vector<float> x(m * stride, 0.0f);
  std::normal_distribution<float> nd;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / 32; ++b) {
      const float block_scale = std::exp(nd(rng));
      for (int i = 0; i < 32; ++i) x[r * stride + b * 32 + i] = nd(rng) * block_scale;
    }
  if (k >= 64) std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
  return x;
}

WeightView View(DType t, const std::vector<uint8_t>& data, int64_t rows, int64_t cols) {
  return WeightView{t, data.data(), rows, cols, *RowBytes(t, cols)};
}

TEST(QuantizeRowInt8BlocksTest, ByHand) {
  float x[96] = {};
  x[0] = 127.0f;
  x[1] = -63.5f;  // half to even: -64
  x[2] = 0.5f;    // 0
  x[3] = 1.5f;    // 2
  x[4] = -127.0f;
  // x[32..63] stay zero: d = 0, q = 0.
  for (int i = 64; i < 96; ++i) x[i] = 1e-38f;  // 127 / 1e-38 would overflow: flushed to zero
  int8_t q[96];
  float d[3];
  QuantizeRowInt8Blocks(x, 96, q, d);
  EXPECT_EQ(d[0], 1.0f);
  EXPECT_EQ(q[0], 127);
  EXPECT_EQ(q[1], -64);
  EXPECT_EQ(q[2], 0);
  EXPECT_EQ(q[3], 2);
  EXPECT_EQ(q[4], -127);
  EXPECT_EQ(q[5], 0);
  EXPECT_EQ(d[1], 0.0f);
  EXPECT_EQ(d[2], 0.0f);
  for (int i = 32; i < 96; ++i) EXPECT_EQ(q[i], 0) << i;
}

TEST(QuantizeRowInt8BlocksTest, ErrorWithinHalfStep) {
  std::mt19937 rng(3);
  const int64_t k = 2048;
  auto x = RandomActivations(1, k, k, rng);
  std::vector<int8_t> q(k);
  std::vector<float> d(k / 32);
  QuantizeRowInt8Blocks(x.data(), k, q.data(), d.data());
  for (int64_t b = 0; b < k / 32; ++b) {
    int qmax = 0;
    for (int i = 0; i < 32; ++i) {
      const int64_t e = b * 32 + i;
      qmax = std::max(qmax, std::abs(static_cast<int>(q[e])));
      EXPECT_LE(std::abs(x[e] - static_cast<double>(q[e]) * d[b]), d[b] * (0.5 + 1e-6) + 1e-6 * std::abs(x[e])) << e;
    }
    if (d[b] > 0) {
      EXPECT_EQ(qmax, 127) << b;
    }
  }
}

class MatMulInt8RefTest : public ::testing::TestWithParam<std::tuple<DType, int64_t, int64_t, int64_t>> {};

// Checks the integer path against a double reference on the same quantized activations
// (tight, 1e-5 of Σ|terms|, observed ≤ 1.3e-7: only the f32 rounding of the per-block scaling
// and accumulation remains), and against the unquantized activations within the activation
// quantization bound |Σ w (x − x̂)| ≤ Σ_b d_b/2 · Σ_{i∈b} |w_i| (plus f32 slack).
TEST_P(MatMulInt8RefTest, MatchesDoubleReference) {
  const auto [type, k, n, m] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(1000 * static_cast<int>(type) + 10 * k + n + m));
  const auto wdata = RandomWeights(type, n, k, rng);
  const WeightView w = View(type, wdata, n, k);
  const auto x = RandomActivations(m, k, k, rng);
  std::vector<float> y(m * n, NAN);
  ThreadPool pool(2);
  MatMulInt8(w, x.data(), m, k, nullptr, y.data(), n, pool);

  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * k / 32);
  for (int64_t r = 0; r < m; ++r) QuantizeRowInt8Blocks(&x[r * k], k, &q[r * k], &d[r * k / 32]);
  std::vector<float> wr(k);
  double worst_tight = 0;
  for (int64_t j = 0; j < n; ++j) {
    DequantizeRow(type, wdata.data() + j * w.row_bytes, wr.data(), k);
    for (int64_t r = 0; r < m; ++r) {
      double ref_q = 0, abs_q = 0, ref_x = 0, abs_x = 0, quant_bound = 0;
      for (int64_t b = 0; b < k / 32; ++b) {
        double wabs = 0;
        for (int i = 0; i < 32; ++i) {
          const int64_t e = b * 32 + i;
          const double xq = static_cast<double>(q[r * k + e]) * d[r * k / 32 + b];
          ref_q += wr[e] * xq;
          abs_q += std::abs(wr[e] * xq);
          ref_x += static_cast<double>(wr[e]) * x[r * k + e];
          abs_x += std::abs(static_cast<double>(wr[e]) * x[r * k + e]);
          wabs += std::abs(wr[e]);
        }
        quant_bound += 0.5 * d[r * k / 32 + b] * wabs;
      }
      const double got = y[r * n + j];
      ASSERT_LE(std::abs(got - ref_q), 1e-5 * abs_q) << "row " << r << " col " << j << " ref " << ref_q;
      if (abs_q > 0) worst_tight = std::max(worst_tight, std::abs(got - ref_q) / abs_q);
      ASSERT_LE(std::abs(got - ref_x), quant_bound * (1 + 1e-5) + 1e-4 * abs_x)
          << "row " << r << " col " << j << " ref " << ref_x;
    }
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", worst_tight);
  RecordProperty("worst_tight_error_over_sum_abs", buf);
}

INSTANTIATE_TEST_SUITE_P(
    TypesAndShapes, MatMulInt8RefTest,
    ::testing::Combine(::testing::ValuesIn(kTypes), ::testing::Values<int64_t>(256, 512, 2048),
                       ::testing::Values<int64_t>(1, 5, 64), ::testing::Values<int64_t>(1, 3, 17)),
    [](const auto& info) {
      return std::string(DTypeName(std::get<0>(info.param)).data(), DTypeName(std::get<0>(info.param)).size()) +
             "_k" + std::to_string(std::get<1>(info.param)) + "_n" + std::to_string(std::get<2>(info.param)) +
             "_m" + std::to_string(std::get<3>(info.param));
    });

class MatMulInt8TypeTest : public ::testing::TestWithParam<DType> {};

// Batch invariance (docs/decisions/0001-batch-invariant-cpu-kernels.md): a row's result must not
// depend on batch size or thread count, bit for bit. The shape is large enough that MatMulInt8 does
// use the 3-thread pool (small calls run on the caller); m = 140 crosses the kernel's 64-row
// accumulator chunk and quantizes in parallel; strides are wider than the data and n is not a
// multiple of the 16-row tile.
TEST_P(MatMulInt8TypeTest, BatchAndThreadInvariant) {
  const DType type = GetParam();
  std::mt19937 rng(17 + static_cast<int>(type));
  const int64_t k = 1024, n = 645, xs = k + 32, ys = n + 3;
  const auto wdata = RandomWeights(type, n, k, rng);
  const WeightView w = View(type, wdata, n, k);
  std::vector<float> bias(n);
  std::normal_distribution<float> nd;
  for (auto& v : bias) v = nd(rng);
  ThreadPool pool1(1), pool3(3);
  // 3, 8, 14: the AVX2 decode path in calls of 3, of 4 + 4 and of 4 + 4 + 4 + 2 activation rows.
  for (int64_t m : {3, 8, 14, 17, 140}) {
    const auto x = RandomActivations(m, xs, k, rng);
    std::vector<float> batched(m * ys, NAN);
    MatMulInt8(w, x.data(), m, xs, bias.data(), batched.data(), ys, pool3);
    for (int64_t r = 0; r < m; ++r) {
      std::vector<float> alone(n, NAN);
      MatMulInt8(w, x.data() + r * xs, 1, xs, bias.data(), alone.data(), n, pool1);
      ASSERT_EQ(0, std::memcmp(alone.data(), &batched[r * ys], n * 4)) << "m " << m << " row " << r;
    }
  }
}

// Bias is one f32 add after the reduction; columns past the last full tile are written and
// nothing beyond n is touched.
TEST_P(MatMulInt8TypeTest, BiasAndPartialTile) {
  const DType type = GetParam();
  std::mt19937 rng(29 + static_cast<int>(type));
  const int64_t k = 256, m = 3;
  for (int64_t n : {5, 37}) {
    const auto wdata = RandomWeights(type, n, k, rng);
    const WeightView w = View(type, wdata, n, k);
    const auto x = RandomActivations(m, k, k, rng);
    std::vector<float> bias(n);
    std::normal_distribution<float> nd;
    for (auto& v : bias) v = nd(rng);
    const int64_t ys = n + 4;
    std::vector<float> plain(m * ys, -7.0f), biased(m * ys, -7.0f);
    ThreadPool pool(2);
    MatMulInt8(w, x.data(), m, k, nullptr, plain.data(), ys, pool);
    MatMulInt8(w, x.data(), m, k, bias.data(), biased.data(), ys, pool);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < n; ++j) EXPECT_EQ(biased[r * ys + j], plain[r * ys + j] + bias[j]) << r << "," << j;
      for (int64_t j = n; j < ys; ++j) EXPECT_EQ(plain[r * ys + j], -7.0f) << "wrote past n at " << r << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatMulInt8TypeTest, ::testing::ValuesIn(kTypes),
                         [](const auto& info) { return std::string(DTypeName(info.param).data(), DTypeName(info.param).size()); });

TEST(MatMulInt8Test, UnsupportedTypesUseMatMul) {
  EXPECT_FALSE(MatMulInt8Supports(DType::kF32));
  EXPECT_FALSE(MatMulInt8Supports(DType::kF16));
  EXPECT_FALSE(MatMulInt8Supports(DType::kBF16));
  for (DType t : kTypes) EXPECT_TRUE(MatMulInt8Supports(t));
  const int64_t n = 3, k = 64, m = 2;
  std::vector<float> wf(n * k), x(m * k);
  for (int64_t i = 0; i < n * k; ++i) wf[i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
  for (int64_t i = 0; i < m * k; ++i) x[i] = 1.0f - 0.03f * static_cast<float>(i);
  const WeightView w{DType::kF32, reinterpret_cast<const uint8_t*>(wf.data()), n, k, k * 4};
  std::vector<float> a(m * n), b(m * n);
  ThreadPool pool(2);
  MatMul(w, x.data(), m, k, nullptr, a.data(), n, pool);
  MatMulInt8(w, x.data(), m, k, nullptr, b.data(), n, pool);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
}

}  // namespace
}  // namespace dd::kernels
