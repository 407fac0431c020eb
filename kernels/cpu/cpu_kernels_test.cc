#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "dd/kernels/cpu_ops.h"
#include "gtest/gtest.h"

namespace dd::kernels {
namespace {

void PutF16(uint8_t* p, float f) {
  const uint16_t h = F32ToF16(f);
  std::memcpy(p, &h, 2);
}

TEST(DTypeTest, F16RoundTripAndSpecials) {
  for (float f : {0.0f, 1.0f, -2.5f, 0.000061035156f, 65504.0f, 0.33325195f}) {
    EXPECT_EQ(F16ToF32(F32ToF16(f)), f) << f;
  }
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_TRUE(std::isinf(F16ToF32(0x7c00)));
  EXPECT_EQ(BF16ToF32(0x3f80), 1.0f);
}

// The portable conversion (builds without F16C) gives F16C's bits, subnormal halves and ties
// included: a synthetic model's tiny block scales must not flush to zero on some builds only.
TEST(DTypeTest, PortableF16ConversionIsF16CsBitForBit) {
  std::mt19937 rng(7);
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 65504.0f, 65520.0f, 1e30f, -1e-30f, 6.08e-5f, 1.14e-5f,
                               std::ldexp(1.0f, -24), std::ldexp(1.0f, -25), std::ldexp(3.0f, -26),
                               std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26), std::nanf(""), INFINITY};
  for (int i = 0; i < 200000; ++i) {
    const float mag = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng),
                                 std::uniform_int_distribution<int>(-30, 17)(rng));
    values.push_back(i % 2 ? -mag : mag);
  }
  for (uint32_t h = 0; h < 0x7c00u; h += 1) {  // every finite half, and the midpoints above each
    const float f = F16ToF32(static_cast<uint16_t>(h)), next = F16ToF32(static_cast<uint16_t>(h + 1));
    values.push_back(f);
    values.push_back((f + next) / 2);
  }
  int checked = 0;
  for (float f : values) {
#ifdef __F16C__
    ASSERT_EQ(F32ToF16Portable(f), F32ToF16(f)) << f;
    ++checked;
#else
    if (std::isfinite(f) && F16ToF32(F32ToF16Portable(f)) == f) ++checked;  // exact halves round-trip
#endif
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(F32ToF16Portable(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal, not zero
  EXPECT_EQ(F32ToF16Portable(6.08e-5f), 0x03fc);               // a subnormal scale
}

TEST(DTypeTest, RowBytesValidatesBlockMultiple) {
  EXPECT_EQ(*RowBytes(DType::kQ8_0, 64), 68);
  EXPECT_EQ(*RowBytes(DType::kQ4_K, 512), 288);
  EXPECT_EQ(*RowBytes(DType::kQ6_K, 256), 210);
  EXPECT_FALSE(RowBytes(DType::kQ4_K, 100).ok());
  EXPECT_FALSE(GetDTypeInfo(10).ok());  // Q2_K is not supported: error, not garbage
  EXPECT_FALSE(GetDTypeInfo(4).ok());   // a retired ggml id (Q4_2)
  EXPECT_EQ(*RowBytes(DType::kQ4_0, 64), 36);
  EXPECT_EQ(*RowBytes(DType::kQ4_1, 64), 40);
  EXPECT_EQ(*RowBytes(DType::kQ5_1, 64), 48);
}

TEST(DequantTest, Q8_0ByHand) {
  uint8_t blk[34];
  PutF16(blk, 0.5f);
  for (int i = 0; i < 32; ++i) blk[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(i - 16));
  float out[32];
  DequantizeRow(DType::kQ8_0, blk, out, 32);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], 0.5f * (i - 16));
}

TEST(DequantTest, Q5_0ByHand) {
  uint8_t blk[22] = {};
  PutF16(blk, 2.0f);
  const uint32_t qh = 0x00100002u;  // bit 1 -> element 1 high bit; bit 20 -> element 20 high bit
  std::memcpy(blk + 2, &qh, 4);
  blk[6 + 1] = 0x03;  // element 1 low nibble 3, element 17 low nibble 0
  blk[6 + 4] = 0x50;  // element 20 low nibble 5
  float out[32];
  DequantizeRow(DType::kQ5_0, blk, out, 32);
  EXPECT_EQ(out[0], 2.0f * (0 - 16));
  EXPECT_EQ(out[1], 2.0f * ((3 | 16) - 16));
  EXPECT_EQ(out[17], 2.0f * (0 - 16));
  EXPECT_EQ(out[20], 2.0f * ((5 | 16) - 16));
}

TEST(DequantTest, Q4_0ByHand) {
  uint8_t blk[18] = {};
  PutF16(blk, 0.5f);
  blk[2 + 0] = 0x0f;  // element 0 = 15, element 16 = 0
  blk[2 + 3] = 0x90;  // element 3 = 0, element 19 = 9
  float out[32];
  DequantizeRow(DType::kQ4_0, blk, out, 32);
  EXPECT_EQ(out[0], 0.5f * (15 - 8));
  EXPECT_EQ(out[16], 0.5f * (0 - 8));
  EXPECT_EQ(out[3], 0.5f * (0 - 8));
  EXPECT_EQ(out[19], 0.5f * (9 - 8));
}

TEST(DequantTest, Q4_1ByHand) {
  uint8_t blk[20] = {};
  PutF16(blk, 0.25f);
  PutF16(blk + 2, -1.5f);  // the min
  blk[4 + 2] = 0xa7;       // element 2 = 7, element 18 = 10
  float out[32];
  DequantizeRow(DType::kQ4_1, blk, out, 32);
  EXPECT_EQ(out[0], -1.5f);
  EXPECT_EQ(out[2], 0.25f * 7 - 1.5f);
  EXPECT_EQ(out[18], 0.25f * 10 - 1.5f);
}

TEST(DequantTest, Q5_1ByHand) {
  uint8_t blk[24] = {};
  PutF16(blk, 2.0f);
  PutF16(blk + 2, 0.5f);
  const uint32_t qh = 0x00100002u;  // bit 1 -> element 1 high bit; bit 20 -> element 20 high bit
  std::memcpy(blk + 4, &qh, 4);
  blk[8 + 1] = 0x03;  // element 1 low nibble 3, element 17 low nibble 0
  blk[8 + 4] = 0x50;  // element 20 low nibble 5
  float out[32];
  DequantizeRow(DType::kQ5_1, blk, out, 32);
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], 2.0f * (3 | 16) + 0.5f);
  EXPECT_EQ(out[17], 0.5f);
  EXPECT_EQ(out[20], 2.0f * (5 | 16) + 0.5f);
}

TEST(DequantTest, Q4_KByHand) {
  uint8_t blk[144] = {};
  PutF16(blk, 1.0f);       // d
  PutF16(blk + 2, 0.25f);  // dmin
  uint8_t* scales = blk + 4;
  scales[0] = 3;   // sub-block 0 scale
  scales[4] = 2;   // sub-block 0 min
  scales[1] = 5;   // sub-block 1 scale
  scales[5] = 4;   // sub-block 1 min
  // sub-block 4: scale = (scales[8] & 15) | (scales[0] >> 6) << 4 ; min = scales[8] >> 4 | ...
  scales[8] = 0x71;  // scale 1, min 7
  uint8_t* q = blk + 16;
  q[0] = 0x9a;  // element 0: 10 (low nibble), element 32: 9 (high nibble)
  q[64] = 0x0c;  // element 128 (sub-block 4): 12
  float out[256];
  DequantizeRow(DType::kQ4_K, blk, out, 256);
  EXPECT_EQ(out[0], 3.0f * 10 - 0.25f * 2);
  EXPECT_EQ(out[32], 5.0f * 9 - 0.25f * 4);
  EXPECT_EQ(out[1], 3.0f * 0 - 0.25f * 2);
  EXPECT_EQ(out[128], 1.0f * 12 - 0.25f * 7);
}

TEST(DequantTest, Q6_KByHand) {
  uint8_t blk[210] = {};
  uint8_t* ql = blk;
  uint8_t* qh = blk + 128;
  int8_t* sc = reinterpret_cast<int8_t*>(blk + 192);
  PutF16(blk + 208, 0.5f);
  sc[0] = 2;
  sc[2] = -3;
  ql[0] = 0x05;        // element 0 low 4 bits = 5; element 64 low = 0
  qh[0] = 0x01 | 0x08; // element 0 high bits 1 -> q = 5 | 16 = 21; element 32 high bits = 2
  ql[32] = 0x07;       // element 32 low 4 bits = 7 -> q = 7 | 32 = 39
  float out[256];
  DequantizeRow(DType::kQ6_K, blk, out, 256);
  EXPECT_EQ(out[0], 0.5f * 2 * (21 - 32));
  EXPECT_EQ(out[32], 0.5f * -3 * (39 - 32));
  EXPECT_EQ(out[64], 0.5f * sc[4] * (0 - 32));
}

TEST(DequantTest, Q5_KHighBits) {
  uint8_t blk[176] = {};
  PutF16(blk, 1.0f);
  PutF16(blk + 2, 0.0f);
  blk[4] = 1;   // sub-block 0 scale 1
  blk[5] = 1;   // sub-block 1 scale 1
  uint8_t* qh = blk + 16;
  uint8_t* ql = blk + 48;
  qh[0] = 0x01 | 0x02;  // element 0 and element 32 get +16
  ql[0] = 0x21;         // element 0 low 1, element 32 low 2
  float out[256];
  DequantizeRow(DType::kQ5_K, blk, out, 256);
  EXPECT_EQ(out[0], 17.0f);
  EXPECT_EQ(out[32], 18.0f);
}

std::vector<uint8_t> RandomQ8Rows(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::vector<uint8_t> data(rows * cols / 32 * 34);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  for (size_t b = 0; b < data.size(); b += 34) {
    PutF16(&data[b], scale(rng));
    for (int i = 0; i < 32; ++i) data[b + 2 + i] = static_cast<uint8_t>(byte(rng));
  }
  return data;
}

TEST(MatMulTest, MatchesDoubleReference) {
  std::mt19937 rng(7);
  const int64_t rows = 37, cols = 96, m = 9;
  auto w = RandomQ8Rows(rows, cols, rng);
  std::vector<float> x(m * cols), bias(rows);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  for (auto& v : bias) v = nd(rng);
  WeightView view{DType::kQ8_0, w.data(), rows, cols, *RowBytes(DType::kQ8_0, cols)};
  std::vector<float> y(m * rows);
  ThreadPool pool(2);
  MatMul(view, x.data(), m, cols, bias.data(), y.data(), rows, pool);
  std::vector<float> wr(cols);
  for (int64_t n = 0; n < rows; ++n) {
    DequantizeRow(DType::kQ8_0, w.data() + n * view.row_bytes, wr.data(), cols);
    for (int64_t i = 0; i < m; ++i) {
      double ref = bias[n];
      for (int64_t k = 0; k < cols; ++k) ref += static_cast<double>(wr[k]) * x[i * cols + k];
      EXPECT_NEAR(y[i * rows + n], ref, 1e-4 * (1 + std::abs(ref))) << n << "," << i;
    }
  }
}

// Batch invariance (docs/decisions/0001-batch-invariant-cpu-kernels.md): a row's result must not
// depend on batch size or thread count, bit for bit.
TEST(MatMulTest, BatchAndThreadInvariant) {
  std::mt19937 rng(11);
  const int64_t rows = 45, cols = 256 + 64;
  auto w = RandomQ8Rows(rows, cols, rng);
  WeightView view{DType::kQ8_0, w.data(), rows, cols, *RowBytes(DType::kQ8_0, cols)};
  const int64_t m = 11;
  std::vector<float> x(m * cols);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  ThreadPool pool1(1), pool3(3);
  std::vector<float> batched(m * rows);
  MatMul(view, x.data(), m, cols, nullptr, batched.data(), rows, pool3);
  for (int64_t i = 0; i < m; ++i) {
    std::vector<float> alone(rows);
    MatMul(view, x.data() + i * cols, 1, cols, nullptr, alone.data(), rows, pool1);
    ASSERT_EQ(0, std::memcmp(alone.data(), &batched[i * rows], rows * 4)) << "row " << i;
  }
}

TEST(MatMulTest, F32WeightsWithTail) {
  const int64_t rows = 3, cols = 21;  // not a multiple of the vector width
  std::vector<float> w(rows * cols), x(2 * cols);
  for (int64_t i = 0; i < rows * cols; ++i) w[i] = 0.01f * i;
  for (int64_t i = 0; i < 2 * cols; ++i) x[i] = 1.0f - 0.03f * i;
  WeightView view{DType::kF32, reinterpret_cast<const uint8_t*>(w.data()), rows, cols, cols * 4};
  std::vector<float> y(2 * rows);
  ThreadPool pool(2);
  MatMul(view, x.data(), 2, cols, nullptr, y.data(), rows, pool);
  for (int i = 0; i < 2; ++i)
    for (int n = 0; n < rows; ++n) {
      double ref = 0;
      for (int k = 0; k < cols; ++k) ref += double(w[n * cols + k]) * x[i * cols + k];
      EXPECT_NEAR(y[i * rows + n], ref, 1e-5);
    }
}

TEST(OpsTest, RmsNormAndRope) {
  const float x[4] = {1, 2, 3, 4};
  const float w[4] = {1, 1, 2, 2};
  float y[4];
  RmsNorm(x, w, 0.0f, 4, y);
  const float rms = std::sqrt((1 + 4 + 9 + 16) / 4.0f);
  EXPECT_NEAR(y[0], 1 / rms, 1e-6);
  EXPECT_NEAR(y[3], 8 / rms, 1e-6);
  // Rotating (1, 0) by pos*freq = pi/2 gives (0, 1) in both pairings.
  const float inv_freq[1] = {static_cast<float>(M_PI / 2)};
  float c[1], s[1];
  RopeAngles(inv_freq, 1, 1, c, s);
  float h1[2] = {1, 0};
  ApplyRope(h1, 1, c, s, /*neox=*/false);
  EXPECT_NEAR(h1[0], 0, 1e-6);
  EXPECT_NEAR(h1[1], 1, 1e-6);
  EXPECT_NEAR(GeluTanh(1.0f), 0.8411920f, 1e-6);
  EXPECT_NEAR(Silu(1.0f), 0.7310586f, 1e-6);
}

// The vectorized gated activations (polynomial exp) against the float64 formulas, across the
// range an MLP sees and beyond the exp clamp, with out aliasing gate as the transformer calls it.
TEST(OpsTest, GatedActivationsMatchDouble) {
  std::vector<float> x, up;
  for (int i = -4000; i <= 4000; ++i) {
    x.push_back(i * 0.01f);
    up.push_back(0.5f + (i % 7) * 0.25f);
  }
  x.push_back(-100.0f);
  up.push_back(1.0f);
  x.push_back(100.0f);
  up.push_back(1.0f);
  std::vector<float> gelu = x, silu = x;
  GeluTanhMul(gelu.data(), up.data(), gelu.data(), static_cast<int64_t>(x.size()));
  SiluMul(silu.data(), up.data(), silu.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i], u = up[i];
    const double g = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))) * u;
    const double s = v / (1 + std::exp(-v)) * u;
    EXPECT_NEAR(gelu[i], g, 1e-6 + 1e-6 * std::fabs(g)) << "gelu at " << v;
    EXPECT_NEAR(silu[i], s, 1e-6 + 1e-6 * std::fabs(s)) << "silu at " << v;
  }
}

#if defined(__FMA__)
// Dot's order, which the attention kernels and every caller's bits rely on: 16 lanes, each a
// chain of fused multiply-adds over its elements, then lane i += lane i + w for w = 8, 4, 2, 1
// (checked bit for bit on lengths without a scalar tail).
TEST(OpsTest, DotIsSixteenFmaLanesThenTheTree) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (const int n : {16, 64, 576, 640, 2048}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> a(n), b(n);
      for (int i = 0; i < n; ++i) {
        a[i] = nd(rng);
        b[i] = nd(rng);
      }
      float lane[16] = {};
      for (int i = 0; i < n; ++i) lane[i % 16] = std::fma(a[i], b[i], lane[i % 16]);
      for (int w = 8; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) lane[i] += lane[i + w];
      const float got = Dot(a.data(), b.data(), n);
      EXPECT_EQ(std::memcmp(&got, &lane[0], sizeof(float)), 0) << "n=" << n << " got " << got << " want " << lane[0];
    }
  }
}
#endif

// The transformer calls the gated activations on each thread's rows: an element's bits must
// not depend on where a call starts or ends (padded tail vs full vectors).
TEST(OpsTest, GatedActivationsIgnoreTheSplit) {
  std::vector<float> x(53), up(53);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = -6.0f + 0.23f * static_cast<float>(i);
    up[i] = 0.75f + 0.01f * static_cast<float>(i);
  }
  for (auto* f : {&GeluTanhMul, &SiluMul}) {
    std::vector<float> whole(x.size()), split(x.size());
    f(x.data(), up.data(), whole.data(), static_cast<int64_t>(x.size()));
    for (const int64_t cut : {1, 5, 16, 21, 37}) {
      f(x.data(), up.data(), split.data(), cut);
      f(x.data() + cut, up.data() + cut, split.data() + cut, static_cast<int64_t>(x.size()) - cut);
      for (size_t i = 0; i < x.size(); ++i) {
        EXPECT_EQ(std::memcmp(&whole[i], &split[i], sizeof(float)), 0) << "cut " << cut << " at " << i;
      }
    }
  }
}

TEST(OpsTest, ScaledSoftmaxMatchesDouble) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 30.0f);
  for (int64_t n : {1, 7, 16, 33, 1000}) {
    std::vector<float> x(n);
    for (auto& v : x) v = nd(rng);
    x[0] = -1e30f;  // a huge negative score must give exactly 0, not NaN
    std::vector<float> y = x;
    ScaledSoftmax(y.data(), n, 0.125f);
    double mx = -1e300, sum = 0;
    for (float v : x) mx = std::max(mx, 0.125 * v);
    for (float v : x) sum += std::exp(0.125 * v - mx);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = std::exp(0.125 * x[i] - mx) / sum;
      // Bound: the float argument scale*x - max (|.| < 2^7 here) is rounded to ~2^-17, so exp
      // carries up to ~8e-6 relative error before the polynomial's own 2e-8.
      ASSERT_NEAR(y[i], ref, 1e-5 * ref + 1e-30) << "n=" << n << " i=" << i;
    }
    if (n > 1) {
      EXPECT_EQ(y[0], 0.0f);
    }
  }
}

// The blocked attention kernels give the pair-at-a-time reference's bits (Dot; Axpy from
// zero in ascending key order), for head dims with and without a vector tail and query/key
// counts that leave partial blocks, key counts beyond one tile (128 keys at head dim 64). A
// wrong shuffle lane, order, tile seam or zero-skipping shows here.
TEST(AttentionKernelTest, BlockedScoresAndSumsEqualPairAtATime) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t hd : {64, 256, 16, 72, 5}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 37}, {2, 37}, {3, 37}, {4, 37}, {7, 300}, {8, 37}, {11, 130}, {12, 37}, {12, 301}}) {
      const int64_t ld = nk + 3;
      std::vector<float> q(nq * hd), kv(2 * nk * hd);
      for (auto& v : q) v = nd(rng);
      for (auto& v : kv) v = nd(rng);
      std::vector<const float*> keys(nk), values(nk);
      for (int64_t j = 0; j < nk; ++j) {
        keys[j] = &kv[j * hd];
        values[j] = &kv[(nk + j) * hd];
      }
      std::vector<float> s(nq * ld, -7.0f);
      AttentionScores(q.data(), nq, hd, keys.data(), nk, s.data(), ld);
      for (int64_t i = 0; i < nq; ++i) {
        for (int64_t j = 0; j < nk; ++j) {
          const float ref = Dot(keys[j], &q[i * hd], hd);
          ASSERT_EQ(0, std::memcmp(&ref, &s[i * ld + j], sizeof(float))) << hd << " " << nq << " " << i << "," << j;
        }
        EXPECT_EQ(s[i * ld + nk], -7.0f);  // nothing written past nk
        // Probabilities with zeros at both ends, as a causal block masks them.
        for (int64_t j = 0; j < nk; ++j) s[i * ld + j] = (j < i || j >= nk - i) ? 0.0f : std::fabs(s[i * ld + j]);
      }
      std::vector<float> out(nq * hd, 99.0f);
      std::vector<float*> outs(nq);
      for (int64_t i = 0; i < nq; ++i) outs[i] = &out[i * hd];
      // Two element ranges (as threads split them) must give what one call over [0, hd) gives.
      const int64_t mid = hd / 32 * 16;
      AttentionWeightedSum(s.data(), ld, nq, values.data(), nk, 0, mid, outs.data());
      AttentionWeightedSum(s.data(), ld, nq, values.data(), nk, mid, hd, outs.data());
      for (int64_t i = 0; i < nq; ++i) {
        std::vector<float> ref(hd, 0.0f);
        for (int64_t j = i; j < nk - i; ++j) Axpy(s[i * ld + j], values[j], ref.data(), hd);
        ASSERT_EQ(0, std::memcmp(ref.data(), outs[i], hd * sizeof(float))) << hd << " " << nq << " " << i;
      }
    }
  }
}

// KV kept in f16 (KvDtype::kF16): the kernels widen each element on load, so scores and sums
// over f16 rows are the f32 kernels' bits over the widened rows — every head size path (vector,
// scalar tail), query count and tile seam of the test above, values with large magnitudes.
TEST(AttentionKernelTest, F16RowsGiveTheBitsOfTheirWidenedF32Rows) {
  std::mt19937 rng(12);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int64_t hd : {64, 256, 16, 72, 5}) {
    for (auto [nq, nk] : {std::pair<int64_t, int64_t>{1, 37}, {3, 300}, {4, 130}, {7, 37}, {12, 301}}) {
      const int64_t ld = nk + 1;
      std::vector<float> q(nq * hd), kv(2 * nk * hd);
      for (auto& v : q) v = nd(rng);
      for (auto& v : kv) v = nd(rng) * (rng() % 8 == 0 ? 1000.0f : 1.0f);
      std::vector<uint16_t> half(kv.size());
      ASSERT_EQ(F32ToF16Saturating(kv.data(), static_cast<int64_t>(kv.size()), half.data()), 0);
      std::vector<float> wide(kv.size());
      for (size_t i = 0; i < kv.size(); ++i) wide[i] = F16ToF32(half[i]);
      std::vector<const float*> keys(nk), values(nk);
      std::vector<const void*> keys16(nk), values16(nk);
      for (int64_t j = 0; j < nk; ++j) {
        keys[j] = &wide[j * hd];
        values[j] = &wide[(nk + j) * hd];
        keys16[j] = &half[j * hd];
        values16[j] = &half[(nk + j) * hd];
      }
      std::vector<float> s32(nq * ld, -7.0f), s16(nq * ld, -7.0f);
      AttentionScores(q.data(), nq, hd, keys.data(), nk, s32.data(), ld);
      AttentionScores(q.data(), nq, hd, keys16.data(), KvDtype::kF16, nk, s16.data(), ld);
      ASSERT_EQ(0, std::memcmp(s32.data(), s16.data(), s32.size() * sizeof(float))) << hd << " " << nq;
      for (float& x : s32) x = std::fabs(x) * 1e-3f;
      std::vector<float> out32(nq * hd), out16(nq * hd);
      std::vector<float*> o32(nq), o16(nq);
      for (int64_t i = 0; i < nq; ++i) {
        o32[i] = &out32[i * hd];
        o16[i] = &out16[i * hd];
      }
      AttentionWeightedSum(s32.data(), ld, nq, values.data(), nk, 0, hd, o32.data());
      AttentionWeightedSum(s32.data(), ld, nq, values16.data(), KvDtype::kF16, nk, 0, hd, o16.data());
      ASSERT_EQ(0, std::memcmp(out32.data(), out16.data(), out32.size() * sizeof(float))) << hd << " " << nq;
      // The untyped f32 entry points are the typed ones.
      const std::vector<const void*> untyped(values.begin(), values.end());
      AttentionWeightedSum(s32.data(), ld, nq, untyped.data(), KvDtype::kF32, nk, 0, hd, o16.data());
      ASSERT_EQ(0, std::memcmp(out32.data(), out16.data(), out32.size() * sizeof(float))) << hd << " " << nq;
    }
  }
}

// How K and V enter an f16 cache: F32ToF16's bits, except that a finite value beyond ±65504
// saturates there (and is counted) instead of becoming ±inf; infinities and NaNs pass through.
// Lengths that leave a scalar tail after the 8-wide loop.
TEST(DTypeTest, SaturatingF16ConversionCountsWhatItClamps) {
  std::mt19937 rng(5);
  for (int64_t n : {1, 7, 8, 9, 64, 1001}) {
    std::vector<float> x(n);
    for (float& v : x) v = std::ldexp(std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng),
                                      std::uniform_int_distribution<int>(-26, 17)(rng));
    int64_t want = 0;
    const int64_t specials = std::min<int64_t>(n, 4);
    const float special[4] = {70000.0f, -1e30f, INFINITY, std::nanf("")};
    for (int64_t i = 0; i < specials; ++i) x[i * (n / specials)] = special[i];
    for (float v : x) want += std::isfinite(v) && std::fabs(v) > 65504.0f ? 1 : 0;
    std::vector<uint16_t> out(n);
    EXPECT_EQ(F32ToF16Saturating(x.data(), n, out.data()), want) << n;
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      if (std::isnan(v)) {
        EXPECT_TRUE(std::isnan(F16ToF32(out[i]))) << i;
      } else if (std::isfinite(v) && std::fabs(v) > 65504.0f) {
        EXPECT_EQ(F16ToF32(out[i]), v > 0 ? 65504.0f : -65504.0f) << v;
      } else {
        EXPECT_EQ(out[i], F32ToF16(v)) << v;
      }
    }
  }
}

// ArgmaxFirst's vector path against the plain scan it replaced: first index of the largest, NaN
// never wins, a NaN at index 0 gives 0; ties across lanes and in the tail.
TEST(ArgmaxTest, TheFirstLargestAsTheScan) {
  const auto scan = [](const std::vector<float>& x) {
    int32_t best = 0;
    for (size_t i = 1; i < x.size(); ++i) {
      if (x[i] > x[best]) best = static_cast<int32_t>(i);
    }
    return best;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(0, 3), pick(0, 9);
  for (const int n : {1, 2, 7, 8, 15, 16, 17, 23, 24, 31, 40, 100, 1000, 262144}) {
    for (int trial = 0; trial < (n > 1000 ? 3 : 200); ++trial) {
      std::vector<float> x(n);
      for (float& v : x) {  // few distinct values: many ties, some NaN, ±inf and ±0
        const int k = pick(rng);
        v = k == 0 ? nan : k == 1 ? -inf : k == 2 ? -0.0f : k == 3 ? inf * (trial % 7 == 0) : float(small(rng));
      }
      if (trial % 5 == 0) x[0] = nan;
      if (trial % 11 == 0) std::fill(x.begin(), x.end(), -inf);
      if (trial % 13 == 0) std::fill(x.begin(), x.end(), nan);
      EXPECT_EQ(ArgmaxFirst(x.data(), n), scan(x)) << "n=" << n << " trial=" << trial;
    }
  }
  const std::vector<float> last = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  EXPECT_EQ(ArgmaxFirst(last.data(), 19), 18);  // the largest in the scalar tail
}

}  // namespace
}  // namespace dd::kernels
