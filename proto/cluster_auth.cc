#include "proto/cluster_auth.h"

#include <sys/stat.h>

#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/random.h"

ABSL_FLAG(std::string, cluster_secret_file, "",
          "File holding the secret the router and its workers show each other (one line, >= 32 characters, "
          "mode 0600); empty = internal calls unauthenticated");

namespace dd {

absl::StatusOr<std::string> LoadClusterSecret(const std::string& path) {
  if (path.empty()) return std::string();
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret file ", path, " cannot be read"));
  }
  if (st.st_mode & (S_IRWXG | S_IRWXO)) {
    return absl::InvalidArgumentError(absl::StrCat("cluster secret file ", path,
                                                   " is accessible to group or others (chmod 600 it)"));
  }
  if (st.st_size > 4096) return absl::InvalidArgumentError(absl::StrCat("cluster secret file ", path, " is over 4 KiB"));
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
  const grpc::string_ref got_ref = it->second;
  const char* got = got_ref.data();
  const size_t got_size = got_ref.size();
  // Constant time in the secret's length: no early exit on the first differing byte.
  unsigned char diff = got_size == secret.size() ? 0 : 1;
  for (size_t i = 0; i < secret.size(); ++i) diff |= static_cast<unsigned char>(secret[i] ^ (i < got_size ? got[i] : 0));
  if (diff != 0) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong cluster secret");
  return grpc::Status::OK;
}

void AttachClusterSecret(grpc::ClientContext* ctx, const std::string& secret) {
  if (!secret.empty()) ctx->AddMetadata(kClusterSecretHeader, secret);
}

}  // namespace dd
