// dd-router: the public gRPC API (proto/generate.proto) in front of registered decode workers
// (proto/worker.proto Registry on the same port). Prints
// "dd-router: listening on HOST:PORT metrics HOST:PORT" once serving.
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/signals.h"
#include "glog/logging.h"
#include "common/metrics_server.h"
#include "proto/cluster_auth.h"
#include "proto/standard_services.h"
#include "proto/generate.grpc.pb.h"
#include "proto/tls.h"
#include "proto/worker.grpc.pb.h"
#include "router/openai_http.h"
#include "router/router_flags.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC listen address for clients and workers (port 0 = pick one)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0", "Prometheus /metrics address (empty = off)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("dd-router [--listen HOST:PORT] [--max_inflight N] ...");
  absl::ParseCommandLine(argc, argv);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  dd::BlockTermSignals();
  dd::router::RouterOptions options = dd::router::RouterOptionsFromFlags();
  auto secret = dd::ClusterSecretFromFlags();
  if (!secret.ok()) {
    std::cerr << "dd-router: " << secret.status().message() << "\n";
    return 2;
  }
  options.cluster_secret = *secret;
  auto tls = dd::TlsFilesFromFlags();
  if (!tls.ok()) {
    std::cerr << "dd-router: " << tls.status().message() << "\n";
    return 2;
  }
  options.worker_credentials = dd::ChannelCredentials(*tls);
  auto auth = dd::router::ApiAuthFromFlags();
  if (!auth.ok()) {
    std::cerr << "dd-router: " << auth.status().message() << "\n";
    return 2;
  }
  options.auth = *std::move(auth);
  if (secret->empty()) {
    LOG(WARNING) << "no --cluster_secret_file: anyone who reaches this port can register a worker";
  }
  auto registry = dd::RegistryFromFlags();
  if (!registry.ok()) {
    std::cerr << "dd-router: " << registry.status().message() << "\n";
    return 2;
  }
  dd::router::RouterService router(options);
  dd::EnableStandardServices();
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  dd::ListenOn(builder, listen, dd::ServerCredentials(*tls), &port);
  builder.RegisterService(&router);
  builder.RegisterService(router.registry_service());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "dd-router: cannot listen on " << listen << "\n";
    return 1;
  }
  dd::MarkServing(*server, {dd::v1::DualDecoder::service_full_name(), dd::worker::v1::Registry::service_full_name()});
  if (registry->shared()) router.FollowRegistry(*registry, absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port));
  std::unique_ptr<dd::MetricsServer> exposer;
  std::string metrics_at = "off";
  if (const std::string m = absl::GetFlag(FLAGS_metrics_listen); !m.empty()) {
    auto server = dd::MetricsServer::Start(m);
    if (!server.ok()) {
      std::cerr << "dd-router: " << server.status().message() << "\n";
      return 1;
    }
    exposer = std::move(*server);
    router.RegisterMetrics(*exposer);
    metrics_at = absl::StrCat(m.substr(0, m.rfind(':')), ":", exposer->port());
  }
  std::unique_ptr<dd::router::OpenAiHttp> http;
  std::string http_at;
  const auto http_options = dd::router::HttpOptionsFromFlags(options.auth);
  if (!http_options.ok()) {
    std::cerr << "dd-router: " << http_options.status().message() << "\n";
    return 1;
  }
  if (!http_options->listen.empty()) {
    const std::string& h = http_options->listen;
    auto started = dd::router::OpenAiHttp::Start(*http_options, server->InProcessChannel(grpc::ChannelArguments()));
    if (!started.ok()) {
      std::cerr << "dd-router: " << started.status().message() << "\n";
      return 1;
    }
    http = std::move(*started);
    http_at = absl::StrCat(" http ", h.substr(0, h.rfind(':')), ":", http->port());
  }
  std::printf("dd-router: listening on %s:%d metrics %s%s\n", listen.substr(0, listen.rfind(':')).c_str(), port,
              metrics_at.c_str(), http_at.c_str());
  std::fflush(stdout);
  const int sig = dd::WaitForTermSignal();
  std::fprintf(stderr, "dd-router: signal %d, shutting down\n", sig);
  dd::MarkNotServing(*server);
  http.reset();  // no new HTTP requests; those running end with the gRPC server below
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  exposer.reset();
  return 0;
}
