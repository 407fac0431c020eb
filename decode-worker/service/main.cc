// dd-decode-worker: one decode worker (docs/architecture.md, "Processes and components"): loads the
// model, serves proto/worker.proto's Worker service with continuous batching and, with --router,
// registers there and heartbeats its load. Prints "dd-decode-worker: listening on HOST:PORT metrics
// HOST:PORT" once serving.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/signals.h"
#include "decode-worker/service/engine_flags.h"
#include "decode-worker/service/worker_node.h"
#include "glog/logging.h"
#include "proto/cluster_auth.h"
#include "proto/pool_record.h"
#include "proto/standard_services.h"
#include "proto/tls.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC listen address (port 0 = pick a free port)");
ABSL_FLAG(std::string, advertise_host, "", "Host the router should dial (default: the --listen host)");
ABSL_FLAG(std::string, router, "", "Router registry address HOST:PORT (empty = serve without a router)");
ABSL_FLAG(std::string, worker_id, "", "Worker id (default: <hostname>-<pid>)");
ABSL_FLAG(int64_t, heartbeat_ms, 500, "Heartbeat interval to the router");
ABSL_FLAG(std::string, node, "",
          "With --kv_store registry://...: the machine this worker runs on, as pools name theirs (default: the hostname)");
ABSL_FLAG(int64_t, kv_pool_wait_ms, 120000,
          "With --kv_store registry://...: how long to wait at start for a pool to register before giving up");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus /metrics address (empty = off)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("dd-decode-worker [--router HOST:PORT] [--mode M] [--device_memory SIZE] ...");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  auto fail = [](const absl::Status& st) {
    std::cerr << "dd-decode-worker: " << st.message() << "\n";
    return st.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  };
  auto engine_options = dd::worker::EngineOptionsFromFlags(/*serving=*/true);
  if (!engine_options.ok()) return fail(engine_options.status());
  auto model = dd::worker::LoadModelFromFlags();
  if (!model.ok()) return fail(model.status());
  if (absl::Status st = dd::worker::ApplyDeviceCheck(**model, &*engine_options); !st.ok()) return fail(st);
  dd::BlockTermSignals();
  dd::worker::WorkerIdentity id;
  id.worker_id = absl::GetFlag(FLAGS_worker_id);
  char host_name[256] = {0};
  gethostname(host_name, sizeof(host_name) - 1);
  if (id.worker_id.empty()) id.worker_id = absl::StrCat(host_name, "-", getpid());
  id.model = (*model)->config.name;
  auto secret = dd::ClusterSecretFromFlags();
  if (!secret.ok()) return fail(secret.status());
  auto tls = dd::TlsFilesFromFlags();
  if (!tls.ok()) return fail(tls.status());
  auto registry = dd::RegistryFromFlags();
  if (!registry.ok()) return fail(registry.status());
  if (registry->shared() && !absl::GetFlag(FLAGS_router).empty()) {
    return fail(absl::InvalidArgumentError("give --router (one router) or --registry etcd://... (any router), not both"));
  }
  // A pool found in the registry (proto/pool_record.h): waited for here, looked up again by the
  // store whenever it is lost.
  std::shared_ptr<dd::PoolLocator> pools;
  if (dd::IsRegistryKvStore(engine_options->kv_store)) {
    auto reach = dd::ParseRegistryKvStore(engine_options->kv_store);
    if (!reach.ok()) return fail(reach.status());
    if (!registry->shared()) {
      return fail(absl::InvalidArgumentError(absl::StrCat("--kv_store ", engine_options->kv_store,
                                                          " finds the pool in etcd: give --registry etcd://...")));
    }
    const std::string node = absl::GetFlag(FLAGS_node).empty() ? host_name : absl::GetFlag(FLAGS_node);
    if (secret->empty()) {
      std::fprintf(stderr, "dd-decode-worker: warning: no --cluster_secret_file, so pool records are taken unsigned: "
                           "anyone who can write to etcd can send this worker, its pool token and its KV to a pool "
                           "of theirs\n");
    }
    pools = std::make_shared<dd::PoolLocator>(*registry, *secret, node, *reach);
    const int64_t wait_ms = absl::GetFlag(FLAGS_kv_pool_wait_ms);
    auto uri = pools->Wait(std::chrono::milliseconds(std::max<int64_t>(0, wait_ms)), [&](int64_t waited) {
      std::fprintf(stderr, "dd-decode-worker: waiting for a KV pool on node %s to register in %s (%lld s)\n",
                   node.c_str(), registry->url.c_str(), static_cast<long long>(waited));
    });
    if (!uri.ok()) {
      return fail(absl::UnavailableError(absl::StrCat("no KV pool for --kv_store ", engine_options->kv_store, " after ",
                                                      wait_ms, " ms: ", uri.status().message())));
    }
    std::fprintf(stderr, "dd-decode-worker: KV pool %s (found in %s)\n", uri->c_str(), registry->url.c_str());
    engine_options->kv_store = *uri;
    engine_options->kv_store_locate = [pools] { return pools->Locate(); };
  }
  auto sched = dd::worker::SchedulerOptionsFromFlags();
  if (!sched.ok()) return fail(sched.status());
  auto node = dd::worker::WorkerNode::Create(**model, *engine_options, *sched, id);
  if (!node.ok()) return fail(node.status());
  std::fprintf(stderr, "dd-decode-worker: compute device %s (%s)\n", engine_options->device.c_str(),
               engine_options->device_why.c_str());
  (*node)->service().set_cluster_secret(*secret);

  dd::EnableStandardServices();
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  dd::ListenOn(builder, listen, dd::ServerCredentials(*tls), &port);
  builder.RegisterService(&(*node)->service());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) return fail(absl::UnavailableError(absl::StrCat("cannot listen on ", listen)));
  dd::MarkServing(*server, {dd::worker::v1::Worker::service_full_name()});
  std::string host = absl::GetFlag(FLAGS_advertise_host);
  if (host.empty()) host = listen.substr(0, listen.rfind(':'));
  (*node)->service().set_address(absl::StrCat(host, ":", port));
  std::string metrics_at = "off";
  if (const std::string m = absl::GetFlag(FLAGS_metrics_listen); !m.empty()) {
    if (absl::Status st = (*node)->metrics().Serve(m, (*node)->scheduler()); !st.ok()) return fail(st);
    metrics_at = absl::StrCat(m.substr(0, m.rfind(':')), ":", (*node)->metrics().port());
  }
  if (registry->shared()) {
    (*node)->StartMembership(*registry, std::chrono::milliseconds(absl::GetFlag(FLAGS_heartbeat_ms)));
  } else if (const std::string router = absl::GetFlag(FLAGS_router); !router.empty()) {
    (*node)->StartHeartbeats(router, std::chrono::milliseconds(absl::GetFlag(FLAGS_heartbeat_ms)),
                             dd::ChannelCredentials(*tls));
  }
  std::printf("dd-decode-worker: listening on %s metrics %s\n", (*node)->service().identity().address.c_str(),
              metrics_at.c_str());
  std::fflush(stdout);
  const int sig = dd::WaitForTermSignal();
  const auto grace = dd::worker::DrainGraceFromFlags();
  std::fprintf(stderr, "dd-decode-worker: signal %d, draining (up to %lld ms)\n", sig, static_cast<long long>(grace.count()));
  const int left = dd::worker::DrainWorker((*node)->service(), (*node)->scheduler(), *server, grace);
  std::fprintf(stderr, "dd-decode-worker: %s, shutting down\n",
               left == 0 ? "drained" : absl::StrCat(left, " requests still running").c_str());
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  node->reset();
  return 0;
}
