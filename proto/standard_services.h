// What every DualDecoder gRPC server carries besides its own services: gRPC's standard health
// service (grpc.health.v1.Health, for Kubernetes probes and `ddctl health`) and server
// reflection (grpcurl and friends can list and describe the services). Health reports SERVING
// for the whole server and each registered service once it is up, NOT_SERVING while draining.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"

namespace dd {

// Call once before creating any grpc::ServerBuilder.
void EnableStandardServices();

// Adds `address` to `builder` as the server's one listening socket (*port gets the port once the
// server starts). gRPC otherwise opens a second socket per address (a SO_REUSEPORT clone for its
// second poller): on the same port when the port is fixed, but on another random port, printed
// nowhere, when it is 0. One listener per address, so what a server prints is all it listens on.
void ListenOn(grpc::ServerBuilder& builder, const std::string& address,
              std::shared_ptr<grpc::ServerCredentials> credentials, int* port);

// Reports SERVING for the whole server ("") and each of `services` (full names, e.g.
// dd::v1::Generate::service_full_name()).
void MarkServing(grpc::Server& server, const std::vector<std::string>& services);
// Reports NOT_SERVING for everything MarkServing named (draining: probes fail, new work goes
// elsewhere).
void MarkNotServing(grpc::Server& server);

}  // namespace dd
