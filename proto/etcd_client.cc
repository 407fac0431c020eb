#include "proto/etcd_client.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dd {
namespace {

absl::Status FromGrpc(const grpc::Status& st, const std::string& what) {
  if (st.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(st.error_code()), absl::StrCat("etcd ", what, ": ", st.error_message()));
}

bool Unreachable(const grpc::Status& st) {
  return st.error_code() == grpc::StatusCode::UNAVAILABLE || st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdUrl(const std::string& url) {
  constexpr absl::string_view kScheme = "etcd://";
  if (!absl::StartsWith(url, kScheme)) {
    return absl::InvalidArgumentError(absl::StrCat("'", url, "' is not etcd://HOST:PORT[,HOST:PORT...]"));
  }
  std::vector<std::string> endpoints = absl::StrSplit(url.substr(kScheme.size()), ',', absl::SkipWhitespace());
  if (endpoints.empty()) return absl::InvalidArgumentError(absl::StrCat("'", url, "' names no etcd endpoint"));
  for (const std::string& e : endpoints) {
    const size_t colon = e.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == e.size() || e.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("etcd endpoint '", e, "' is not HOST:PORT"));
    }
  }
  return endpoints;
}

std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty() && static_cast<unsigned char>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) return std::string(1, '\0');  // every key
  end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
  return end;
}

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {
  auto creds = options_.credentials ? options_.credentials : grpc::InsecureChannelCredentials();
  for (const std::string& e : options_.endpoints) members_.push_back({e, grpc::CreateChannel(e, creds)});
}

grpc::Status EtcdClient::Prepare(const Member& m, grpc::ClientContext* ctx, bool with_deadline) {
  if (with_deadline) ctx->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  if (options_.user.empty()) return grpc::Status::OK;
  std::string token;
  {
    std::lock_guard<std::mutex> lk(mu_);
    token = token_;
  }
  if (token.empty()) {
    grpc::ClientContext actx;
    actx.set_deadline(std::chrono::system_clock::now() + options_.timeout);
    etcdserverpb::AuthenticateRequest req;
    req.set_name(options_.user);
    req.set_password(options_.password);
    etcdserverpb::AuthenticateResponse resp;
    grpc::Status st = etcdserverpb::Auth::NewStub(m.channel)->Authenticate(&actx, req, &resp);
    if (!st.ok()) return st;
    token = resp.token();
    std::lock_guard<std::mutex> lk(mu_);
    token_ = token;
  }
  ctx->AddMetadata("token", token);
  return grpc::Status::OK;
}

template <typename Call>
grpc::Status EtcdClient::OnAnyMember(const Call& call) {
  size_t start;
  {
    std::lock_guard<std::mutex> lk(mu_);
    start = current_;
  }
  grpc::Status st(grpc::StatusCode::UNAVAILABLE, "no etcd endpoint");
  for (size_t i = 0; i < members_.size(); ++i) {
    const size_t at = (start + i) % members_.size();
    for (int attempt = 0; attempt < 2; ++attempt) {
      grpc::ClientContext ctx;
      st = Prepare(members_[at], &ctx);
      if (st.ok()) st = call(members_[at].channel, &ctx);
      // An expired or revoked token: authenticate again once.
      if (st.error_code() == grpc::StatusCode::UNAUTHENTICATED && !options_.user.empty() && attempt == 0 &&
          absl::StrContains(st.error_message(), "token")) {
        std::lock_guard<std::mutex> lk(mu_);
        token_.clear();
        continue;
      }
      break;
    }
    if (!Unreachable(st)) {
      std::lock_guard<std::mutex> lk(mu_);
      current_ = at;
      return st;
    }
  }
  return st;
}

absl::StatusOr<int64_t> EtcdClient::Grant(int64_t ttl_seconds) {
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse resp;
  grpc::Status st = OnAnyMember([&](const std::shared_ptr<grpc::Channel>& ch, grpc::ClientContext* ctx) {
    return etcdserverpb::Lease::NewStub(ch)->LeaseGrant(ctx, req, &resp);
  });
  if (!st.ok()) return FromGrpc(st, "lease grant");
  if (!resp.error().empty()) return absl::UnavailableError(absl::StrCat("etcd lease grant: ", resp.error()));
  return resp.id();
}

absl::Status EtcdClient::KeepAlive(int64_t lease) {
  etcdserverpb::LeaseKeepAliveResponse resp;
  bool answered = false;
  grpc::Status st = OnAnyMember([&](const std::shared_ptr<grpc::Channel>& ch, grpc::ClientContext* ctx) {
    auto stream = etcdserverpb::Lease::NewStub(ch)->LeaseKeepAlive(ctx);
    etcdserverpb::LeaseKeepAliveRequest req;
    req.set_id(lease);
    answered = stream->Write(req) && stream->Read(&resp);
    stream->WritesDone();
    ctx->TryCancel();
    const grpc::Status fin = stream->Finish();
    return answered ? grpc::Status::OK : fin;
  });
  if (!st.ok()) return FromGrpc(st, "lease keep-alive");
  if (resp.ttl() <= 0) return absl::NotFoundError("etcd lease keep-alive: the lease expired");
  return absl::OkStatus();
}

absl::Status EtcdClient::Revoke(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease);
  etcdserverpb::LeaseRevokeResponse resp;
  return FromGrpc(OnAnyMember([&](const std::shared_ptr<grpc::Channel>& ch, grpc::ClientContext* ctx) {
                    return etcdserverpb::Lease::NewStub(ch)->LeaseRevoke(ctx, req, &resp);
                  }),
                  "lease revoke");
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value, int64_t lease) {
  etcdserverpb::PutRequest req;
  req.set_key(key);
  req.set_value(value);
  req.set_lease(lease);
  etcdserverpb::PutResponse resp;
  return FromGrpc(OnAnyMember([&](const std::shared_ptr<grpc::Channel>& ch, grpc::ClientContext* ctx) {
                    return etcdserverpb::KV::NewStub(ch)->Put(ctx, req, &resp);
                  }),
                  absl::StrCat("put ", key));
}

absl::StatusOr<std::optional<EtcdClient::Held>> EtcdClient::Create(const std::string& key, const std::string& value,
                                                                     int64_t lease) {
  etcdserverpb::TxnRequest req;
  etcdserverpb::Compare* c = req.add_compare();
  c->set_result(etcdserverpb::Compare::EQUAL);
  c->set_target(etcdserverpb::Compare::CREATE);
  c->set_key(key);
  c->set_create_revision(0);  // the key does not exist
  etcdserverpb::PutRequest* put = req.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  req.add_failure()->mutable_request_range()->set_key(key);
  etcdserverpb::TxnResponse resp;
  grpc::Status st = OnAnyMember([&](const std::shared_ptr<grpc::Channel>& ch, grpc::ClientContext* ctx) {
    return etcdserverpb::KV::NewStub(ch)->Txn(ctx, req, &resp);
  });
  if (!st.ok()) return FromGrpc(st, absl::StrCat("create ", key));
  if (resp.succeeded()) return std::optional<Held>();
  Held held;
  if (resp.responses_size() > 0 && resp.responses(0).response_range().kvs_size() > 0) {
    const mvccpb::KeyValue& kv = resp.responses(0).response_range().kvs(0);
    held = {kv.value(), kv.lease()};
  }
  return std::optional<Held>(std::move(held));
}

absl::StatusOr<EtcdClient::Listing> EtcdClient::List(const std::string& prefix) {
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(PrefixEnd(prefix));
  etcdserverpb::RangeResponse resp;
  grpc::Status st = OnAnyMember([&](const std::shared_ptr<grpc::Channel>& ch, grpc::ClientContext* ctx) {
    return etcdserverpb::KV::NewStub(ch)->Range(ctx, req, &resp);
  });
  if (!st.ok()) return FromGrpc(st, absl::StrCat("list ", prefix));
  Listing out;
  out.revision = resp.header().revision();
  for (const mvccpb::KeyValue& kv : resp.kvs()) out.values[kv.key()] = {kv.value(), kv.lease()};
  return out;
}

bool EtcdClient::Watch::Created() {
  etcdserverpb::WatchResponse created;
  return stream_->Read(&created) && created.created() && !created.canceled();
}

bool EtcdClient::Watch::Next(etcdserverpb::WatchResponse* out) { return stream_->Read(out); }

EtcdClient::Watch::~Watch() {
  if (!stream_) return;
  ctx_.TryCancel();
  (void)stream_->Finish();
}

absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> EtcdClient::StartWatch(const std::string& prefix,
                                                                          int64_t start_revision) {
  size_t at;
  {
    std::lock_guard<std::mutex> lk(mu_);
    at = next_watch_++ % members_.size();
  }
  const Member& m = members_[at];
  auto w = std::make_unique<Watch>();
  // A member cut off from its leader ends the watch instead of going silent.
  w->ctx_.AddMetadata("hasleader", "true");
  if (grpc::Status st = Prepare(m, &w->ctx_, /*with_deadline=*/false); !st.ok()) {
    return absl::UnavailableError(absl::StrCat("etcd watch ", prefix, " on ", m.endpoint, ": ", st.error_message()));
  }
  w->stream_ = etcdserverpb::Watch::NewStub(m.channel)->Watch(&w->ctx_);
  etcdserverpb::WatchRequest req;
  etcdserverpb::WatchCreateRequest* c = req.mutable_create_request();
  c->set_key(prefix);
  c->set_range_end(PrefixEnd(prefix));
  c->set_start_revision(start_revision);
  c->set_progress_notify(true);
  if (!w->stream_->Write(req)) {
    return absl::UnavailableError(absl::StrCat("etcd watch ", prefix, " on ", m.endpoint, ": the stream closed"));
  }
  return w;
}

}  // namespace dd
