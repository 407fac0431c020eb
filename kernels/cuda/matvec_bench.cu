// dd-bench-matvec-cuda: the decode step's matrix-vector products on a real GPU, on synthetic
// Q4_K weights of the Llama-3.1-8B shape (generated on the device, not downloaded): 32 layers of
// q, k, v concatenated (4096 -> 6144, as engines fuse them at load), o (4096 -> 4096), gate and
// up concatenated (4096 -> 28672) and down (14336 -> 4096), each layer's inputs quantized to
// int8 as the forward does. Also each shape alone over its 32 layers' copies (cold in L2). Reports the time of one step's products
// at batch 1..8 against the HBM roofline (weight bytes / 4.8 TB/s) and against a plain read of
// the same bytes measured in the same run, launched one by one and replayed as a CUDA graph.
// The target (docs/decisions/0034-gpu-kernels-groundwork.md): full-mode decode at batch 1 on this
// shape >= 60% of the roofline (the LM head and attention are not here). Needs only the CUDA
// runtime.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/matvec_cuda.h"

namespace {

using dd::kernels::cuda::MatVecQ4K;
using dd::kernels::cuda::MatVecQ4KVariant;
using dd::kernels::cuda::QuantizeRowsInt8;

void Check(cudaError_t e, const char* what) { dd::kernels::cuda::CheckOrExit(e, "dd-bench-matvec-cuda", what); }

// Random bytes with each super-block's f16 scales set to small finite values.
__global__ void FillQ4K(uint8_t* w, int64_t blocks, uint64_t seed) {
  for (int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; b < blocks; b += int64_t{gridDim.x} * blockDim.x) {
    uint64_t h = seed ^ (static_cast<uint64_t>(b) * 0x9E3779B97F4A7C15ull);
    uint32_t* p = reinterpret_cast<uint32_t*>(w + b * 144);
    for (int i = 0; i < 36; ++i) {
      h ^= h >> 31; h *= 0xBF58476D1CE4E5B9ull; h ^= h >> 29;
      p[i] = static_cast<uint32_t>(h);
    }
    p[0] = 0x10062011u;  // d = f16 0x2011 (~0.0082), dmin = f16 0x1006 (~0.00049)
  }
}

__global__ void FillX(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    x[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  }
}

__global__ void ReadAll(const uint4* __restrict__ p, int64_t n, unsigned* __restrict__ out) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = p[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads; practically never stores
}

float HostF16(const uint8_t* p) {
  __half_raw r;
  r.x = static_cast<unsigned short>(p[0] | (p[1] << 8));
  return __half2float(__half(r));
}

// Host Q4_K dequantization of one row (GGUF's layout), for the self-check. Not the CPU backend's
// DequantizeRow: this benchmark builds with nvcc and the CUDA runtime alone (scripts/gpu-check on
// a machine without the project's dependencies), and an independent reference checks more.
void DequantQ4KRow(const uint8_t* row, int64_t k, std::vector<double>* out) {
  out->resize(k);
  for (int64_t b = 0; b < k / 256; ++b) {
    const uint8_t* blk = row + b * 144;
    const double dw = HostF16(blk), dmin = HostF16(blk + 2);
    const uint8_t* sc = blk + 4;
    for (int j = 0; j < 8; ++j) {
      int s, m;
      if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
      } else {
        s = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
      }
      const uint8_t* nib = blk + 16 + (j / 2) * 32;
      for (int l = 0; l < 32; ++l) {
        const int v = (j & 1) ? nib[l] >> 4 : nib[l] & 15;
        (*out)[b * 256 + j * 32 + l] = dw * s * v - dmin * m;
      }
    }
  }
}

// One positive integer flag value (at most 2^20), else exit 2 naming the flag.
int64_t One(const char* flag, const std::string& v) {
  const std::vector<int64_t> x = dd::kernels::cuda::PositiveIntsOrExit("dd-bench-matvec-cuda", flag, v);
  if (x.size() != 1) {
    std::fprintf(stderr, "dd-bench-matvec-cuda: %s takes one value\n", flag);
    std::exit(2);
  }
  return x[0];
}

struct Mat {
  int64_t n, k;
  uint8_t* w;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json, md, sha = "unknown", command;
  int layers = 32, reps = 20;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--json=", 0) == 0) json = a.substr(7);
    else if (a.rfind("--md=", 0) == 0) md = a.substr(5);
    else if (a.rfind("--git_sha=", 0) == 0) sha = a.substr(10);
    else if (a.rfind("--layers=", 0) == 0) layers = static_cast<int>(One("--layers", a.substr(9)));
    else if (a.rfind("--reps=", 0) == 0) reps = static_cast<int>(One("--reps", a.substr(7)));
    else {
      std::fprintf(stderr, "dd-bench-matvec-cuda: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (layers < 1 || layers > 128 || reps < 1 || reps > 10000) {
    std::fprintf(stderr, "dd-bench-matvec-cuda: --layers must be 1..128 and --reps 1..10000\n");
    return 2;
  }
  for (char c : sha + command) {
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) {
      std::fprintf(stderr, "dd-bench-matvec-cuda: quotes, backslashes and control bytes are not accepted in arguments\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties (is there a GPU?)");
  const int64_t hidden = 4096, kv = 1024, ffn = 14336;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {hidden + 2 * kv, hidden}, {hidden, hidden}, {2 * ffn, hidden}, {hidden, ffn}};
  const char* shape_names[] = {"qkv", "o", "gate_up", "down"};
  int64_t total = 0;
  for (auto [n, k] : shapes) total += n * (k / 256) * 144;
  total *= layers;
  std::fprintf(stderr, "%s: %d layers of Q4_K weights, %.2f GB\n", prop.name, layers, total / 1e9);
  uint8_t* all = nullptr;
  Check(cudaMalloc(&all, total), "cudaMalloc weights");
  FillQ4K<<<4096, 256>>>(all, total / 144, 42);
  Check(cudaGetLastError(), "fill");
  std::vector<Mat> mats;
  int64_t off = 0;
  for (int l = 0; l < layers; ++l) {
    for (auto [n, k] : shapes) {
      mats.push_back({n, k, all + off});
      off += n * (k / 256) * 144;
    }
  }
  const int max_rows = 8;
  float *x = nullptr, *y = nullptr, *d = nullptr;
  int8_t* q = nullptr;
  int32_t* qs = nullptr;
  unsigned* sink = nullptr;
  Check(cudaMalloc(&x, max_rows * ffn * sizeof(float)), "cudaMalloc");
  int64_t max_n = 0;  // the widest product's outputs (gate_up), for y
  for (auto [n, k] : shapes) max_n = std::max(max_n, n);
  Check(cudaMalloc(&y, max_rows * max_n * sizeof(float)), "cudaMalloc");
  Check(cudaMalloc(&q, max_rows * ffn), "cudaMalloc");
  Check(cudaMalloc(&d, max_rows * ffn / 32 * sizeof(float)), "cudaMalloc");
  Check(cudaMalloc(&qs, max_rows * ffn / 32 * sizeof(int32_t)), "cudaMalloc");
  Check(cudaMalloc(&sink, sizeof(unsigned)), "cudaMalloc");
  FillX<<<256, 256>>>(x, max_rows * ffn);
  Check(cudaDeviceSynchronize(), "init");
  cudaStream_t s;
  Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  // One step's products: per layer, each of the four products quantizes its input first.
  // variant 0: MatVecQ4K's default; else that many outputs per warp.
  // quantize false: the products alone, on activations quantized earlier (what the step costs
  // when quantization is fused into the kernels that produce the inputs, RMSNorm and SiLU).
  auto step = [&](int rows, int variant = 0, bool quantize = true) {
    for (size_t m = 0; m < mats.size(); ++m) {
      if (quantize) Check(QuantizeRowsInt8(x, rows, mats[m].k, q, d, qs, s), "quantize");  // every product's input
      Check(variant == 0 ? MatVecQ4K(mats[m].w, mats[m].n, mats[m].k, q, d, qs, rows, y, s)
                         : MatVecQ4KVariant(variant, mats[m].w, mats[m].n, mats[m].k, q, d, qs, rows, y, s),
            "matvec");
    }
  };
  // Self-check before timing: the first matrix's first 64 outputs at batch 8 against a host
  // double-precision reference over the same quantized activations (bound: 1e-5 of the terms'
  // magnitudes), and batch 1 against the batch's first row bit for bit.
  {
    const Mat& m0 = mats[0];
    const int64_t nsub = m0.k / 32, check_n = 64, rb = m0.k / 256 * 144;
    Check(QuantizeRowsInt8(x, max_rows, m0.k, q, d, qs, s), "quantize");
    Check(MatVecQ4K(m0.w, m0.n, m0.k, q, d, qs, max_rows, y, s), "matvec");
    Check(cudaStreamSynchronize(s), "self-check");
    std::vector<float> y8(max_rows * m0.n), y1(m0.n), hd(max_rows * nsub);
    std::vector<int8_t> hq(max_rows * m0.k);
    std::vector<uint8_t> hw(check_n * rb);
    Check(cudaMemcpy(y8.data(), y, y8.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy");
    Check(cudaMemcpy(hq.data(), q, hq.size(), cudaMemcpyDeviceToHost), "copy");
    Check(cudaMemcpy(hd.data(), d, hd.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy");
    Check(cudaMemcpy(hw.data(), m0.w, hw.size(), cudaMemcpyDeviceToHost), "copy");
    Check(MatVecQ4K(m0.w, m0.n, m0.k, q, d, qs, 1, y, s), "matvec");
    Check(cudaStreamSynchronize(s), "self-check");
    Check(cudaMemcpy(y1.data(), y, y1.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy");
    std::vector<double> wrow;
    for (int64_t i = 0; i < check_n; ++i) {
      DequantQ4KRow(&hw[i * rb], m0.k, &wrow);
      for (int r = 0; r < max_rows; ++r) {
        double exact = 0, mag = 0;
        for (int64_t j = 0; j < m0.k; ++j) {
          const double t = static_cast<double>(hd[r * nsub + j / 32]) * hq[r * m0.k + j] * wrow[j];
          exact += t;
          mag += std::fabs(t);
        }
        if (std::fabs(y8[r * m0.n + i] - exact) > 1e-5 * mag + 1e-30) {
          std::fprintf(stderr, "dd-bench-matvec-cuda: self-check failed: output %lld row %d is %g, reference %g\n",
                       static_cast<long long>(i), r, y8[r * m0.n + i], exact);
          return 3;
        }
      }
    }
    if (std::memcmp(y1.data(), y8.data(), y1.size() * sizeof(float)) != 0) {
      std::fprintf(stderr, "dd-bench-matvec-cuda: self-check failed: batch 1 differs from the batch's first row\n");
      return 3;
    }
    std::fprintf(stderr, "self-check passed (64 outputs x 8 rows within 1e-5; batch 1 == row 0 of batch 8)\n");
  }
  cudaEvent_t a, b;
  Check(cudaEventCreate(&a), "event");
  Check(cudaEventCreate(&b), "event");
  auto median = [&](auto&& op) {
    op();
    Check(cudaStreamSynchronize(s), "warm-up");
    std::vector<float> ms;
    for (int r = 0; r < reps; ++r) {
      Check(cudaEventRecord(a, s), "record");
      op();
      Check(cudaEventRecord(b, s), "record");
      Check(cudaEventSynchronize(b), "sync");
      float t = 0;
      Check(cudaEventElapsedTime(&t, a, b), "elapsed");
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return static_cast<double>(ms[ms.size() / 2]);
  };
  const double read_ms = median([&] {
    ReadAll<<<prop.multiProcessorCount * 8, 512, 0, s>>>(reinterpret_cast<const uint4*>(all), total / 16, sink);
    Check(cudaGetLastError(), "read");
  });
  const double roofline_ms = total / 4.8e12 * 1e3;
  std::fprintf(stderr, "plain read of the weights: %.3f ms (%.0f GB/s); roofline at 4.8 TB/s: %.3f ms\n", read_ms,
               total / read_ms / 1e6, roofline_ms);
  struct Row { int rows; std::string launch; double ms; };
  std::vector<Row> out;
  for (int rows : {1, 2, 4, 8}) {
    out.push_back({rows, "stream", median([&] { step(rows); })});
    cudaGraph_t g;
    cudaGraphExec_t ge;
    Check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
    step(rows);
    Check(cudaStreamEndCapture(s, &g), "capture");
    Check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    out.push_back({rows, "graph", median([&] { Check(cudaGraphLaunch(ge, s), "graph launch"); })});
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    Check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
    step(rows, 0, /*quantize=*/false);
    Check(cudaStreamEndCapture(s, &g), "capture");
    Check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    out.push_back({rows, "graph, products only", median([&] { Check(cudaGraphLaunch(ge, s), "graph launch"); })});
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    for (size_t i = out.size() - 3; i < out.size(); ++i) {
      std::fprintf(stderr, "batch %d %-20s: %.3f ms per step's products, %.0f GB/s, %.0f%% of roofline, %.0f%% of plain read\n",
                   rows, out[i].launch.c_str(), out[i].ms, total / out[i].ms / 1e6, 100 * roofline_ms / out[i].ms,
                   100 * read_ms / out[i].ms);
    }
  }
  // The outputs-per-warp variants side by side, each step replayed as a graph.
  struct VariantRow { int variant, rows; double ms; };
  std::vector<VariantRow> variants;
  for (int variant : {1, 2, 4}) {
    for (int rows : {1, 2, 4, 8}) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      Check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
      step(rows, variant);
      Check(cudaStreamEndCapture(s, &g), "capture");
      Check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
      variants.push_back({variant, rows, median([&] { Check(cudaGraphLaunch(ge, s), "graph launch"); })});
      std::fprintf(stderr, "outputs per warp %d, batch %d: %.3f ms per step (%.0f%% of roofline)\n", variant, rows,
                   variants.back().ms, 100 * roofline_ms / variants.back().ms);
      cudaGraphExecDestroy(ge);
      cudaGraphDestroy(g);
    }
  }
  // Each shape alone: its 32 layers' matrices in turn at batch 1, replayed as a graph.
  struct ShapeRow { std::string name; double ms_per_matrix, gbps; };
  std::vector<ShapeRow> per_shape;
  for (size_t sh = 0; sh < shapes.size(); ++sh) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    Check(QuantizeRowsInt8(x, 1, shapes[sh].second, q, d, qs, s), "quantize");
    Check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
    for (size_t m = sh; m < mats.size(); m += shapes.size()) {
      Check(MatVecQ4K(mats[m].w, mats[m].n, mats[m].k, q, d, qs, 1, y, s), "matvec");
    }
    Check(cudaStreamEndCapture(s, &g), "capture");
    Check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
    const double ms = median([&] { Check(cudaGraphLaunch(ge, s), "graph launch"); }) / layers;
    const double bytes = static_cast<double>(shapes[sh].first) * (shapes[sh].second / 256) * 144;
    per_shape.push_back({shape_names[sh], ms, bytes / ms / 1e6});
    std::fprintf(stderr, "%-8s %6lld x %5lld: %.4f ms per matrix, %.0f GB/s\n", shape_names[sh],
                 static_cast<long long>(shapes[sh].first), static_cast<long long>(shapes[sh].second), ms,
                 bytes / ms / 1e6);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) { std::perror(json.c_str()); return 1; }
    std::fprintf(f, "{\n  \"benchmark\": \"gpu-matvec\",\n  \"command\": \"%s\",\n  \"preset\": \"gpu-check\",\n"
                 "  \"git_sha\": \"%s\",\n  \"date\": \"%s\",\n  \"device\": \"%s\",\n  \"shape\": \"Llama-3.1-8B, Q4_K, %d layers, qkv and gate_up concatenated, "
                 "no LM head\",\n  \"weight_bytes\": %lld,\n  \"roofline_ms\": %.4f,\n  \"plain_read_ms\": %.4f,\n  \"steps\": [\n",
                 command.c_str(), sha.c_str(), date, prop.name, layers, static_cast<long long>(total), roofline_ms, read_ms);
    for (size_t i = 0; i < out.size(); ++i) {
      std::fprintf(f, "    {\"batch\": %d, \"launch\": \"%s\", \"median_ms\": %.4f, \"of_roofline\": %.3f, \"of_plain_read\": %.3f}%s\n",
                   out[i].rows, out[i].launch.c_str(), out[i].ms, roofline_ms / out[i].ms, read_ms / out[i].ms,
                   i + 1 < out.size() ? "," : "");
    }
    std::fprintf(f, "  ],\n  \"variants_graph\": [\n");
    for (size_t i = 0; i < variants.size(); ++i) {
      std::fprintf(f, "    {\"outputs_per_warp\": %d, \"batch\": %d, \"median_ms\": %.4f, \"of_roofline\": %.3f}%s\n",
                   variants[i].variant, variants[i].rows, variants[i].ms, roofline_ms / variants[i].ms,
                   i + 1 < variants.size() ? "," : "");
    }
    std::fprintf(f, "  ],\n  \"per_shape_batch1\": [\n");
    for (size_t i = 0; i < per_shape.size(); ++i) {
      std::fprintf(f, "    {\"shape\": \"%s\", \"ms_per_matrix\": %.5f, \"gbps\": %.1f}%s\n", per_shape[i].name.c_str(),
                   per_shape[i].ms_per_matrix, per_shape[i].gbps, i + 1 < per_shape.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  if (!md.empty()) {
    FILE* f = std::fopen(md.c_str(), "w");
    if (f == nullptr) { std::perror(md.c_str()); return 1; }
    std::fprintf(f, "# Decode-step matrix-vector products on %s\n\n`%s` at %s, %s. Synthetic Q4_K weights of the "
                 "Llama-3.1-8B shape, %d layers (%.2f GB; no LM head, no attention), q/k/v and gate/up concatenated; "
                 "each product's input quantized to int8 first by its own kernel (\"products only\": without those "
                 "launches, on inputs quantized earlier, as when the quantization is fused into the kernels that make "
                 "the inputs). Median of %d steps. Roofline: weight bytes / 4.8 TB/s = %.3f ms; a plain read of the same "
                 "bytes in this run: %.3f ms (%.0f GB/s).\n\n| batch | launch | ms per step | GB/s of weights | of roofline | of plain read |\n"
                 "|---|---|---|---|---|---|\n",
                 prop.name, command.c_str(), sha.c_str(), date, layers, total / 1e9, reps, roofline_ms, read_ms,
                 total / read_ms / 1e6);
    for (const Row& r : out) {
      std::fprintf(f, "| %d | %s | %.3f | %.0f | %.0f%% | %.0f%% |\n", r.rows, r.launch.c_str(), r.ms, total / r.ms / 1e6,
                   100 * roofline_ms / r.ms, 100 * read_ms / r.ms);
    }
    std::fprintf(f, "\nOutputs (weight rows) per warp, each step as a graph (the default takes 2 below batch 4, 4 from "
                 "there; every variant gives the same bits):\n\n| outputs per warp | batch 1 | batch 2 | batch 4 | batch 8 |\n"
                 "|---|---|---|---|---|\n");
    for (size_t i = 0; i + 3 < variants.size(); i += 4) {
      std::fprintf(f, "| %d | %.3f ms (%.0f%%) | %.3f ms (%.0f%%) | %.3f ms (%.0f%%) | %.3f ms (%.0f%%) |\n", variants[i].variant,
                   variants[i].ms, 100 * roofline_ms / variants[i].ms, variants[i + 1].ms, 100 * roofline_ms / variants[i + 1].ms,
                   variants[i + 2].ms, 100 * roofline_ms / variants[i + 2].ms, variants[i + 3].ms,
                   100 * roofline_ms / variants[i + 3].ms);
    }
    std::fprintf(f, "\nEach shape alone at batch 1 (its 32 layers' matrices in turn, one graph):\n\n"
                 "| product | ms per matrix | GB/s |\n|---|---|---|\n");
    for (const ShapeRow& r : per_shape) std::fprintf(f, "| %s | %.4f | %.0f |\n", r.name.c_str(), r.ms_per_matrix, r.gbps);
    std::fclose(f);
  }
  return 0;
}
