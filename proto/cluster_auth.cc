#include "proto/cluster_auth.h"

#include <sys/stat.h>

#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"
#include "common/secrets.h"

ABSL_FLAG(std::string, cluster_secret_file, "",
          "File holding the secret the router and its workers show each other (one line, >= 32 characters, "
          "mode 0600); empty = internal calls unauthenticated");

namespace dd {

absl::StatusOr<std::string> LoadClusterSecret(const std::string& path) {
  if (path.empty()) return std::string();
  if (absl::Status s = CheckPrivateFile(path, "cluster secret file", 4096); !s.ok()) return s;
  std::ifstream f(path);
  std::string secret;
  if (!f || !std::getline(f, secret)) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret file ", path, " cannot be read"));
  }
  secret = std::string(absl::StripAsciiWhitespace(secret));
  if (secret.size() < kMinClusterSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret in ", path, " is ", secret.size(),
                                                   " characters; at least ", kMinClusterSecretBytes, " are needed"));
  }
  for (unsigned char c : secret) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat("cluster secret in ", path, " has a character outside printable ASCII"));
    }
  }
  return secret;
}

absl::StatusOr<std::string> ClusterSecretFromFlags() { return LoadClusterSecret(absl::GetFlag(FLAGS_cluster_secret_file)); }

std::string RandomClusterSecret() {
  return RandomHex(4);
}

grpc::Status CheckClusterSecret(const grpc::ServerContext* ctx, const std::string& secret) {
  if (secret.empty()) return grpc::Status::OK;
  const auto& md = ctx->client_metadata();
  auto it = md.find(kClusterSecretHeader);
  if (it == md.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "this is an internal service: the cluster secret is missing");
  }
  const grpc::string_ref got = it->second;
  if (!SecretEquals(secret, absl::string_view(got.data(), got.size()))) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong cluster secret");
  }
  return grpc::Status::OK;
}

void AttachClusterSecret(grpc::ClientContext* ctx, const std::string& secret) {
  if (!secret.empty()) ctx->AddMetadata(kClusterSecretHeader, secret);
}

}  // namespace dd
