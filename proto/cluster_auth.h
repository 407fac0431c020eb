// The cluster secret: what the router and its decode workers show each other on their internal
// calls (Registry.Register/Heartbeat to the router; Worker.Submit/Cancel/Stats to a worker),
// so that nobody else can register a worker, take a worker's place, cancel others' requests
// or submit work past the router's checks (docs/decisions/0026-security-model.md). It travels as
// gRPC metadata `x-dd-cluster-secret`; use TLS on the links where the network is not trusted.
//
// Off when empty (a lone worker on localhost, tests); `--cluster_secret_file` turns it on for
// dd-router, dd-decode-worker and ddctl (the file holds one line of at least 32 characters and
// must not be readable by group or others). `ddctl serve` always uses one: its own random secret
// when no file is given, since its router and worker share a process.
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

ABSL_DECLARE_FLAG(std::string, cluster_secret_file);

namespace dd {

// Trailing metadata on a worker's UNAVAILABLE answer to Submit: it is draining, not broken.
inline constexpr char kDrainingTrailer[] = "dd-worker-draining";

inline constexpr char kClusterSecretHeader[] = "x-dd-cluster-secret";
inline constexpr size_t kMinClusterSecretBytes = 32;

// Reads the secret from `path` (empty path: no secret, returns ""). Errors name the file and the
// problem: unreadable, too short, readable by others.
absl::StatusOr<std::string> LoadClusterSecret(const std::string& path);
// --cluster_secret_file, loaded.
absl::StatusOr<std::string> ClusterSecretFromFlags();
// 64 hex digits of OS randomness.
std::string RandomClusterSecret();

// Server side: OK when `secret` is empty or the call carries it (compared in constant time);
// UNAUTHENTICATED otherwise.
grpc::Status CheckClusterSecret(const grpc::ServerContext* ctx, const std::string& secret);
// Client side: attaches `secret` to the call when it is non-empty.
void AttachClusterSecret(grpc::ClientContext* ctx, const std::string& secret);

}  // namespace dd
