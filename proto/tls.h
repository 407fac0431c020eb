// gRPC transport security for the router, the decode worker and ddctl (the pool has its own
// --tls_cert/--tls_key and DD_KV_POOL_CA). One set of flags serves both ends of a process's
// links:
//   --tls_cert, --tls_key  this process's certificate chain and key (PEM). A server with them
//                          speaks TLS; a client presents them (mutual TLS) when its peer asks.
//   --tls_ca               the CA that signs the cluster's certificates. A client with it dials
//                          over TLS and verifies the server; a server with it (and a cert)
//                          requires and verifies a client certificate: mutual TLS.
// None of them: plaintext, as for the local embedded default. Errors name the flag and file.
#pragma once

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);

namespace dd {

struct TlsFiles {
  std::string cert_pem, key_pem, ca_pem;  // contents, not paths
  bool server() const { return !cert_pem.empty(); }
  bool client() const { return !ca_pem.empty(); }
};

// Reads the files the flags name; refuses a cert without its key (or the reverse).
absl::StatusOr<TlsFiles> TlsFilesFromFlags();
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& tls);
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& tls);

}  // namespace dd
