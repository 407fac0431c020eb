#include "proto/tls.h"

#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this process: serve gRPC over TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA certificate: dial peers over TLS and verify them; with --tls_cert, also require client "
          "certificates signed by it (mutual TLS)");

namespace dd {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  if (path.empty()) return std::string();
  std::ifstream f(path);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " cannot be read"));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  if (text.size() > (1 << 20)) return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " is over 1 MiB"));
  if (text.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " is not PEM (no -----BEGIN line)"));
  }
  return text;
}

}  // namespace

absl::StatusOr<TlsFiles> TlsFilesFromFlags() {
  TlsFiles t;
  absl::StatusOr<std::string> cert = ReadPem(absl::GetFlag(FLAGS_tls_cert), "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(absl::GetFlag(FLAGS_tls_key), "tls_key");
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> ca = ReadPem(absl::GetFlag(FLAGS_tls_ca), "tls_ca");
  if (!ca.ok()) return ca.status();
  if (cert->empty() != key->empty()) return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  t.cert_pem = *std::move(cert);
  t.key_pem = *std::move(key);
  t.ca_pem = *std::move(ca);
  return t;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsFiles& tls) {
  if (!tls.server()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(tls.client() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                     : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  ssl.pem_root_certs = tls.ca_pem;
  return grpc::SslServerCredentials(ssl);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsFiles& tls) {
  if (!tls.client()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls.ca_pem;
  ssl.pem_private_key = tls.key_pem;
  ssl.pem_cert_chain = tls.cert_pem;
  return grpc::SslCredentials(ssl);
}

}  // namespace dd
