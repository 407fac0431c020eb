// dd-bench-gather-cuda: host -> device chunk gathers on a real GPU (the target: 4 KiB
// chunks at >= 80% of a PCIe 5.0 x16 link's ~55 GB/s; results in
// docs/decisions/0034-gpu-kernels-groundwork.md). Side by side, in one run:
//   - contiguous cudaMemcpyAsync host -> device and back (the link's ceiling on this machine);
//   - per-chunk cudaMemcpyAsync (what not to do), one cudaMemcpyBatchAsync (copy engines), and
//     the device-side gather kernel at several grid sizes, for several chunk and gather sizes;
//   - overlap: an HBM-bound kernel standing in for a decode step runs on a high-priority stream
//     while each gather path runs on a low-priority one; reports how much each slows the other.
// Every gather's bytes are checked against the host copy once. Writes JSON (--json) and a
// markdown summary (--md). Needs only the CUDA runtime, so it builds with nvcc alone.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/gather_cuda.h"

namespace {

using dd::kernels::cuda::CopyBatchScratch;
using dd::kernels::cuda::GatherChunksCopyEngine;
using dd::kernels::cuda::GatherChunksOnDevice;

void Check(cudaError_t e, const char* what) { dd::kernels::cuda::CheckOrExit(e, "dd-bench-gather-cuda", what); }

std::vector<int64_t> ParseList(const char* flag, const std::string& v) {
  return dd::kernels::cuda::PositiveIntsOrExit("dd-bench-gather-cuda", flag, v);
}

// The command line as a JSON string's body: quotes, backslashes and control bytes escaped.
std::string JsonEscape(const std::string& in) {
  std::string out;
  for (const char c : in) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

struct Options {
  int64_t pool_mib = 4096;
  std::vector<int64_t> chunk_kib = {2, 4, 16};
  std::vector<int64_t> gather_mib = {8, 64};
  int64_t reps = 20;
  int64_t overlap_gib = 4;  // the compute stand-in's buffer; 0 skips the overlap measurement
  std::string json, md, git_sha = "unknown", command;
};

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 0; i < argc; ++i) o.command += (i ? " " : "") + std::string(argv[i]);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (eq == std::string::npos) {
      std::fprintf(stderr, "dd-bench-gather-cuda: expected --flag=value, got '%s'\n", a.c_str());
      std::exit(2);
    }
    if (key == "--pool_mib") o.pool_mib = ParseList("--pool_mib", val).at(0);
    else if (key == "--chunk_kib") o.chunk_kib = ParseList("--chunk_kib", val);
    else if (key == "--gather_mib") o.gather_mib = ParseList("--gather_mib", val);
    else if (key == "--reps") o.reps = ParseList("--reps", val).at(0);
    else if (key == "--overlap_gib") o.overlap_gib = val == "0" ? 0 : ParseList("--overlap_gib", val).at(0);
    else if (key == "--json") o.json = val;
    else if (key == "--md") o.md = val;
    else if (key == "--git_sha") o.git_sha = val;
    else {
      std::fprintf(stderr, "dd-bench-gather-cuda: unknown flag %s\n", key.c_str());
      std::exit(2);
    }
  }
  for (int64_t g : o.gather_mib) {
    for (int64_t c : o.chunk_kib) {
      if ((g << 10) % c != 0) {
        std::fprintf(stderr, "dd-bench-gather-cuda: --chunk_kib %lld does not divide --gather_mib %lld\n",
                     static_cast<long long>(c), static_cast<long long>(g));
        std::exit(2);
      }
    }
    if (g * 2 > o.pool_mib) {
      std::fprintf(stderr, "dd-bench-gather-cuda: --gather_mib %lld needs --pool_mib >= %lld\n",
                   static_cast<long long>(g), static_cast<long long>(2 * g));
      std::exit(2);
    }
  }
  return o;
}

// Holds a stream for `ns` nanoseconds, so that work enqueued behind it starts together and
// the host's time to enqueue it is not counted as the device's.
__global__ void Gate(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

double NowUs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

// Median GPU time of `op` on stream s over `reps` repetitions (events around it, behind a
// gate that holds the stream longer than the host takes to enqueue `op`), and the median host
// time to enqueue it in *host_us.
bool g_gate_opened_early = false;  // some MedianMs gate opened before its work was enqueued

template <typename F>
double MedianMs(cudaStream_t s, int64_t reps, F&& op, double* host_us = nullptr) {
  cudaEvent_t a, b;
  Check(cudaEventCreate(&a), "event");
  Check(cudaEventCreate(&b), "event");
  const double w0 = NowUs();
  op();  // warm-up
  // The gate outlasts the host's enqueue time (at least 3 ms, twice the warm-up's).
  const auto gate_ns = static_cast<unsigned long long>(std::max(3e6, 2e3 * (NowUs() - w0)));
  Check(cudaStreamSynchronize(s), "warm-up");
  std::vector<double> ms, us;
  for (int64_t r = 0; r < reps; ++r) {
    Gate<<<1, 1, 0, s>>>(gate_ns);
    Check(cudaEventRecord(a, s), "record");
    const double t0 = NowUs();
    op();
    us.push_back(NowUs() - t0);
    if (cudaEventQuery(a) != cudaErrorNotReady) g_gate_opened_early = true;
    Check(cudaEventRecord(b, s), "record");
    Check(cudaEventSynchronize(b), "sync");
    float t = 0;
    Check(cudaEventElapsedTime(&t, a, b), "elapsed");
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  std::sort(us.begin(), us.end());
  if (host_us != nullptr) *host_us = us[us.size() / 2];
  return ms[ms.size() / 2];
}

// Reads `n4` float4 of device memory and writes one sum per thread: HBM-bound, all SMs.
__global__ void StreamRead(const float4* __restrict__ x, int64_t n4, float* __restrict__ out) {
  float acc = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n4;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 v = x[i];
    acc += v.x + v.y + v.z + v.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

struct Row {
  int64_t chunk_bytes, gather_bytes, copies;
  std::string path;
  int blocks;
  double ms, gbps;
  bool exact;
  double host_us;
};

struct OverlapRow {
  std::string path;
  int blocks;
  double compute_alone_ms, compute_overlap_ms, gather_alone_gbps, gather_overlap_gbps;
  bool gate_held;  // false: the host was still enqueueing when the streams started
};

}  // namespace

int main(int argc, char** argv) {
  const Options o = Parse(argc, argv);
  int device = 0, sms = 0, driver = 0, runtime = 0;
  Check(cudaSetDevice(device), "cudaSetDevice (is there a GPU?)");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, device), "properties");
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::fprintf(stderr, "device %s, %d SMs, driver %d, runtime %d\n", prop.name, sms, driver, runtime);

  const size_t pool_bytes = static_cast<size_t>(o.pool_mib) << 20;
  size_t max_gather = 0;
  for (int64_t g : o.gather_mib) max_gather = std::max(max_gather, static_cast<size_t>(g) << 20);
  std::fprintf(stderr, "pinning %lld MiB of host memory...\n", static_cast<long long>(o.pool_mib));
  char* pool = nullptr;
  Check(cudaHostAlloc(reinterpret_cast<void**>(&pool), pool_bytes, cudaHostAllocMapped), "cudaHostAlloc");
  {
    auto* w = reinterpret_cast<uint64_t*>(pool);
    for (size_t i = 0; i < pool_bytes / 8; ++i) w[i] = i * 0x9E3779B97F4A7C15ull;
  }
  void* pool_dev = nullptr;  // the same address under UVA; asked for all the same
  Check(cudaHostGetDevicePointer(&pool_dev, pool, 0), "cudaHostGetDevicePointer");
  char* dst = nullptr;
  int64_t* offsets_dev = nullptr;
  Check(cudaMalloc(&dst, max_gather), "cudaMalloc dst");
  // Room for the most chunks any gather lists: the smallest chunk size, or the overlap's 4 KiB.
  const int64_t min_chunk = std::min<int64_t>(4096, *std::min_element(o.chunk_kib.begin(), o.chunk_kib.end()) << 10);
  Check(cudaMalloc(&offsets_dev, (max_gather / min_chunk + 1) * sizeof(int64_t)), "cudaMalloc offsets");
  std::vector<char> expected(max_gather), got(max_gather);
  int least = 0, greatest = 0;
  Check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "priority range");
  cudaStream_t s, hi, lo;
  Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  Check(cudaStreamCreateWithPriority(&hi, cudaStreamNonBlocking, greatest), "stream");
  Check(cudaStreamCreateWithPriority(&lo, cudaStreamNonBlocking, least), "stream");

  // 1. The link: contiguous copies of the largest gather size.
  const double h2d_ms = MedianMs(s, o.reps, [&] {
    Check(cudaMemcpyAsync(dst, pool, max_gather, cudaMemcpyHostToDevice, s), "h2d");
  });
  const double d2h_ms = MedianMs(s, o.reps, [&] {
    Check(cudaMemcpyAsync(pool + pool_bytes - max_gather, dst, max_gather, cudaMemcpyDeviceToHost, s), "d2h");
  });
  // Restore the pattern the D2H copies overwrote.
  for (size_t i = (pool_bytes - max_gather) / 8; i < pool_bytes / 8; ++i) {
    reinterpret_cast<uint64_t*>(pool)[i] = i * 0x9E3779B97F4A7C15ull;
  }
  const double h2d_gbps = max_gather / h2d_ms / 1e6, d2h_gbps = max_gather / d2h_ms / 1e6;
  std::fprintf(stderr, "contiguous %zu MiB: h2d %.1f GB/s, d2h %.1f GB/s\n", max_gather >> 20,
               h2d_gbps, d2h_gbps);

  // 2. Gathers of random distinct chunks (ascending, as a selection's chunks are read).
  std::mt19937_64 rng(12);
  std::vector<Row> rows;
  CopyBatchScratch scratch;
  const std::vector<int> grids = {16, 32, sms, 4 * sms};
  std::vector<int64_t> offsets;
  auto make_offsets = [&](int64_t chunk, int64_t count) {
    const int64_t slots = static_cast<int64_t>(pool_bytes) / chunk;
    std::vector<int64_t> pick(count);
    std::uniform_int_distribution<int64_t> u(0, slots - 1);
    std::vector<char> used(slots, 0);
    for (auto& p : pick) {
      do p = u(rng); while (used[p]);
      used[p] = 1;
    }
    std::sort(pick.begin(), pick.end());
    offsets.resize(count);
    for (int64_t i = 0; i < count; ++i) offsets[i] = pick[i] * chunk;
    for (int64_t i = 0; i < count; ++i) std::memcpy(&expected[i * chunk], pool + offsets[i], chunk);
    Check(cudaMemcpy(offsets_dev, offsets.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice), "offsets");
    // The legacy stream's copy is not ordered with the non-blocking streams the gathers run on.
    Check(cudaDeviceSynchronize(), "offsets");
  };
  auto verify = [&](size_t bytes) {
    Check(cudaMemsetAsync(dst, 0xAB, max_gather, s), "memset");  // so a skipped chunk shows
    Check(cudaStreamSynchronize(s), "memset");
    return [&, bytes] {
      Check(cudaMemcpy(got.data(), dst, bytes, cudaMemcpyDeviceToHost), "readback");
      return std::memcmp(got.data(), expected.data(), bytes) == 0;
    };
  };
  bool all_exact = true;
  for (int64_t gm : o.gather_mib) {
    for (int64_t ck : o.chunk_kib) {
      const int64_t chunk = ck << 10, bytes = gm << 20, count = bytes / chunk;
      make_offsets(chunk, count);
      auto add = [&](const std::string& path, int blocks, int64_t copies, auto&& op) {
        auto check = verify(bytes);
        op();
        Check(cudaStreamSynchronize(s), path.c_str());
        const bool exact = check();
        all_exact = all_exact && exact;
        double host_us = 0;
        const double ms = MedianMs(s, o.reps, op, &host_us);
        rows.push_back({chunk, bytes, copies, path, blocks, ms, bytes / ms / 1e6, exact, host_us});
        std::fprintf(stderr, "chunk %5lld B gather %3lld MiB %-22s blocks %4d: %7.3f ms %6.1f GB/s, host %.0f us%s\n",
                     static_cast<long long>(chunk), static_cast<long long>(gm), path.c_str(), blocks,
                     ms, bytes / ms / 1e6, host_us, exact ? "" : "  WRONG BYTES");
      };
      add("memcpy_per_chunk", 0, count, [&] {
        for (int64_t i = 0; i < count; ++i) {
          Check(cudaMemcpyAsync(dst + i * chunk, pool + offsets[i], chunk, cudaMemcpyHostToDevice, s), "memcpy");
        }
      });
      int64_t copies = 0;
      add("copy_engine_batch", 0, count, [&] {
        Check(GatherChunksCopyEngine(pool, pool_bytes, offsets.data(), count, chunk, dst, false, &scratch, s, &copies),
              "cudaMemcpyBatchAsync");
      });
      rows.back().copies = copies;
      int last_runs = 0;
      for (int g : grids) {
        // What the launcher runs: no more blocks than the chunks have warps for.
        const int runs = static_cast<int>(std::min<int64_t>(g, (count + 7) / 8));
        if (runs == last_runs) continue;  // the same grid as the row before
        last_runs = runs;
        add("device_gather", runs, count, [&] {
          Check(GatherChunksOnDevice(pool_dev, offsets_dev, count, chunk, dst, g, s), "gather kernel");
        });
      }
    }
  }

  // 3. Overlap with an HBM-bound kernel, 4 KiB chunks, the largest gather.
  std::vector<OverlapRow> overlap;
  if (o.overlap_gib > 0) {
    const int64_t chunk = 4096, bytes = static_cast<int64_t>(max_gather), count = bytes / chunk;
    make_offsets(chunk, count);
    const size_t work_bytes = static_cast<size_t>(o.overlap_gib) << 30;
    float4* work = nullptr;
    float* sink = nullptr;
    Check(cudaMalloc(&work, work_bytes), "cudaMalloc work");
    Check(cudaMemset(work, 0, work_bytes), "memset work");
    const int grid = 4 * sms, block = 512;
    Check(cudaMalloc(&sink, sizeof(float) * grid * block), "cudaMalloc sink");
    auto compute = [&](cudaStream_t st) {
      StreamRead<<<grid, block, 0, st>>>(work, work_bytes / 16, sink);
      Check(cudaGetLastError(), "compute kernel");
    };
    const double compute_ms = MedianMs(hi, o.reps, [&] { compute(hi); });
    std::fprintf(stderr, "compute stand-in: %.3f ms per pass (%.0f GB/s of HBM reads)\n", compute_ms,
                 work_bytes / compute_ms / 1e6);
    struct Path { std::string name; int blocks; bool flag; };
    const std::vector<Path> paths = {{"copy_engine_batch", 0, false}, {"copy_engine_batch_overlap_hint", 0, true},
                                     {"device_gather", 8, false}, {"device_gather", 16, false},
                                     {"device_gather", 32, false}, {"device_gather", sms, false}};
    cudaEvent_t start, c_end, g_end;
    Check(cudaEventCreate(&start), "event");
    Check(cudaEventCreate(&c_end), "event");
    Check(cudaEventCreate(&g_end), "event");
    for (const Path& p : paths) {
      auto gather = [&](cudaStream_t st) {
        if (p.name == "device_gather") {
          Check(GatherChunksOnDevice(pool_dev, offsets_dev, count, chunk, dst, p.blocks, st), "gather kernel");
        } else {
          Check(GatherChunksCopyEngine(pool, pool_bytes, offsets.data(), count, chunk, dst, p.flag, &scratch, st), "batch");
        }
      };
      double gather_host_us = 0;
      const double gather_ms = MedianMs(lo, o.reps, [&] { gather(lo); }, &gather_host_us);
      // As many gathers as take about as long as the compute passes, both started together.
      const int passes = 20;
      const int gathers = std::max(1, static_cast<int>(passes * compute_ms / gather_ms));
      std::vector<double> c_ms, g_ms;
      // The gate holds both streams until all their work is enqueued (checked below).
      const auto gate_ns = static_cast<unsigned long long>(std::max(30e6, 2e3 * (gathers * gather_host_us + passes * 20.0)));
      bool gate_held = true;
      for (int round = 0; round < 3; ++round) {
        Check(cudaDeviceSynchronize(), "sync");
        Gate<<<1, 1, 0, s>>>(gate_ns);
        Check(cudaEventRecord(start, s), "record");
        Check(cudaStreamWaitEvent(hi, start, 0), "wait");
        Check(cudaStreamWaitEvent(lo, start, 0), "wait");
        // Each stream's end marker right behind its own work: a marker enqueued after the gate
        // opened and the work finished would time the host's enqueueing instead.
        for (int i = 0; i < passes; ++i) compute(hi);
        Check(cudaEventRecord(c_end, hi), "record");
        for (int i = 0; i < gathers; ++i) gather(lo);
        Check(cudaEventRecord(g_end, lo), "record");
        gate_held = gate_held && cudaEventQuery(start) == cudaErrorNotReady;
        Check(cudaDeviceSynchronize(), "overlap run");
        float tc = 0, tg = 0;
        Check(cudaEventElapsedTime(&tc, start, c_end), "elapsed");
        Check(cudaEventElapsedTime(&tg, start, g_end), "elapsed");
        c_ms.push_back(tc / passes);
        g_ms.push_back(tg / gathers);
      }
      std::sort(c_ms.begin(), c_ms.end());
      std::sort(g_ms.begin(), g_ms.end());
      if (!gate_held) std::fprintf(stderr, "overlap: the gate opened before all work was enqueued; row marked\n");
      overlap.push_back({p.name, p.blocks, compute_ms, c_ms[1], bytes / gather_ms / 1e6, bytes / g_ms[1] / 1e6,
                         gate_held});
      std::fprintf(stderr, "overlap %-31s blocks %4d: compute %.3f -> %.3f ms/pass, gather %.1f -> %.1f GB/s\n",
                   p.name.c_str(), p.blocks, compute_ms, c_ms[1], bytes / gather_ms / 1e6, bytes / g_ms[1] / 1e6);
    }
    cudaFree(work);
    cudaFree(sink);
  }

  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (f == nullptr) { std::perror(o.json.c_str()); return 1; }
    std::fprintf(f, "{\n  \"benchmark\": \"gpu-gather\",\n  \"command\": \"%s\",\n  \"preset\": \"gpu-check\",\n"
                 "  \"git_sha\": \"%s\",\n  \"date\": \"%s\",\n  \"device\": {\"name\": \"%s\", \"sms\": %d, "
                 "\"driver\": %d, \"runtime\": %d},\n  \"pool_mib\": %lld,\n  \"reps\": %lld,\n"
                 "  \"contiguous\": {\"bytes\": %zu, \"h2d_gbps\": %.2f, \"d2h_gbps\": %.2f},\n  \"gathers\": [\n",
                 JsonEscape(o.command).c_str(), JsonEscape(o.git_sha).c_str(), date, prop.name, sms, driver, runtime,
                 static_cast<long long>(o.pool_mib), static_cast<long long>(o.reps), max_gather, h2d_gbps, d2h_gbps);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f, "    {\"chunk_bytes\": %lld, \"gather_bytes\": %lld, \"path\": \"%s\", \"blocks\": %d, "
                   "\"copies\": %lld, \"median_ms\": %.4f, \"gbps\": %.2f, \"host_enqueue_us\": %.1f, \"exact\": %s}%s\n",
                   static_cast<long long>(r.chunk_bytes), static_cast<long long>(r.gather_bytes), r.path.c_str(),
                   r.blocks, static_cast<long long>(r.copies), r.ms, r.gbps, r.host_us, r.exact ? "true" : "false",
                   i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "  ],\n  \"overlap\": [\n");
    for (size_t i = 0; i < overlap.size(); ++i) {
      const OverlapRow& r = overlap[i];
      std::fprintf(f, "    {\"path\": \"%s\", \"blocks\": %d, \"compute_alone_ms\": %.4f, \"compute_overlap_ms\": %.4f, "
                   "\"gather_alone_gbps\": %.2f, \"gather_overlap_gbps\": %.2f, \"started_together\": %s}%s\n",
                   r.path.c_str(), r.blocks, r.compute_alone_ms, r.compute_overlap_ms, r.gather_alone_gbps,
                   r.gather_overlap_gbps, r.gate_held ? "true" : "false", i + 1 < overlap.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  if (!o.md.empty()) {
    FILE* f = std::fopen(o.md.c_str(), "w");
    if (f == nullptr) { std::perror(o.md.c_str()); return 1; }
    std::fprintf(f, "# Host -> device chunk gathers on %s\n\n`%s` at %s, %s. Pinned host pool of %lld MiB; "
                 "random distinct chunks in ascending order; median GPU time of %lld repetitions, each "
                 "enqueued behind a gate kernel that holds the stream longer than the host takes to enqueue "
                 "it, so the host's time (its own column) is not counted; every gather's bytes checked "
                 "once (%s).\n\n",
                 prop.name, o.command.c_str(), o.git_sha.c_str(), date, static_cast<long long>(o.pool_mib),
                 static_cast<long long>(o.reps), all_exact ? "all exact" : "SOME WRONG");
    std::fprintf(f, "Contiguous %zu MiB: host -> device %.1f GB/s, device -> host %.1f GB/s.%s\n\n",
                 max_gather >> 20, h2d_gbps, d2h_gbps,
                 g_gate_opened_early ? " WARNING: a gate opened before its work was enqueued; some GPU timings "
                                       "include host time." : "");
    std::fprintf(f, "| chunk | gather | path | blocks | copies | GB/s | of 55 GB/s | of contiguous | host enqueue us |\n"
                 "|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      std::fprintf(f, "| %lld KiB | %lld MiB | %s | %s | %lld | %.1f | %.0f%% | %.0f%% | %.0f |\n",
                   static_cast<long long>(r.chunk_bytes >> 10), static_cast<long long>(r.gather_bytes >> 20),
                   r.path.c_str(), r.blocks ? std::to_string(r.blocks).c_str() : "-",
                   static_cast<long long>(r.copies), r.gbps, 100 * r.gbps / 55, 100 * r.gbps / h2d_gbps, r.host_us);
    }
    if (!overlap.empty()) std::fprintf(f, "\nOverlap (4 KiB chunks, %zu MiB gathers on a low-priority stream; an HBM-bound read of "
                 "%lld GiB on a high-priority stream, filling every SM, stands in for a decode step; 20 passes and as "
                 "many gathers as take as long, started together, median of 3). The compute's blocks fill every SM "
                 "and have the higher priority, so a device-side gather's blocks get SM slots only as the "
                 "compute's free up: the rows show what each path costs the compute and what it moves meanwhile.\n\n"
                 "| gather path | blocks | compute ms/pass alone | with gathers | gather GB/s alone | with compute | started together |\n"
                 "|---|---|---|---|---|---|---|\n", max_gather >> 20, static_cast<long long>(o.overlap_gib));
    for (const OverlapRow& r : overlap) {
      std::fprintf(f, "| %s | %s | %.3f | %.3f (%.2fx) | %.1f | %.1f | %s |\n", r.path.c_str(),
                   r.blocks ? std::to_string(r.blocks).c_str() : "-", r.compute_alone_ms, r.compute_overlap_ms,
                   r.compute_overlap_ms / r.compute_alone_ms, r.gather_alone_gbps, r.gather_overlap_gbps,
                   r.gate_held ? "yes" : "no (host too slow)");
    }
    std::fclose(f);
  }
  return all_exact ? 0 : 3;
}
