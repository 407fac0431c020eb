// gRPC front of the pool (proto/kvpool.proto): authenticates each call by its bearer token
// and maps Pool results to status codes (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED,
// UNAUTHENTICATED, FAILED_PRECONDITION).
#pragma once

#include "common/random.h"
#include "kv-pool/server/pool.h"
#include "kv-pool/server/ucx_server.h"
#include "proto/kvpool.grpc.pb.h"

namespace dd::kvpool {

class KvPoolService final : public v1::KvPool::Service {
 public:
  // `fd_socket`: the FdServer's address, returned by Handshake for the shm:// data path.
  // `ucx`: the pool's UCX side (null without it); Handshake hands out a session on it.
  KvPoolService(Pool& pool, UcxServer* ucx, std::string fd_socket = "")
      : pool_(pool), ucx_(ucx), fd_socket_(std::move(fd_socket)) {}
  grpc::Status Handshake(grpc::ServerContext* ctx, const v1::HandshakeRequest* req, v1::HandshakeResponse* resp) override;
  grpc::Status Open(grpc::ServerContext* ctx, const v1::OpenRequest* req, v1::OpenResponse* resp) override;
  grpc::Status Extend(grpc::ServerContext* ctx, const v1::ExtendRequest* req, v1::ExtendResponse* resp) override;
  grpc::Status Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req, v1::CommitResponse* resp) override;
  grpc::Status LookupPrefix(grpc::ServerContext* ctx, const v1::LookupPrefixRequest* req,
                            v1::LookupPrefixResponse* resp) override;
  grpc::Status Renew(grpc::ServerContext* ctx, const v1::RenewRequest* req, v1::RenewResponse* resp) override;
  grpc::Status Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req, v1::ReleaseResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req, v1::StatsResponse* resp) override;
  grpc::Status Health(grpc::ServerContext* ctx, const v1::HealthRequest* req, v1::HealthResponse* resp) override;

 private:
  absl::StatusOr<int> Tenant(grpc::ServerContext* ctx) const;
  Pool& pool_;
  const uint64_t instance_ = RandomU64();  // HandshakeResponse.instance
  UcxServer* ucx_;
  std::string fd_socket_;
};

grpc::Status ToGrpc(const absl::Status& st);
absl::Status FromGrpc(const grpc::Status& st);

}  // namespace dd::kvpool
