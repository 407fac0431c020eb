// dd-kv-pool: a host-memory KV pool process (docs/architecture.md, "KV store and pool"). Tenants,
// tokens and quotas come from --tenants (JSON). Prints "dd-kv-pool: listening on HOST:PORT metrics
// HOST:PORT" on stdout once serving, so a caller that asked for port 0 learns the ports. SIGTERM /
// SIGINT shut it down cleanly. Regions are anonymous memory files handed to same-host workers over
// --fd_socket: nothing is left in /dev/shm, even by a killed pool.
#include <filesystem>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <iostream>
#include <mutex>
#include <set>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "kv-pool/client/fd_passing.h"
#include "kv-pool/client/ucx_config.h"
#include "kv-pool/server/metrics.h"
#include "kv-pool/server/service.h"
#include "kv-pool/server/ucx_server.h"
#include "proto/cluster_auth.h"
#include "proto/pool_record.h"
#include "proto/standard_services.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC listen address (port 0 = pick a free port)");
ABSL_FLAG(std::string, tenants, "", "Tenant config: JSON array of {name, token, quota}");
ABSL_FLAG(int64_t, lease_ttl_ms, 30000, "Lease TTL; workers renew at a third of it");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve gRPC over TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(bool, huge_pages, false, "Back regions with huge pages (MAP_HUGETLB)");
ABSL_FLAG(bool, lock_memory, false, "mlock the regions");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus /metrics address (empty = off)");
ABSL_FLAG(bool, ucx, true, "Serve the ucx:// data path (active messages bounded by each tenant's region)");
ABSL_FLAG(bool, ucx_rma, false,
          "Also register the regions for one-sided UCX gets and puts. Fast on RDMA, whose keys the NIC "
          "confines to a region; over tcp and shared-memory transports UCX cannot, so a tenant could reach "
          "other tenants' regions: only for trusted tenants");
ABSL_FLAG(bool, ucx_rma_unconfined, false,
          "Allow --ucx_rma with transports other than RDMA (UCX_TLS unset or naming more than rc/ud/dc/ib): over "
          "tcp and shared memory one-sided access is not confined to a region, and one get outside it crashes the "
          "pool. Only where every peer is trusted (tests)");
ABSL_FLAG(bool, ucx_tcp, false,
          "Serve ucx:// over tcp too. UCX 1.13's tcp transport writes wherever a peer's put request says, "
          "unchecked: any process that can reach the pool's UCX tcp ports can write any of its memory, every "
          "tenant's region included. Only on a network where every peer is trusted; without it UCX serves "
          "shared memory and RDMA (tcp is left out of UCX's configuration, and the pool exits if UCX loads it anyway)");
ABSL_FLAG(bool, ucx_busy_poll, false, "Spin the UCX progress thread instead of sleeping (lower latency, one core)");
ABSL_FLAG(int64_t, ucx_spin_us, 200,
          "Without --ucx_busy_poll: keep polling this many microseconds after the last UCX progress before sleeping "
          "(a worker's next request usually comes within it; 0 on a host where the pool shares cores with workers "
          "that refetch in bulk)");
ABSL_FLAG(bool, ucx_spin_yield, true,
          "While the UCX progress thread spins with nothing to do, yield the core every 16 polls (to the threads "
          "it waits for, on a host with more runnable threads than cores)");
ABSL_FLAG(std::string, fd_socket, "",
          "Unix socket that hands a tenant's region to same-host workers for its token (shm://); empty = an "
          "abstract socket with a fresh name");
ABSL_FLAG(std::string, advertise_host, "",
          "With --registry etcd://...: the host workers should dial (default: the --listen host)");
ABSL_FLAG(std::string, node, "",
          "With --registry etcd://...: the machine this pool runs on, as workers name theirs (default: the hostname); "
          "workers on the same node reach it over shm://");
ABSL_FLAG(std::string, pool_id, "", "With --registry etcd://...: this pool's id in the registry (default: <hostname>-<pid>)");
ABSL_FLAG(int64_t, heartbeat_ms, 1000,
          "With --registry etcd://...: how often the record is rewritten; its lease lasts 6 intervals (at least 2 s)");
ABSL_FLAG(std::string, fd_socket_uids, "",
          "Users (numeric uids, comma-separated) besides the pool's own whose processes may ask the region socket "
          "for a descriptor; others are closed at accept");

namespace {

constexpr char kShmPrefix[] = "dd-kvpool";

std::string HostName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// Holds this pool's record in etcd (proto/pool_record.h) until destroyed.
std::unique_ptr<dd::RegistryMembership> Register(const dd::RegistryConfig& registry, const std::string& secret,
                                             dd::PoolRecord record) {
  const std::string key = registry.prefix + "pools/" + record.pool_id;
  const auto interval = std::chrono::milliseconds(std::max<int64_t>(100, absl::GetFlag(FLAGS_heartbeat_ms)));
  auto value = [secret, key, record]() mutable {
    record.published_unix_seconds =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    return dd::SignRecord(secret, key, dd::PoolRecordJson(record));
  };
  // Its own earlier run (restarted at the same address before the lease ran out) takes the key
  // over; any other holder keeps it until its lease goes.
  auto may_take = [secret, key, address = record.address](const std::string& held) {
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    absl::StatusOr<dd::PoolRecord> r = dd::ParsePoolRecord(secret, key, {held, /*lease=*/1}, now);
    return r.ok() && r->address == address;
  };
  const int64_t ttl_seconds = std::max<int64_t>(2, (6 * interval.count() + 999) / 1000);
  return registry.backend->Join(key, value, may_take, interval, ttl_seconds);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("no file given");
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

// Whether UCX is limited to transports whose one-sided access the NIC confines to a registered
// region: UCX_TLS names RDMA transports only (and `self`, which no peer reaches). Anything else
// (unset, an exclusion list, shared memory, tcp) lets a peer's get reach outside its region.
bool RmaConfinedByUcxTls() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0' || *tls == '^') return false;
  static const std::set<std::string> kConfined = {"rc",    "rc_v",  "rc_x",  "rc_mlx5", "ud",      "ud_v", "ud_x",
                                                 "ud_mlx5", "dc",   "dc_x",  "dc_mlx5", "ib",      "self"};
  for (absl::string_view t : absl::StrSplit(tls, ',', absl::SkipWhitespace())) {
    if (!kConfined.count(std::string(absl::StripAsciiWhitespace(t)))) return false;
  }
  return true;
}

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("dd-kv-pool --tenants FILE [--listen HOST:PORT] [--lease_ttl_ms N]");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;  // the registry client logs its outages
  google::InitGoogleLogging(argv[0]);
  // UCX over tcp lets any peer write this process's memory (ucx_config.h): only on request.
  // UcxServer leaves tcp out of its own configuration (and fails if UCX loads it anyway); a
  // UCX_TLS that asks for tcp by name is refused here, with the reason.
  if (absl::GetFlag(FLAGS_ucx) && !absl::GetFlag(FLAGS_ucx_tcp) && dd::kvpool::TlsNamesTcp()) {
    std::cerr << "dd-kv-pool: UCX_TLS=" << std::getenv("UCX_TLS") << " names tcp, over which any process that can "
              << "reach the pool can write its memory (UCX checks no address or key); pass --ucx_tcp on a network "
              << "where every peer is trusted, or leave tcp out of UCX_TLS\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_ucx) && absl::GetFlag(FLAGS_ucx_tcp) && dd::kvpool::TlsAllowsAny({"tcp"})) {
    std::cerr << "dd-kv-pool: --ucx_tcp: any process that can reach this pool's UCX tcp ports can write its memory; "
              << "keep them on a trusted network (UCX_TCP_PORT_RANGE pins them)\n";
  }
  if (absl::GetFlag(FLAGS_tenants).empty()) {
    std::cerr << "dd-kv-pool: --tenants FILE is required (JSON array of {name, token, quota})\n";
    return 2;
  }
  auto tenants = dd::kvpool::LoadTenantConfig(absl::GetFlag(FLAGS_tenants));
  if (!tenants.ok()) {
    std::cerr << "dd-kv-pool: " << tenants.status().message() << "\n";
    return 2;
  }
  auto registry = dd::RegistryFromFlags();
  if (!registry.ok()) {
    std::cerr << "dd-kv-pool: " << registry.status().message() << "\n";
    return 2;
  }
  if (const std::string listen = absl::GetFlag(FLAGS_listen); registry->shared() &&
      absl::GetFlag(FLAGS_advertise_host).empty() && !listen.empty() &&
      (absl::StartsWith(listen, "0.0.0.0:") || absl::StartsWith(listen, "[::]:") || listen.front() == ':')) {
    std::cerr << "dd-kv-pool: --listen " << listen << " is every interface: give --advertise_host, the address "
              << "workers should dial, to register in " << registry->url << "\n";
    return 2;
  }
  auto secret = dd::ClusterSecretFromFlags();
  if (!secret.ok()) {
    std::cerr << "dd-kv-pool: " << secret.status().message() << "\n";
    return 2;
  }
  dd::kvpool::PoolOptions options;
  options.lease_ttl = std::chrono::milliseconds(absl::GetFlag(FLAGS_lease_ttl_ms));
  options.region = {absl::GetFlag(FLAGS_huge_pages), absl::GetFlag(FLAGS_lock_memory)};
  options.shm_prefix = kShmPrefix;
  auto pool = dd::kvpool::Pool::Create(*std::move(tenants), options);
  if (!pool.ok()) {
    std::cerr << "dd-kv-pool: " << pool.status().message() << "\n";
    return pool.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }

  // Signals are taken synchronously by one thread that shuts the server down.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  std::unique_ptr<dd::kvpool::UcxServer> ucx;
  if (const int64_t spin = absl::GetFlag(FLAGS_ucx_spin_us); spin < 0 || spin > 1000000) {
    std::cerr << "dd-kv-pool: --ucx_spin_us=" << spin << " is outside [0, 1000000]\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_ucx) && absl::GetFlag(FLAGS_ucx_rma) && !absl::GetFlag(FLAGS_ucx_rma_unconfined) &&
      !RmaConfinedByUcxTls()) {
    std::cerr << "dd-kv-pool: --ucx_rma needs UCX_TLS to name RDMA transports only (e.g. UCX_TLS=rc,ud; now '"
              << (std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "unset")
              << "'): over tcp and shared memory UCX does not confine one-sided access to a region, and a single "
                 "get outside it crashes the pool. Leave --ucx_rma off (the active-message path is checked), or add "
                 "--ucx_rma_unconfined where every peer is trusted\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_ucx)) {
    if (absl::Status st = dd::kvpool::CheckUcxSegmentSizes(); !st.ok()) {  // a setting to fix, not UCX missing
      std::cerr << "dd-kv-pool: " << st.message() << "\n";
      return 2;
    }
    std::vector<dd::kvpool::UcxRegion> regions;
    for (int t = 0; t < (*pool)->tenants(); ++t) regions.push_back({(*pool)->region_data(t), (*pool)->region_bytes(t)});
    auto server = dd::kvpool::UcxServer::Create(std::move(regions), {.rma = absl::GetFlag(FLAGS_ucx_rma),
                                                                     .busy_poll = absl::GetFlag(FLAGS_ucx_busy_poll),
                                                                     .spin_us = absl::GetFlag(FLAGS_ucx_spin_us),
                                                                     .spin_yield = absl::GetFlag(FLAGS_ucx_spin_yield),
                                                                     .tcp = absl::GetFlag(FLAGS_ucx_tcp)});
    if (!server.ok()) {
      std::cerr << "dd-kv-pool: UCX unavailable (" << server.status().message() << "); run with --ucx=false\n";
      return 1;
    }
    ucx = std::move(*server);
    ucx->Start();
  }
  // shm://: regions are anonymous; a worker gets its tenant's descriptor here, for its token.
  dd::kvpool::Pool& pool_ref = **pool;
  std::vector<uint32_t> uids;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_fd_socket_uids), ',', absl::SkipWhitespace())) {
    uint32_t uid = 0;
    if (!absl::SimpleAtoi(part, &uid)) {
      std::cerr << "dd-kv-pool: --fd_socket_uids: '" << part << "' is not a numeric uid\n";
      return 2;
    }
    uids.push_back(uid);
  }
  auto fds = dd::kvpool::FdServer::Start(
      absl::GetFlag(FLAGS_fd_socket),
      [&pool_ref](absl::string_view token) {
        auto t = pool_ref.Authenticate(absl::StrCat("Bearer ", token));
        return t.ok() ? pool_ref.region_fd(*t) : -1;
      },
      std::move(uids));
  if (!fds.ok()) {
    std::cerr << "dd-kv-pool: " << fds.status().message() << "\n";
    return 1;
  }
  dd::kvpool::KvPoolService service(**pool, ucx.get(), (*fds)->address());
  dd::EnableStandardServices();
  grpc::ServerBuilder builder;
  int port = 0;
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!absl::GetFlag(FLAGS_tls_cert).empty() || !absl::GetFlag(FLAGS_tls_key).empty()) {
    auto cert = ReadFile(absl::GetFlag(FLAGS_tls_cert)), key = ReadFile(absl::GetFlag(FLAGS_tls_key));
    if (!cert.ok() || !key.ok()) {
      std::cerr << "dd-kv-pool: TLS needs both --tls_cert and --tls_key: "
                << (cert.ok() ? key.status() : cert.status()).message() << "\n";
      return 2;
    }
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    creds = grpc::SslServerCredentials(ssl);
  }
  dd::ListenOn(builder, absl::GetFlag(FLAGS_listen), creds, &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "dd-kv-pool: cannot listen on " << absl::GetFlag(FLAGS_listen) << "\n";
    return 1;
  }
  dd::MarkServing(*server, {dd::kvpool::v1::KvPool::service_full_name()});
  std::unique_ptr<dd::kvpool::PoolMetrics> metrics;
  std::string metrics_at = "off";
  if (const std::string m = absl::GetFlag(FLAGS_metrics_listen); !m.empty()) {
    auto started = dd::kvpool::PoolMetrics::Start(**pool, m, ucx.get());
    if (!started.ok()) {
      std::cerr << "dd-kv-pool: " << started.status().message() << "\n";
      return 1;
    }
    metrics = std::move(*started);
    metrics_at = m.substr(0, m.rfind(':')) + ":" + std::to_string(metrics->port());
  }
  const std::string listen = absl::GetFlag(FLAGS_listen);
  std::printf("dd-kv-pool: listening on %s:%d metrics %s\n", listen.substr(0, listen.rfind(':')).c_str(), port,
              metrics_at.c_str());
  std::fflush(stdout);
  std::unique_ptr<dd::RegistryMembership> membership;
  if (registry->shared()) {
    dd::PoolRecord record;
    record.pool_id = absl::GetFlag(FLAGS_pool_id).empty() ? absl::StrCat(HostName(), "-", getpid()) : absl::GetFlag(FLAGS_pool_id);
    std::string host = absl::GetFlag(FLAGS_advertise_host);
    if (host.empty()) host = listen.substr(0, listen.rfind(':'));
    record.address = absl::StrCat(host, ":", port);
    record.node = absl::GetFlag(FLAGS_node).empty() ? HostName() : absl::GetFlag(FLAGS_node);
    record.ucx = ucx != nullptr;
    for (int t = 0; t < (*pool)->tenants(); ++t) record.capacity_bytes += (*pool)->region_bytes(t);
    std::fprintf(stderr, "dd-kv-pool: registering as %s (node %s, %s) in %s\n", record.pool_id.c_str(),
                 record.node.c_str(), record.address.c_str(), registry->url.c_str());
    membership = Register(*registry, *secret, std::move(record));
  }

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread reaper([&] {  // expires leases at a quarter of the TTL
    std::unique_lock<std::mutex> lock(mu);
    while (!cv.wait_for(lock, options.lease_ttl / 4, [&] { return stopping; })) {
      const int64_t n = (*pool)->ExpireLeases(dd::kvpool::Pool::Clock::now());
      if (n > 0) std::fprintf(stderr, "dd-kv-pool: %lld leases expired\n", static_cast<long long>(n));
    }
  });
  int sig = 0;
  sigwait(&sigs, &sig);
  std::fprintf(stderr, "dd-kv-pool: signal %d, shutting down\n", sig);
  dd::MarkNotServing(*server);
  membership.reset();  // the record goes at once: workers stop choosing this pool
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  cv.notify_all();
  reaper.join();
  // The metrics server takes seconds to stop politely; nothing is left to flush (regions are
  // anonymous and vanish with the process), so leave without running destructors.
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(0);
}
