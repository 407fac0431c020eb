// A worker record as a router reads it from etcd (router/registry.h ParseWorkerRecord), and the
// same bytes as a KV pool's record as workers read it (proto/pool_record.h ParsePoolRecord): any
// process that can write to the registry's prefix can put any bytes there. The first input byte
// picks whether the router has a cluster secret (bit 0) and whether the key has a lease (bit 1);
// the rest is the value. What the router accepts
// must be signed with its secret (when it has one), name the worker of its key, and pass the
// registry's field bounds.
#include <cmath>

#include "absl/strings/match.h"
#include "fuzz/fuzz_util.h"
#include "proto/pool_record.h"
#include "router/registry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string secret = data[0] & 1 ? "fuzz-cluster-secret-0123456789abcdef" : "";
  const int64_t lease = data[0] & 2 ? 7 : 0;
  const double now = 1.8e9;
  const std::string value(reinterpret_cast<const char*>(data) + 1, size - 1);
  dd::worker::v1::RegisterRequest r;
  const absl::Status st = dd::router::ParseWorkerRecord(secret, "/dualdecoder/workers/w1", {value, lease}, now, &r);
  if (st.ok()) {
    dd::fuzz::Require(r.worker_id() == "w1", "the record names the worker of its key");
    dd::fuzz::Require(dd::router::WorkerRegistry::Check(r).ok(), "the record's fields are within bounds");
    dd::fuzz::Require(lease != 0, "the record is held under a lease");
    dd::fuzz::Require(secret.empty() || absl::StartsWith(value, "hmac-sha256:"), "a keyed router takes signed records only");
    dd::fuzz::Require(secret.empty() || std::abs(now - r.published_unix_seconds()) <= dd::router::kMaxRecordAgeSeconds,
                      "a keyed router takes fresh records only");
    dd::fuzz::Require(value.size() <= dd::router::kMaxWorkerRecordBytes, "the record's size is bounded");
  }
  absl::StatusOr<dd::PoolRecord> pool = dd::ParsePoolRecord(secret, "/dualdecoder/pools/p1", {value, lease}, now);
  if (pool.ok()) {
    dd::fuzz::Require(pool->pool_id == "p1", "the pool record names the pool of its key");
    dd::fuzz::Require(!pool->address.empty() && !pool->node.empty() && pool->address.size() <= 256 &&
                          pool->node.size() <= 256 && pool->capacity_bytes >= 0,
                      "the pool record's fields are within bounds");
    dd::fuzz::Require(lease != 0, "the pool record is held under a lease");
    dd::fuzz::Require(secret.empty() || absl::StartsWith(value, "hmac-sha256:"), "a keyed worker takes signed pools only");
    dd::fuzz::Require(value.size() <= dd::kMaxPoolRecordBytes, "the pool record's size is bounded");
  }
  return 0;
}
