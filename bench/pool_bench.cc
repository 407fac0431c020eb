// KV-pool gather benchmark (docs/benchmarks.md, "pool"): gather bandwidth and per-gather latency
// for blocks of the real model's size, versus blocks per gather and concurrent gatherers, per
// transport — in-process, shm://, ucx:// over tcp and over shared memory — next to a plain
// memcpy of the same random gather pattern in the same run (the machine's limit). ucx:// is
// measured on both data paths (ucx-tcp, ucx-sm: active messages; ...-rma: one-sided gets, from
// the same pool run with --ucx_rma), next to UCX's own figures measured in the same run:
// ucx_perftest's tagged bandwidth (a window of messages in flight) and ping-pong (one at a time,
// as one gatherer's gathers go) at each gather's size over the same UCX_TLS, and `cma`:
// the same gathers as one process_vm_readv each from another process (the kernel copy that
// UCX's shared-memory zero-copy uses, so the ceiling of any cma-based path). ucx-*-busy run
// against a second pool whose progress thread busy-polls. Each measurement records the CPU the
// pool process and this process (the gatherers) spent, in cores. With --rounds every row is
// measured that many times, the transports (and ucx_perftest) in turn, so each round's ratios
// compare figures taken seconds apart (this shared host's speed swings 2x between minutes).
// Starts its own dd-kv-pool.
// Writes one JSON object.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "bench/flag_ints.h"
#include "kv-pool/client/pool_kv_store.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/server/pool_process.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::vector<std::string>, blocks, std::vector<std::string>({"16", "64", "256"}), "Blocks per gather");
ABSL_FLAG(std::vector<std::string>, concurrency, std::vector<std::string>({"1", "2"}), "Concurrent gatherers");
ABSL_FLAG(int64_t, head_dim, 256, "Head dim (block = 2 × 8 tokens × head_dim f32; Gemma 3 270M: 256 → 16 KiB)");
ABSL_FLAG(int64_t, chunks, 2048, "Chunks stored per gatherer (random blocks are drawn from them)");
ABSL_FLAG(double, seconds, 0.5, "Time per measurement (at least 3 gathers)");
ABSL_FLAG(std::vector<std::string>, transports,
          std::vector<std::string>({"memcpy", "cma", "inproc", "shm", "ucx-tcp", "ucx-sm", "ucx-tcp-busy", "ucx-sm-busy",
                                    "ucx-tcp-rma", "ucx-sm-rma"}),
          "Transports to measure (ucx-*: active messages; -busy: against a busy-polling pool; -rma: one-sided gets)");
ABSL_FLAG(bool, pool_busy_poll, false, "Start the main pool with --ucx_busy_poll too (its progress thread spins)");
ABSL_FLAG(int64_t, pool_spin_us, -1, "The main pool's --ucx_spin_us (-1: the pool's default)");
ABSL_FLAG(bool, spin_yield, true,
          "Spinning UCX threads yield their core every 16 idle polls: the pools' --ucx_spin_yield and the "
          "gatherers' $DD_UCX_SPIN_YIELD (false: neither, for comparison)");
ABSL_FLAG(bool, perftest, true,
          "Measure ucx_perftest tag_bw (streaming) and tag_lat (ping-pong) over tcp and sm at each gather size");
ABSL_FLAG(int64_t, rounds, 1,
          "Measure every row this many times, transports in turn (reversed every other round): on a shared "
          "host the rows' ratios are taken within a round and summarized over rounds");
ABSL_FLAG(std::string, out, "", "Output JSON path");

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using dd::kvpool::ChunkRef;

struct Result {
  double gbps = 0, p50_ms = 0, p99_ms = 0;
  int64_t gathers = 0;
  bool failed = false;  // a gather returned an error
};

// CPU seconds (user + system) spent so far by process `pid`, or by this process when pid is 0.
double CpuSeconds(pid_t pid) {
  if (pid == 0) {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  }
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(f, line);
  const size_t close = line.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Runs `threads` gatherers; gather(thread, refs, dst) does one gather and returns false on error.
template <typename GatherFn>
Result Measure(int threads, int64_t blocks, int64_t block_bytes, int64_t chunks, GatherFn gather) {
  std::vector<std::vector<double>> lat(threads);
  std::vector<int64_t> bytes(threads, 0);
  std::vector<std::thread> ts;
  std::atomic<bool> failed{false};
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const auto t0 = Clock::now();
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937 g(t + 1);
      std::vector<ChunkRef> refs(blocks);
      std::vector<float> dst(blocks * block_bytes / sizeof(float));
      while (lat[t].size() < 3 || std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
        for (auto& r : refs) r = {0, 0, static_cast<int64_t>(g() % chunks)};
        const auto a = Clock::now();
        if (!gather(t, refs, dst.data())) {
          failed = true;
          return;
        }
        lat[t].push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
        bytes[t] += blocks * block_bytes;
      }
    });
  }
  for (auto& th : ts) th.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> all;
  int64_t total = 0;
  for (int t = 0; t < threads; ++t) {
    all.insert(all.end(), lat[t].begin(), lat[t].end());
    total += bytes[t];
  }
  std::sort(all.begin(), all.end());
  Result r;
  r.failed = failed.load();
  if (all.empty()) return r;
  r.gathers = static_cast<int64_t>(all.size());
  r.gbps = total / wall / 1e9;
  r.p50_ms = all[all.size() / 2];
  r.p99_ms = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  return r;
}

// A loopback port free right now (ucx_perftest needs one named; the race is harmless here).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

constexpr int kPerftestRuns = 3;

// ucx_perftest `test` (tag_bw: a window of sends in flight; tag_lat: ping-pong, one message at a
// time each way) at `bytes` per message over `tls`: GB/s (UCX reports MiB/s; for tag_lat the
// size over the one-way latency), or -1.
double PerftestGbps(const std::string& tls, int64_t bytes, const std::string& test) {
  const int port = FreePort();
  const std::string p = std::to_string(port), size = std::to_string(bytes);
  // The data path's segments (ucx_config.h: tcp's receive segments, else shared memory's) unless
  // the caller chose others.
  const bool tcp = tls == "tcp";
  const std::string seg_var = tcp ? "UCX_TCP_RX_SEG_SIZE" : "UCX_MM_SEG_SIZE";
  const std::string seg_value(tcp ? dd::kvpool::kUcxTcpSegSizeDefault : dd::kvpool::kUcxSegSizeDefault);
  const bool set = tcp ? dd::kvpool::UcxTcpSegmentSizeSet() : dd::kvpool::UcxSegmentSizeSet();
  const std::string seg = set ? "" : " " + seg_var + "=" + seg_value;
  // The server's environment and arguments are built before fork: the child of this threaded
  // process may only make async-signal-safe calls (no setenv, no malloc) before exec.
  std::vector<std::string> env_strings{"UCX_TLS=" + tls};
  if (!set) env_strings.push_back(seg_var + "=" + seg_value);
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string v(*e);
    if (v.rfind("UCX_TLS=", 0) != 0 && (set || v.rfind(seg_var + "=", 0) != 0)) env_strings.push_back(v);
  }
  std::vector<char*> envp;
  for (std::string& v : env_strings) envp.push_back(v.data());
  envp.push_back(nullptr);
  const char* argv[] = {"ucx_perftest", "-p", p.c_str(), nullptr};
  const int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
  const pid_t server = fork();
  if (server == 0) {
    if (devnull >= 0) dup2(devnull, STDOUT_FILENO);
    execvpe("ucx_perftest", const_cast<char* const*>(argv), envp.data());
    _exit(127);
  }
  if (devnull >= 0) close(devnull);
  double gbps = -1;
  const int64_t volume = test == "tag_bw" ? int64_t{2} << 30 : int64_t{1} << 30;  // ~2 GiB, 1 GiB each way
  const int64_t iters = std::clamp<int64_t>(volume / bytes, 200, 20000);
  const std::string cmd = "UCX_TLS=" + tls + seg + " ucx_perftest 127.0.0.1 -p " + p +
                          " -t " + test + " -s " + size + " -n " +
                          std::to_string(iters) + " -w 50 2>/dev/null";
  for (int attempt = 0; attempt < 50 && gbps < 0; ++attempt) {  // until the server listens (5 s)
    if (FILE* f = popen(cmd.c_str(), "r")) {
      char line[512];
      while (fgets(line, sizeof(line), f) != nullptr) {
        double it, p50, avg, overall, bw_avg, bw_overall;
        if (std::sscanf(line, "Final: %lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &overall, &bw_avg, &bw_overall) == 6) {
          gbps = bw_overall * 1048576.0 / 1e9;
        }
      }
      pclose(f);
    }
    if (gbps < 0) usleep(100000);
  }
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  return gbps;
}

// The transports --transports may name (Target::Create reads the name's parts).
bool KnownTransport(const std::string& t) {
  static const std::set<std::string> known = {"memcpy",      "cma",        "inproc",       "shm",        "ucx-tcp",
                                              "ucx-sm",      "ucx-tcp-busy", "ucx-sm-busy", "ucx-tcp-rma", "ucx-sm-rma"};
  return known.count(t) > 0;
}

// The benchmark's fixed setting, shared by every transport's turn.
struct Setting {
  dd::kvpool::KvLayout layout;
  int64_t block_bytes = 0, chunks = 0, quota_mib = 0;
  int max_threads = 0;
  const dd::kvpool::testing_util::PoolProcess* pool = nullptr;  // the main pool
  std::string yield_flag;                                       // its spin-yield flag
};

// What one transport's gathers read from, set up for its turn and torn down after it: plain
// memory (memcpy), another process's pages (cma), or a KV store (inproc, shm://, ucx://, against
// the main pool or a busy-polling one of its own).
class Target {
 public:
  static absl::StatusOr<std::unique_ptr<Target>> Create(const std::string& transport, const Setting& setting) {
    std::unique_ptr<Target> t(new Target(setting));
    if (transport == "memcpy" || transport == "cma") {
      t->plain_.assign(setting.max_threads, std::vector<float>(setting.chunks * setting.layout.block_bytes() / 4, 1.0f));
      if (transport == "cma" && !t->ForkHolder()) return absl::InternalError("pipe or fork failed");
      return t;
    }
    absl::StatusOr<std::unique_ptr<dd::kvpool::KvStore>> s;
    if (transport == "inproc") {
      s = dd::kvpool::NewInProcessKvStore();
    } else {
      const bool ucx = transport.rfind("ucx-", 0) == 0;
      const bool rma = absl::EndsWith(transport, "-rma");
      t->serving_ = setting.pool;
      if (absl::EndsWith(transport, "-busy")) {
        unsetenv("UCX_TLS");  // the pool offers every transport, as the main pool does
        t->busy_pool_ = std::make_unique<dd::kvpool::testing_util::PoolProcess>(
            30000, std::to_string(setting.quota_mib) + "MiB",
            std::vector<std::string>{"--ucx_busy_poll", "--ucx_tcp", setting.yield_flag});
        if (t->busy_pool_->address().empty()) return absl::UnavailableError("the busy-polling pool did not start");
        t->serving_ = t->busy_pool_.get();
      }
      if (ucx) setenv("UCX_TLS", transport.rfind("ucx-tcp", 0) == 0 ? "tcp" : "sm,self", 1);  // read at ucp_init
      s = dd::kvpool::ConnectPoolKvStore(
          {.address = t->serving_->address(), .token = dd::kvpool::testing_util::kAlice,
           .transport = ucx ? dd::kvpool::PoolTransport::kUcx : dd::kvpool::PoolTransport::kShm,
           .ucx_path = rma ? dd::kvpool::UcxPath::kRma : dd::kvpool::UcxPath::kActiveMessages});
    }
    if (!s.ok()) return s.status();
    t->store_ = std::move(*s);
    std::vector<float> block(setting.layout.block_bytes() / 4);
    for (int i = 0; i < setting.max_threads; ++i) {
      auto id = t->store_->Open(setting.layout);
      if (!id.ok()) return id.status();
      t->seqs_.push_back(*id);
      for (int64_t c = 0; c < setting.chunks; ++c) {
        std::fill(block.begin(), block.end(), static_cast<float>(c));
        if (auto st = t->store_->Write(*id, {0, 0, c}, block.data()); !st.ok()) return st;
      }
    }
    return t;
  }

  ~Target() {
    for (auto id : seqs_) (void)store_->Release(id);
    store_.reset();  // before its pool goes
    if (holder_ > 0) {
      close(holder_pipe_[1]);
      waitpid(holder_, nullptr, 0);
    }
  }

  // The pool whose CPU is counted, or null.
  const dd::kvpool::testing_util::PoolProcess* serving() const { return serving_; }

  // Gatherer t's gather of `refs` into `dst`; false on error.
  bool Gather(int t, const std::vector<ChunkRef>& refs, float* dst) {
    const int64_t floats = setting_.layout.block_bytes() / 4;
    const auto bytes = static_cast<size_t>(setting_.block_bytes);
    if (holder_ > 0) {  // one process_vm_readv per gather, an iov entry per block
      std::vector<iovec> local(refs.size()), remote(refs.size());
      for (size_t i = 0; i < refs.size(); ++i) {
        local[i] = {dst + i * floats, bytes};
        remote[i] = {&plain_[t][refs[i].chunk * floats], bytes};
      }
      return process_vm_readv(holder_, local.data(), local.size(), remote.data(), remote.size(), 0) ==
             static_cast<ssize_t>(refs.size() * bytes);
    }
    if (!store_) {
      for (size_t i = 0; i < refs.size(); ++i) std::memcpy(dst + i * floats, &plain_[t][refs[i].chunk * floats], bytes);
      return true;
    }
    auto id = store_->Gather(seqs_[t], refs, dst, dd::kvpool::Priority::kUrgent);
    return id.ok() && store_->Wait(*id).ok();
  }

 private:
  explicit Target(const Setting& setting) : setting_(setting) {}

  // cma: a child holding the same pages (copy-on-write, never written) until we close the pipe.
  bool ForkHolder() {
    if (pipe(holder_pipe_) != 0) return false;
    holder_ = fork();
    if (holder_ < 0) {
      close(holder_pipe_[0]);
      close(holder_pipe_[1]);
      return false;
    }
    if (holder_ == 0) {
      char c;
      close(holder_pipe_[1]);
      while (read(holder_pipe_[0], &c, 1) < 0 && errno == EINTR) {
      }
      _exit(0);
    }
    close(holder_pipe_[0]);
    return true;
  }

  const Setting& setting_;
  const dd::kvpool::testing_util::PoolProcess* serving_ = nullptr;
  std::unique_ptr<dd::kvpool::testing_util::PoolProcess> busy_pool_;  // only while its transport runs
  std::unique_ptr<dd::kvpool::KvStore> store_;
  std::vector<std::vector<float>> plain_;  // memcpy, cma: one buffer of `chunks` blocks per gatherer
  pid_t holder_ = -1;                      // cma: the process the gathers read from
  int holder_pipe_[2] = {-1, -1};
  std::vector<dd::kvpool::SequenceId> seqs_;
};

// One row: `conc` gatherers of `blocks` blocks against `target`, with the CPU this process and
// the serving pool spent; null (and a message) when a gather failed.
nlohmann::json MeasureRow(Target& target, const std::string& transport, int64_t round, int64_t conc, int64_t blocks,
                          const Setting& setting) {
  const auto* serving = target.serving();
  const double pool_cpu0 = serving != nullptr ? CpuSeconds(serving->pid()) : 0, self_cpu0 = CpuSeconds(0);
  const auto wall0 = Clock::now();
  Result r = Measure(static_cast<int>(conc), blocks, setting.block_bytes, setting.chunks,
                     [&](int t, const std::vector<ChunkRef>& refs, float* dst) { return target.Gather(t, refs, dst); });
  const double wall = std::chrono::duration<double>(Clock::now() - wall0).count();
  const double self_cores = (CpuSeconds(0) - self_cpu0) / wall;
  nlohmann::json pool_cores = nullptr;
  if (serving != nullptr) pool_cores = (CpuSeconds(serving->pid()) - pool_cpu0) / wall;
  if (r.failed || r.gathers == 0) {
    std::cerr << "pool_bench: " << transport << ": a gather failed\n";
    return nullptr;
  }
  std::fprintf(stderr, "%-12s blocks %4lld conc %lld: %7.2f GB/s  p50 %8.3f ms  p99 %8.3f ms  cpu %.2f+%.2f  (%lld gathers)\n",
               transport.c_str(), static_cast<long long>(blocks), static_cast<long long>(conc), r.gbps, r.p50_ms,
               r.p99_ms, self_cores, pool_cores.is_null() ? 0.0 : pool_cores.get<double>(),
               static_cast<long long>(r.gathers));
  return {{"transport", transport}, {"round", round}, {"blocks_per_gather", blocks}, {"concurrency", conc},
          {"block_bytes", setting.block_bytes}, {"gbps", r.gbps}, {"latency_ms_p50", r.p50_ms},
          {"latency_ms_p99", r.p99_ms}, {"gathers", r.gathers}, {"gatherer_cpu_cores", self_cores},
          {"pool_cpu_cores", pool_cores}};
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t hd = absl::GetFlag(FLAGS_head_dim), chunks = absl::GetFlag(FLAGS_chunks);
  const dd::kvpool::KvLayout layout{.n_layers = 1, .n_kv_heads = 1, .head_dim = hd, .chunk_tokens = 8};
  const int64_t block_bytes = layout.block_bytes();
  // Bounds: a gather request carries at most 4096 blocks; gatherers are threads.
  const auto blocks_list = dd::bench::Ints(absl::GetFlag(FLAGS_blocks), "--blocks", 1, 4096);
  const auto conc_list = dd::bench::Ints(absl::GetFlag(FLAGS_concurrency), "--concurrency", 1, 64);
  const int max_threads = static_cast<int>(*std::max_element(conc_list.begin(), conc_list.end()));
  for (const std::string& t : absl::GetFlag(FLAGS_transports)) {
    if (!KnownTransport(t)) {
      return std::cerr << "pool_bench: unknown transport '" << t << "' in --transports (see --helpfull)\n", 2;
    }
  }
  const int64_t rounds = absl::GetFlag(FLAGS_rounds);
  if (rounds < 1 || rounds > 100) return std::cerr << "pool_bench: --rounds must be 1..100, not " << rounds << "\n", 2;
  const int64_t quota_mib = max_threads * chunks * block_bytes * 2 / (1 << 20) + 16;
  // A loopback benchmark: the pool serves tcp too (--ucx_tcp; on a network only where every peer is trusted).
  std::vector<std::string> pool_flags{"--ucx_rma", "--ucx_rma_unconfined", "--ucx_tcp"};
  if (absl::GetFlag(FLAGS_pool_busy_poll)) pool_flags.push_back("--ucx_busy_poll");
  if (absl::GetFlag(FLAGS_pool_spin_us) >= 0) {
    pool_flags.push_back("--ucx_spin_us=" + std::to_string(absl::GetFlag(FLAGS_pool_spin_us)));
  }
  const std::string yield_flag = dd::kvpool::testing_util::SpinYieldEverywhere(absl::GetFlag(FLAGS_spin_yield));
  pool_flags.push_back(yield_flag);
  dd::kvpool::testing_util::PoolProcess pool(30000, std::to_string(quota_mib) + "MiB", pool_flags);
  if (pool.address().empty()) {
    std::cerr << "pool_bench: dd-kv-pool did not start (is it built next to this binary?)\n";
    return 1;
  }
  const Setting setting{.layout = layout, .block_bytes = block_bytes, .chunks = chunks, .quota_mib = quota_mib,
                        .max_threads = max_threads, .pool = &pool, .yield_flag = yield_flag};
  nlohmann::json runs = nlohmann::json::array();
  nlohmann::json ceilings = nlohmann::json::array();
  // UCX's own figures at each gather's size, measured within each round as one more turn (so a
  // row's ratio to them compares figures taken seconds apart): `runs` runs each, the median kept.
  auto yardsticks = [&](int64_t round, int runs_each) {
    for (const char* test : {"tag_bw", "tag_lat"}) {
      for (const char* tls : {"tcp", "sm,self"}) {
        for (int64_t blocks : blocks_list) {
          std::vector<double> all;
          for (int k = 0; k < runs_each; ++k) all.push_back(PerftestGbps(tls, blocks * block_bytes, test));
          std::vector<double> sorted = all;
          std::sort(sorted.begin(), sorted.end());
          const double gbps = sorted[sorted.size() / 2];
          ceilings.push_back({{"tool", std::string("ucx_perftest ") + test}, {"ucx_tls", tls},
                              {"message_bytes", blocks * block_bytes}, {"blocks_per_gather", blocks}, {"gbps", gbps},
                              {"gbps_runs", all}, {"round", round}});
          std::string each;
          for (double g : all) each += (each.empty() ? "" : ", ") + std::to_string(g).substr(0, 5);
          std::fprintf(stderr, "ucx_perftest %-7s %-7s %8lld bytes: %7.2f GB/s (runs: %s)\n", test, tls,
                       static_cast<long long>(blocks * block_bytes), gbps, each.c_str());
        }
      }
    }
  };
  for (int64_t round = 0; round < rounds; ++round) {
    std::vector<std::string> transports = absl::GetFlag(FLAGS_transports);
    if (absl::GetFlag(FLAGS_perftest)) transports.push_back("ucx_perftest");  // a turn of its own
    if (round % 2 == 1) std::reverse(transports.begin(), transports.end());  // neither order favoured
    if (rounds > 1) std::fprintf(stderr, "round %lld of %lld\n", static_cast<long long>(round + 1), static_cast<long long>(rounds));
    for (const std::string& transport : transports) {
      if (transport == "ucx_perftest") {
        // One run each per round (the rounds give the spread); three in a single round, whose
        // overall figure swings 2-3x on this VM (its per-iteration average then stays high).
        yardsticks(round, rounds > 1 ? 1 : kPerftestRuns);
        continue;
      }
      auto target = Target::Create(transport, setting);
      if (!target.ok()) return std::cerr << "pool_bench: " << transport << ": " << target.status().message() << "\n", 1;
      for (int64_t conc : conc_list) {
        for (int64_t blocks : blocks_list) {
          nlohmann::json row = MeasureRow(**target, transport, round, conc, blocks, setting);
          if (row.is_null()) return 1;
          runs.push_back(std::move(row));
        }
      }
    }
  }
  nlohmann::json doc = {{"runs", runs}, {"ucx_ceiling", ceilings}, {"block_bytes", block_bytes},
                        {"chunks_per_gatherer", chunks}};
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) std::cout << doc.dump(2) << "\n";
  else std::ofstream(out) << doc.dump(2) << "\n";
  return 0;
}
