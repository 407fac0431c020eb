#include "proto/etcd_membership.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "openssl/evp.h"
#include "openssl/hmac.h"
#include "common/secrets.h"

ABSL_FLAG(std::string, registry, "memory",
          "Where workers, pools and router replicas find each other: 'memory' (workers register with one router, "
          "--router) or etcd://HOST:PORT[,HOST:PORT...] (every member registers in etcd under a lease; any number "
          "of routers follow it)");
ABSL_FLAG(std::string, registry_prefix, "/dualdecoder/",
          "etcd registry: the key prefix of this cluster (several clusters may share one etcd)");
ABSL_FLAG(std::string, etcd_user, "", "etcd registry: the etcd user (with --etcd_password_file; empty = auth off)");
ABSL_FLAG(std::string, etcd_password_file, "", "etcd registry: file holding the etcd user's password (mode 0600)");
ABSL_FLAG(std::string, etcd_ca_file, "",
          "etcd registry: PEM CA that signed the etcd members' certificates; set, every etcd call is TLS");
ABSL_FLAG(std::string, etcd_cert_file, "", "etcd registry: PEM client certificate for etcd (--client-cert-auth)");
ABSL_FLAG(std::string, etcd_key_file, "", "etcd registry: PEM key of --etcd_cert_file (mode 0600)");

namespace dd {

absl::StatusOr<RegistryConfig> RegistryFromFlags() {
  RegistryConfig c;
  c.url = absl::GetFlag(FLAGS_registry);
  c.prefix = absl::GetFlag(FLAGS_registry_prefix);
  if (c.url == "memory") return c;
  absl::StatusOr<std::vector<std::string>> endpoints = ParseEtcdUrl(c.url);
  if (!endpoints.ok()) return absl::InvalidArgumentError(absl::StrCat("--registry: ", endpoints.status().message()));
  if (c.prefix.empty() || c.prefix.front() != '/' || c.prefix.back() != '/') {
    return absl::InvalidArgumentError("--registry_prefix must start and end with '/'");
  }
  EtcdOptions o;
  o.endpoints = *std::move(endpoints);
  o.user = absl::GetFlag(FLAGS_etcd_user);
  const std::string password_file = absl::GetFlag(FLAGS_etcd_password_file);
  if (o.user.empty() != password_file.empty()) {
    return absl::InvalidArgumentError("--etcd_user and --etcd_password_file go together");
  }
  if (!password_file.empty()) {
    // One line, in a file only its owner may read (etcd's own rules decide its strength).
    if (absl::Status st = CheckPrivateFile(password_file, "--etcd_password_file", 4096); !st.ok()) return st;
    std::ifstream f(password_file);
    if (!f || !std::getline(f, o.password) || o.password.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--etcd_password_file ", password_file, " holds no password"));
    }
  }
  const std::string ca = absl::GetFlag(FLAGS_etcd_ca_file), cert = absl::GetFlag(FLAGS_etcd_cert_file),
                    key = absl::GetFlag(FLAGS_etcd_key_file);
  if (cert.empty() != key.empty()) return absl::InvalidArgumentError("--etcd_cert_file and --etcd_key_file go together");
  if (!cert.empty() && ca.empty()) return absl::InvalidArgumentError("--etcd_cert_file needs --etcd_ca_file (TLS)");
  if (!ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    for (auto [path, what, out, is_private] :
         {std::tuple{ca, "--etcd_ca_file", &ssl.pem_root_certs, false}, {cert, "--etcd_cert_file", &ssl.pem_cert_chain, false},
          {key, "--etcd_key_file", &ssl.pem_private_key, true}}) {
      if (path.empty()) continue;
      if (is_private) {
        if (absl::Status st = CheckPrivateFile(path, what, 1 << 20); !st.ok()) return st;
      }
      std::ifstream f(path);
      std::stringstream text;
      text << f.rdbuf();
      if (!f || text.str().find("-----BEGIN") == std::string::npos || text.str().size() > (1 << 20)) {
        return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " is not a readable PEM file"));
      }
      *out = text.str();
    }
    o.credentials = grpc::SslCredentials(ssl);
  }
  c.backend = std::make_shared<EtcdRegistry>(std::make_shared<EtcdClient>(std::move(o)));
  return c;
}

namespace {

constexpr absl::string_view kSignature = "hmac-sha256:";

std::string Hmac(const std::string& secret, absl::string_view record) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const unsigned char*>(record.data()),
       record.size(), mac, &n);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(mac), n));
}

}  // namespace

std::string SignRecord(const std::string& secret, const std::string& key, const std::string& record) {
  if (secret.empty()) return record;
  return absl::StrCat(kSignature, Hmac(secret, absl::StrCat(key, "\n", record)), " ", record);
}

absl::StatusOr<std::string> VerifyRecord(const std::string& secret, const std::string& key, const std::string& value) {
  const bool is_signed = absl::StartsWith(value, kSignature);
  const size_t space = is_signed ? value.find(' ') : std::string::npos;
  if (is_signed && space == std::string::npos) return absl::PermissionDeniedError("a malformed signature");
  const absl::string_view record = is_signed ? absl::string_view(value).substr(space + 1) : value;
  if (secret.empty()) return std::string(record);
  if (!is_signed) return absl::PermissionDeniedError("an unsigned record (this cluster has a secret)");
  const absl::string_view mac = absl::string_view(value).substr(kSignature.size(), space - kSignature.size());
  if (!SecretEquals(Hmac(secret, absl::StrCat(key, "\n", record)), mac)) {
    return absl::PermissionDeniedError("a record not signed with this cluster's secret for this key");
  }
  return std::string(record);
}

std::string RecordAge(double age_seconds) {
  if (!std::isfinite(age_seconds) || std::abs(age_seconds) > 1e15) return "at no valid time";
  const int64_t s = static_cast<int64_t>(std::llround(age_seconds));
  return s >= 0 ? absl::StrCat(s, " s ago") : absl::StrCat(-s, " s ahead of this clock");
}

EtcdMembership::EtcdMembership(std::shared_ptr<EtcdClient> client, std::string key, std::function<std::string()> value,
                               std::function<bool(const std::string&)> may_take, std::chrono::milliseconds interval,
                               int64_t ttl_seconds)
    : client_(std::move(client)),
      key_(std::move(key)),
      value_(std::move(value)),
      may_take_(std::move(may_take)),
      interval_(interval),
      ttl_seconds_(std::max<int64_t>(ttl_seconds, 2)) {
  thread_ = std::thread([this] { Loop(); });
}

EtcdMembership::~EtcdMembership() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (lease_ != 0) (void)client_->Revoke(lease_);
}

void EtcdMembership::Loop() {
  std::string warned;  // the last problem logged, so a long outage logs once
  auto warn = [&](const absl::Status& st, const std::string& what) {
    const std::string msg = absl::StrCat(what, ": ", st.message());
    if (msg != warned) LOG(WARNING) << "registry " << key_ << ": " << msg << "; retrying every " << interval_.count() << " ms";
    warned = msg;
  };
  for (;;) {
    if (!registered_) {
      if (lease_ == 0) {
        absl::StatusOr<int64_t> lease = client_->Grant(ttl_seconds_);
        if (lease.ok()) lease_ = *lease;
        else warn(lease.status(), "cannot get a lease");
      }
      if (lease_ != 0) {
        const std::string value = value_();
        absl::StatusOr<std::optional<EtcdClient::Held>> held = client_->Create(key_, value, lease_);
        if (!held.ok()) {
          if (absl::IsNotFound(held.status())) lease_ = 0;  // the lease expired meanwhile: a new one
          warn(held.status(), "cannot register");
        } else if (!held->has_value() || (*held)->lease == lease_ || may_take_((*held)->value)) {
          // Ours already (a keep-alive failed but the lease held), or an earlier run of this member.
          if (held->has_value()) (void)client_->Put(key_, value, lease_);
          registered_ = true;
          LOG(INFO) << "registered in etcd as " << key_;
          warned.clear();
        } else {
          warn(absl::AlreadyExistsError("another member holds this key and is alive"), "cannot register");
        }
      }
    } else if (absl::Status st = client_->KeepAlive(lease_); !st.ok()) {
      if (absl::IsNotFound(st)) lease_ = 0;  // expired while etcd was out of reach: start again
      registered_ = false;
      warn(st, "lost the registration");
      continue;
    } else if (absl::Status put = client_->Put(key_, value_(), lease_); !put.ok()) {
      warn(put, "cannot update the record");
    }
    std::unique_lock<std::mutex> lk(mu_);
    if (cv_.wait_for(lk, interval_, [&] { return stop_; })) return;
  }
}

EtcdFollower::EtcdFollower(std::shared_ptr<EtcdClient> client, std::string prefix, Handler handler)
    : client_(std::move(client)), prefix_(std::move(prefix)), handler_(std::move(handler)) {
  thread_ = std::thread([this] { Loop(); });
}

EtcdFollower::~EtcdFollower() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    if (watch_ != nullptr) watch_->Cancel();
  }
  cv_.notify_all();
  thread_.join();
}

void EtcdFollower::Loop() {
  bool first = true;
  std::string warned;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stop_) return;
    }
    absl::StatusOr<EtcdClient::Listing> listing = client_->List(prefix_);
    absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> watch =
        listing.ok() ? client_->StartWatch(prefix_, listing->revision + 1) : listing.status();
    if (watch.ok()) {
      {
        std::lock_guard<std::mutex> lk(mu_);  // published first: a stop cancels even a hung start
        if (stop_) return;
        watch_ = watch->get();
      }
      if (!(*watch)->Created()) watch = absl::UnavailableError(absl::StrCat("etcd watch of ", prefix_, " refused"));
    }
    if (!watch.ok()) {
      if (watch.status().ToString() != warned) {
        LOG(WARNING) << "registry: cannot follow " << prefix_ << " in etcd (" << watch.status().message()
                     << "); keeping the last view and retrying";
      }
      warned = watch.status().ToString();
      std::unique_lock<std::mutex> lk(mu_);
      watch_ = nullptr;
      if (cv_.wait_for(lk, std::chrono::milliseconds(500), [&] { return stop_; })) return;
      continue;
    }
    warned.clear();
    if (!first) resyncs_++;
    first = false;
    handler_.reset(listing->values);
    etcdserverpb::WatchResponse resp;
    while ((*watch)->Next(&resp)) {
      if (resp.canceled() || resp.compact_revision() != 0) break;  // compacted or refused: list again
      for (const mvccpb::Event& e : resp.events()) {
        if (e.type() == mvccpb::Event::DELETE) handler_.erase(e.kv().key());
        else handler_.put(e.kv().key(), {e.kv().value(), e.kv().lease()});
      }
    }
    std::lock_guard<std::mutex> lk(mu_);
    watch_ = nullptr;
  }
}

}  // namespace dd
