// Runs a real dd-kv-pool process (the binary next to the running one) with two tenants, for
// tests and benchmarks: alice (8 MiB quota unless given) and bob (1 MiB). Ports are picked by
// the pool (port 0) and read from the line it prints. address() is empty if it failed to start.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool::testing_util {

inline constexpr char kAlice[] = "alice-token-0123456789", kBob[] = "bob-token-0123456789ab";

// For benchmarks comparing UCX threads that yield while they spin with ones that do not: sets
// this process's $DD_UCX_SPIN_YIELD (read at its first UCX wait) and returns the dd-kv-pool
// flag that does the same in the pool.
inline std::string SpinYieldEverywhere(bool yield) {
  setenv("DD_UCX_SPIN_YIELD", yield ? "1" : "0", 1);
  return yield ? "--ucx_spin_yield=true" : "--ucx_spin_yield=false";
}

// Starts dd-kv-pool (next to this test binary) and reads the port it prints.
class PoolProcess {
 public:
  // `extra`: more dd-kv-pool flags (e.g. "--ucx_rma").
  explicit PoolProcess(int64_t lease_ttl_ms = 30000, const std::string& alice_quota = "8MiB",
                       const std::vector<std::string>& extra = {}) {
    const std::string dir = std::filesystem::temp_directory_path().string();
    const std::string cfg = dir + "/tenants-" + std::to_string(getpid()) + ".json";
    std::ofstream(cfg) << R"([{"name": "alice", "token": ")" << kAlice << R"(", "quota": ")" << alice_quota << R"("},
                              {"name": "bob", "token": ")" << kBob << R"(", "quota": "1MiB"}])";
    chmod(cfg.c_str(), 0600);  // the pool refuses a tenants file others could read
    char self[4096] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string exe = std::string(self, n > 0 ? n : 0);
    exe = exe.substr(0, exe.rfind('/')) + "/dd-kv-pool";
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // a killed test or benchmark leaves no pool behind
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      const std::string ttl = "--lease_ttl_ms=" + std::to_string(lease_ttl_ms), tenants = "--tenants=" + cfg;
      std::vector<const char*> argv{exe.c_str(), tenants.c_str(), ttl.c_str()};
      for (const std::string& f : extra) argv.push_back(f.c_str());
      argv.push_back(nullptr);
      execv(exe.c_str(), const_cast<char* const*>(argv.data()));
      _exit(127);
    }
    close(out[1]);
    std::string line;
    pollfd pfd{out[0], POLLIN, 0};
    char c = 0;
    while (poll(&pfd, 1, 20000) == 1 && read(out[0], &c, 1) == 1 && c != '\n') line += c;
    close(out[0]);
    const auto at = line.rfind("listening on ");
    if (at == std::string::npos) {
      std::fprintf(stderr, "dd-kv-pool did not start: '%s'\n", line.c_str());
    } else {
      address_ = line.substr(at + 13, line.find(' ', at + 13) - (at + 13));
      metrics_ = line.substr(line.rfind(' ') + 1);
    }
  }
  ~PoolProcess() { Kill(SIGTERM); }
  void Kill(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }
  // The pool's wait status once it has exited on its own, reaped; nullopt if it still runs at
  // `deadline` (then it is left running).
  std::optional<int> WaitExit(std::chrono::steady_clock::time_point deadline) {
    while (pid_ > 0) {
      int status = 0;
      const pid_t r = waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return status;
      }
      if (r < 0 && errno != EINTR) {  // not our child (any more): nothing to wait for or kill
        pid_ = -1;
        return std::nullopt;
      }
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      pollfd none{-1, 0, 0};
      (void)poll(&none, 1, 10);  // a 10 ms pause between checks
    }
    return std::nullopt;
  }
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }
  const std::string& metrics() const { return metrics_; }
  std::unique_ptr<v1::KvPool::Stub> Stub() {
    return v1::KvPool::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

 private:
  pid_t pid_ = -1;
  std::string address_, metrics_;
};

// GET http://host:port/metrics with a plain socket; returns the body ("" on failure).
inline std::string Scrape(const std::string& hostport) {
  const auto colon = hostport.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(hostport.substr(colon + 1))));
  inet_pton(AF_INET, hostport.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: " + hostport + "\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string resp;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) resp.append(buf, n);
  close(fd);
  const auto body = resp.find("\r\n\r\n");
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

// The value of the first sample line starting with `series` in a Prometheus text body.
inline double Sample(const std::string& body, const std::string& series) {
  const auto at = body.find("\n" + series);
  if (at == std::string::npos) return -1;
  const auto eol = body.find('\n', at + 1);
  const std::string line = body.substr(at + 1, eol - at - 1);
  return std::stod(line.substr(line.rfind(' ') + 1));
}

}  // namespace dd::kvpool::testing_util
