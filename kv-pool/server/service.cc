#include "kv-pool/server/service.h"

#include <string>

#include "kv-pool/client/ucx_config.h"

namespace dd::kvpool {
namespace {

void ToProto(const Extent& e, v1::Extent* out) {
  out->set_first_chunk(e.first_chunk);
  out->set_chunks(e.chunks);
  out->set_offset(e.offset);
}

#define DD_TENANT(var, ctx)                       \
  auto var##_or = Tenant(ctx);                    \
  if (!var##_or.ok()) return ToGrpc(var##_or.status()); \
  const int var = *var##_or

}  // namespace

grpc::Status ToGrpc(const absl::Status& st) {
  return st.ok() ? grpc::Status::OK
                 : grpc::Status(static_cast<grpc::StatusCode>(st.code()), std::string(st.message()));
}

absl::Status FromGrpc(const grpc::Status& st) {
  return st.ok() ? absl::OkStatus() : absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
}

absl::StatusOr<int> KvPoolService::Tenant(grpc::ServerContext* ctx) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  return pool_.Authenticate(absl::string_view(it->second.data(), it->second.size()));
}

grpc::Status KvPoolService::Handshake(grpc::ServerContext* ctx, const v1::HandshakeRequest* req,
                                      v1::HandshakeResponse* resp) {
  DD_TENANT(t, ctx);
  resp->set_tenant(pool_.tenant_name(t));
  resp->set_shm_name(pool_.shm_name(t));
  resp->set_fd_socket(fd_socket_);
  resp->set_region_bytes(pool_.region_bytes(t));
  resp->set_lease_ttl_ms(pool_.lease_ttl().count());
  resp->set_instance(instance_);
  if (ucx_ == nullptr) return grpc::Status::OK;
  resp->set_ucx_shm_settings(ucx_->shm_settings());
  resp->set_ucx_tcp_settings(ucx_->tcp_settings());
  // A worker that could reach this pool over UCX's shared memory or tcp with other settings (or
  // an older one that reports none) would crash it, or itself, inside UCX: it gets no address
  // to reach it by.
  if (!UcxSharedMemoryCompatible(req->ucx_shm_settings(), ucx_->shm_settings()) ||
      !UcxTcpCompatible(req->ucx_tcp_settings(), ucx_->tcp_settings())) {
    return grpc::Status::OK;
  }
  if (!ucx_->rkey(t).empty()) {  // only one-sided access needs the address
    resp->set_remote_base(reinterpret_cast<uint64_t>(pool_.region_data(t)));
  }
  resp->set_ucx_worker_address(ucx_->worker_address());
  resp->set_ucx_session(ucx_->NewSession(t));
  resp->set_ucx_rkey(ucx_->rkey(t));  // empty unless the pool runs with --ucx_rma
  return grpc::Status::OK;
}

grpc::Status KvPoolService::Open(grpc::ServerContext* ctx, const v1::OpenRequest* req, v1::OpenResponse* resp) {
  DD_TENANT(t, ctx);
  auto dtype = KvDtypeFromWire(req->layout().dtype());
  if (!dtype.ok()) return ToGrpc(dtype.status());
  const KvLayout layout{req->layout().n_layers(), req->layout().n_kv_heads(), req->layout().head_dim(),
                        req->layout().chunk_tokens(), *dtype};
  auto r = pool_.Open(t, layout, req->chunks(), Pool::Clock::now());
  if (!r.ok()) return ToGrpc(r.status());
  resp->set_sequence(r->first);
  resp->set_instance(instance_);
  ToProto(r->second, resp->mutable_extent());
  return grpc::Status::OK;
}

grpc::Status KvPoolService::Extend(grpc::ServerContext* ctx, const v1::ExtendRequest* req, v1::ExtendResponse* resp) {
  DD_TENANT(t, ctx);
  auto e = pool_.Extend(t, req->sequence(), req->chunks());
  if (!e.ok()) return ToGrpc(e.status());
  ToProto(*e, resp->mutable_extent());
  resp->set_instance(instance_);
  return grpc::Status::OK;
}

grpc::Status KvPoolService::Commit(grpc::ServerContext* ctx, const v1::CommitRequest* req, v1::CommitResponse*) {
  DD_TENANT(t, ctx);
  return ToGrpc(pool_.Commit(t, req->sequence(), {req->block_keys().data(), static_cast<size_t>(req->block_keys_size())}));
}

grpc::Status KvPoolService::LookupPrefix(grpc::ServerContext* ctx, const v1::LookupPrefixRequest* req,
                                         v1::LookupPrefixResponse* resp) {
  DD_TENANT(t, ctx);
  const Pool::Prefix p = pool_.Lookup(t, {req->block_keys().data(), static_cast<size_t>(req->block_keys_size())},
                                      req->lease(), Pool::Clock::now());
  resp->set_blocks(p.blocks);
  resp->set_sequence(p.seq);
  resp->set_instance(instance_);
  for (const Extent& e : p.extents) ToProto(e, resp->add_extents());
  resp->mutable_layout()->set_n_layers(p.layout.n_layers);
  resp->mutable_layout()->set_n_kv_heads(p.layout.n_kv_heads);
  resp->mutable_layout()->set_head_dim(p.layout.head_dim);
  resp->mutable_layout()->set_chunk_tokens(p.layout.chunk_tokens);
  resp->mutable_layout()->set_dtype(static_cast<int64_t>(p.layout.dtype));
  return grpc::Status::OK;
}

grpc::Status KvPoolService::Renew(grpc::ServerContext* ctx, const v1::RenewRequest* req, v1::RenewResponse* resp) {
  DD_TENANT(t, ctx);
  resp->set_lease_ttl_ms(pool_.lease_ttl().count());
  return ToGrpc(pool_.Renew(t, {req->sequences().data(), static_cast<size_t>(req->sequences_size())}, Pool::Clock::now()));
}

grpc::Status KvPoolService::Release(grpc::ServerContext* ctx, const v1::ReleaseRequest* req, v1::ReleaseResponse*) {
  DD_TENANT(t, ctx);
  return ToGrpc(pool_.Release(t, req->sequence()));
}

grpc::Status KvPoolService::Stats(grpc::ServerContext* ctx, const v1::StatsRequest*, v1::StatsResponse* resp) {
  DD_TENANT(t, ctx);
  const PoolStats s = pool_.Stats(t);
  resp->set_region_bytes(s.region_bytes);
  resp->set_used_bytes(s.used_bytes);
  resp->set_leased_bytes(s.leased_bytes);
  resp->set_sequences(s.sequences);
  resp->set_evictions(s.evictions);
  resp->set_expired_leases(s.expired_leases);
  resp->set_prefix_hits(s.prefix_hits);
  return grpc::Status::OK;
}

grpc::Status KvPoolService::Health(grpc::ServerContext*, const v1::HealthRequest*, v1::HealthResponse* resp) {
  resp->set_serving(true);  // liveness needs no token
  return grpc::Status::OK;
}

}  // namespace dd::kvpool
