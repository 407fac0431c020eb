// A small client of etcd v3's gRPC API (proto/etcd_rpc.proto): the calls the cluster registry
// makes (docs/decisions/0051-registry-on-etcd.md). Each call goes to the endpoint that last
// answered and moves on to the next when one is unreachable, so a cluster of several members
// keeps serving through the loss of any minority. With a user, it authenticates and sends the
// token etcd gives, authenticating again when etcd says the token expired. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "proto/cluster_registry.h"
#include "proto/etcd_rpc.grpc.pb.h"

namespace dd {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // HOST:PORT of the members
  std::string user, password;          // etcd's own users; empty = auth off
  std::chrono::milliseconds timeout{2000};  // per call and endpoint
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null = plaintext
};

// "etcd://HOST:PORT[,HOST:PORT...]" → the endpoints; INVALID_ARGUMENT names the problem.
absl::StatusOr<std::vector<std::string>> ParseEtcdUrl(const std::string& url);

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options);

  absl::StatusOr<int64_t> Grant(int64_t ttl_seconds);
  // NOT_FOUND when the lease expired or was revoked.
  absl::Status KeepAlive(int64_t lease);
  absl::Status Revoke(int64_t lease);
  absl::Status Put(const std::string& key, const std::string& value, int64_t lease);
  // A key's value and the lease it is held under (0: none, it never expires).
  using Held = RegistryRecord;
  // Puts `value` only if `key` does not exist: nullopt when it did not, else what it holds.
  absl::StatusOr<std::optional<Held>> Create(const std::string& key, const std::string& value, int64_t lease);

  struct Listing {
    int64_t revision = 0;  // the store's revision the listing is of
    std::map<std::string, Held> values;
  };
  absl::StatusOr<Listing> List(const std::string& prefix);

  // A watch of every key under a prefix from a revision on, on one member (the next one at each
  // call). Created() waits for etcd to confirm it; Next blocks for the next response. Both are
  // false once the stream ended (etcd gone, Cancel, a member that lost its leader); run them on
  // one thread, Cancel from any.
  class Watch {
   public:
    bool Created();
    bool Next(etcdserverpb::WatchResponse* out);
    void Cancel() { ctx_.TryCancel(); }
    ~Watch();

   private:
    friend class EtcdClient;
    grpc::ClientContext ctx_;
    std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>> stream_;
  };
  absl::StatusOr<std::unique_ptr<Watch>> StartWatch(const std::string& prefix, int64_t start_revision);

 private:
  struct Member {
    std::string endpoint;
    std::shared_ptr<grpc::Channel> channel;
  };
  // Runs `call(channel, ctx)` on the members in turn, from the one that last answered, until one
  // answers (anything but UNAVAILABLE / DEADLINE_EXCEEDED).
  template <typename Call>
  grpc::Status OnAnyMember(const Call& call);
  // Sets the deadline and the auth token (authenticating first when there is none).
  grpc::Status Prepare(const Member& m, grpc::ClientContext* ctx, bool with_deadline = true);
  EtcdOptions options_;
  std::vector<Member> members_;
  std::mutex mu_;
  size_t current_ = 0;
  size_t next_watch_ = 0;  // the member the next watch goes to
  std::string token_;
};

// The end of the range holding every key with `prefix`.
std::string PrefixEnd(const std::string& prefix);

}  // namespace dd
