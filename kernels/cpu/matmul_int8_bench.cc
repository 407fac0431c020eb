// MatMul (f32 dequantize path) vs MatMulInt8 on Gemma-3-270M's shapes.
//
//   matmul_int8_bench [--quick] [--decode] [--type=Q5_0] [--m=16,32] [--checksum]
//
// For each weight type × m × thread count, runs both kernels alternately and prints the median
// GFLOP/s (2·m·n·k / time). "m=1 cold" cycles through enough weight copies (> 2× L3) that every
// call streams its weights from DRAM, as decode does with a whole model. Then prints the int8
// path's error against MatMul on the same data. --checksum prints only an FNV-1a hash of the
// MatMulInt8 outputs per type, to compare builds (AVX-512 vs portable fallback). --m=LIST times
// only those activation row counts (weights cache-resident), e.g. around a kernel's row threshold.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dd/kernels/cpu_ops.h"

namespace dd::kernels {
namespace {

struct Shape {
  DType type;
  int64_t n, k;
  const char* what;
};

void PutF16(uint8_t* p, float f) {
  const uint16_t h = F32ToF16(f);
  std::memcpy(p, &h, 2);
}

std::vector<uint8_t> RandomWeights(DType t, int64_t rows, int64_t cols, uint32_t seed) {
  const int64_t row_bytes = *RowBytes(t, cols);
  const int64_t block_bytes = GetDTypeInfo(static_cast<uint32_t>(t))->block_bytes;
  std::vector<uint8_t> data(rows * row_bytes);
  std::mt19937 rng(seed);
  for (size_t i = 0; i + 4 <= data.size(); i += 4) {
    const uint32_t v = rng();
    std::memcpy(&data[i], &v, 4);
  }
  std::uniform_real_distribution<float> mag(0.001f, 0.02f);
  for (int64_t off = 0; off < static_cast<int64_t>(data.size()); off += block_bytes) {
    uint8_t* blk = &data[off];
    switch (t) {
      case DType::kQ8_0:
      case DType::kQ4_0:
      case DType::kQ5_0: PutF16(blk, mag(rng)); break;
      case DType::kQ4_1:
      case DType::kQ5_1:
        PutF16(blk, mag(rng));
        PutF16(blk + 2, -mag(rng) * 8.0f);
        break;
      case DType::kQ4_K:
      case DType::kQ5_K:
        PutF16(blk, mag(rng));
        PutF16(blk + 2, mag(rng) * 0.5f);
        break;
      case DType::kQ6_K: PutF16(blk + 208, mag(rng) * 0.05f); break;
      default: break;
    }
  }
  return data;
}

std::vector<float> RandomActivations(int64_t m, int64_t k, uint32_t seed) {
  std::vector<float> x(m * k);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  return x;
}

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string Name(DType t) {
  const auto n = DTypeName(t);
  return std::string(n.data(), n.size());
}

void Bench(const Shape& s, bool quick, bool decode_only, const std::vector<int64_t>& only_m) {
  const int64_t row_bytes = *RowBytes(s.type, s.k);
  const int64_t bytes = s.n * row_bytes;
  // Enough copies that cycling through them defeats the 32 MiB L3.
  const int copies = static_cast<int>(std::max<int64_t>(1, (80ll << 20) / bytes + 1));
  std::vector<std::vector<uint8_t>> weights;
  for (int c = 0; c < copies; ++c) weights.push_back(RandomWeights(s.type, s.n, s.k, 100 + c));
  struct Case {
    int64_t m;
    bool cold;
  };
  // m = 2, 4, 8 cold: a dual step at batch 1, a sparse and a dual step at batch 4.
  std::vector<Case> cases = {{1, false}, {1, true}, {2, false}, {2, true}, {4, true}, {8, true}};
  if (!decode_only) cases.push_back({8, false});
  if (!decode_only && (!quick || s.n * s.k <= (4 << 20))) cases.push_back({512, false});
  if (!only_m.empty()) {
    cases.clear();
    for (const int64_t m : only_m) cases.push_back({m, false});
  }
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (const Case& c : cases) {
      const auto x = RandomActivations(c.m, s.k, 7);
      std::vector<float> y(c.m * s.n);
      const double flops = 2.0 * c.m * s.n * s.k;
      std::vector<double> t_f32, t_int8;
      const auto start = Clock::now();
      int rep = 0;
      // At least 5 reps each; more while under ~1.5 s (and at most 200).
      for (; rep < 200; ++rep) {
        if (rep >= 5 && std::chrono::duration<double>(Clock::now() - start).count() > (quick ? 0.5 : 1.5)) break;
        const WeightView w{s.type, weights[c.cold ? rep % copies : 0].data(), s.n, s.k, row_bytes};
        auto t0 = Clock::now();
        MatMul(w, x.data(), c.m, s.k, nullptr, y.data(), s.n, pool);
        auto t1 = Clock::now();
        const WeightView w2{s.type, weights[c.cold ? (rep + copies / 2) % copies : 0].data(), s.n, s.k, row_bytes};
        MatMulInt8(w2, x.data(), c.m, s.k, nullptr, y.data(), s.n, pool);
        auto t2 = Clock::now();
        t_f32.push_back(std::chrono::duration<double>(t1 - t0).count());
        t_int8.push_back(std::chrono::duration<double>(t2 - t1).count());
      }
      const double f32 = flops / Median(t_f32) * 1e-9, i8 = flops / Median(t_int8) * 1e-9;
      std::printf("%-5s %7lldx%-5lld m=%-3lld%-5s thr=%d  MatMul %7.1f GFLOP/s  MatMulInt8 %7.1f GFLOP/s  x%5.2f"
                  "  (int8 %.3f ms, %.1f GB/s of weights; %d reps)\n",
                  Name(s.type).c_str(), static_cast<long long>(s.n), static_cast<long long>(s.k),
                  static_cast<long long>(c.m), c.cold ? " cold" : "", threads, f32, i8, i8 / f32,
                  Median(t_int8) * 1e3, bytes / Median(t_int8) * 1e-9, rep);
      std::fflush(stdout);
    }
  }
}

// Error of the int8 path relative to the f32 path on the same data (random codes, N(0,1)
// activations): max |Δ| / max |y| and ||Δ|| / ||y|| over an m=8 batch.
void Accuracy(const Shape& s) {
  const int64_t m = 8, n = std::min<int64_t>(s.n, 4096);
  const auto wdata = RandomWeights(s.type, n, s.k, 1);
  const WeightView w{s.type, wdata.data(), n, s.k, *RowBytes(s.type, s.k)};
  const auto x = RandomActivations(m, s.k, 2);
  std::vector<float> a(m * n), b(m * n);
  ThreadPool pool(2);
  MatMul(w, x.data(), m, s.k, nullptr, a.data(), n, pool);
  MatMulInt8(w, x.data(), m, s.k, nullptr, b.data(), n, pool);
  double max_d = 0, max_y = 0, sd = 0, sy = 0;
  for (int64_t i = 0; i < m * n; ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - b[i]);
    max_d = std::max(max_d, d);
    max_y = std::max(max_y, std::abs(static_cast<double>(a[i])));
    sd += d * d;
    sy += static_cast<double>(a[i]) * a[i];
  }
  std::printf("%-5s %5lldx%-5lld  max|int8-f32|/max|f32| = %.2e   ||int8-f32||/||f32|| = %.2e\n",
              Name(s.type).c_str(), static_cast<long long>(n), static_cast<long long>(s.k), max_d / max_y,
              std::sqrt(sd / sy));
}

// A hash of the outputs' bits at 1, 3, 8, 14 and 19 activation rows (each CPU path's decode and
// prefill kernels), 77 weight rows (not a multiple of any kernel's row block).
void Checksum(const Shape& s) {
  const int64_t n = 77;
  const auto wdata = RandomWeights(s.type, n, s.k, 3);
  const WeightView w{s.type, wdata.data(), n, s.k, *RowBytes(s.type, s.k)};
  ThreadPool pool(2);
  uint64_t h = 1469598103934665603ull;
  for (const int64_t m : {1, 3, 8, 14, 19}) {
    const auto x = RandomActivations(m, s.k, 4);
    std::vector<float> y(m * n);
    MatMulInt8(w, x.data(), m, s.k, nullptr, y.data(), n, pool);
    for (float v : y) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      for (int i = 0; i < 4; ++i) h = (h ^ ((bits >> (8 * i)) & 0xff)) * 1099511628211ull;
    }
  }
  std::printf("%-5s k=%lld checksum %016llx\n", Name(s.type).c_str(), static_cast<long long>(s.k),
              static_cast<unsigned long long>(h));
}

}  // namespace
}  // namespace dd::kernels

int main(int argc, char** argv) {
  using namespace dd::kernels;
  bool quick = false, checksum = false, decode_only = false;
  const char* only = nullptr;
  std::vector<int64_t> only_m;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--checksum") == 0) checksum = true;
    if (std::strcmp(argv[i], "--decode") == 0) decode_only = true;
    if (std::strncmp(argv[i], "--type=", 7) == 0) only = argv[i] + 7;
    if (std::strncmp(argv[i], "--m=", 4) == 0) {
      for (const char* p = argv[i] + 4; *p != '\0';) {
        char* end = nullptr;
        const long long m = std::strtoll(p, &end, 10);
        if (end == p || m < 1 || m > 4096 || (*end != ',' && *end != '\0')) {
          std::fprintf(stderr, "--m: expected a comma-separated list of row counts in [1, 4096], got '%s'\n",
                       argv[i] + 4);
          return 2;
        }
        only_m.push_back(m);
        p = *end == ',' ? end + 1 : end;
      }
    }
  }
  const Shape shapes[] = {
      {DType::kQ5_0, 2048, 640, "ffn_gate/up"},  {DType::kQ6_K, 640, 2048, "ffn_down"},
      {DType::kQ4_K, 640, 1024, "attn_output"},  {DType::kQ5_K, 640, 2048, "(not in the model)"},
      {DType::kQ8_0, 262144, 640, "output"},     {DType::kQ8_0, 2048, 640, "(cache-resident Q8_0)"},
      // SmolLM2-135M: Q4_1 layers, tied Q8_0 output.
      {DType::kQ4_1, 1536, 576, "smollm2 ffn_gate/up"}, {DType::kQ4_1, 576, 1536, "smollm2 ffn_down"},
      {DType::kQ8_0, 49152, 576, "smollm2 output"},      {DType::kQ4_0, 1536, 576, "(Q4_0, not in a model)"},
      {DType::kQ5_1, 1536, 576, "(Q5_1, not in a model)"},
  };
  if (checksum) {
    for (const Shape& s : shapes) Checksum(s);
    return 0;
  }
  for (const Shape& s : shapes) {
    if (only == nullptr || Name(s.type) == only) Bench(s, quick, decode_only, only_m);
  }
  if (decode_only) return 0;
  std::printf("\naccuracy vs MatMul (f32 path), m=8:\n");
  for (const Shape& s : shapes) Accuracy(s);
  return 0;
}
