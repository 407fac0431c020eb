// KvStore backed by a dd-kv-pool process (docs/architecture.md, "KV store and pool"): control calls
// (open, extend, renew, release) go over gRPC with the tenant's bearer token; data never does.
// `shm://` (same host) maps the tenant's shared-memory region and copies blocks directly; `ucx://`
// sends UCX active messages that the pool's progress thread answers from the tenant's region (tcp,
// shared memory or RDMA, whatever UCX picks; UCX_TLS narrows it), or one-sided gets and puts when
// the pool offers them (--ucx_rma; UcxPath). Background gathers run on a TransferQueue's lanes, off
// the caller's thread unless transfer_lanes is 0; urgent ones on the caller's (it waits for them).
// A thread renews the leases at a third of the TTL; when the pool stops answering, the store turns
// broken and every later call fails with UNAVAILABLE naming the pool (transfers already queued
// complete from the mapping, which stays valid).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kv-pool/client/kv_store.h"

namespace dd::kvpool {

enum class PoolTransport { kShm, kUcx };
// ucx://: active messages (the pool bounds each request by the tenant's region), one-sided
// RMA (only offered by a pool run with --ucx_rma), or RMA when offered else active messages.
enum class UcxPath { kAuto, kActiveMessages, kRma };

struct PoolClientOptions {
  std::string address;          // host:port of the pool's gRPC endpoint
  std::string token;            // the tenant's bearer token
  PoolTransport transport = PoolTransport::kShm;
  UcxPath ucx_path = UcxPath::kAuto;  // ucx:// only
  LinkModel link{};
  // Threads that run background gathers (TransferQueue lanes, 0..16). 1 or more: prefetches
  // never run on the caller's thread, so they overlap compute, and more lanes keep more in
  // flight; urgent gathers run on the caller's (it waits for them at once). 0: every gather
  // runs inside GatherTo on the caller's thread (no overlap, no hand-off).
  int transfer_lanes = 1;
  int64_t rpc_timeout_ms = 5000;
  int64_t first_extent_chunks = 256;  // chunks reserved at Open; extents double after that
  std::string tls_ca_pem{};     // non-empty: gRPC over TLS, trusting this CA (PEM text)
  // With TLS: the name the pool's certificate must carry, when the address is not it (a pool
  // found in a registry is dialled at its pod IP). Empty: the address's host.
  std::string tls_server_name{};
  PoolLocate locate{};          // set: Recover dials the address it gives (same scheme)
};

absl::StatusOr<std::unique_ptr<KvStore>> ConnectPoolKvStore(const PoolClientOptions& options);

// "inproc://" (or empty) → the in-process store; "shm://HOST:PORT" → a pool on this host;
// "ucx://HOST:PORT" → a pool reached over UCX (HOST:PORT is its gRPC endpoint); several
// pool URIs separated by commas → layers striped over them (NewShardedKvStore).
// The token comes from `token` (callers read it from the environment or a file, never the URI).
// When $DD_KV_POOL_CA names a PEM file, control calls use TLS trusting that CA (and
// $DD_KV_POOL_TLS_NAME, when set, is the name the pool's certificate must carry). $DD_UCX_PATH
// (am, rma, auto; default auto) picks the ucx:// data path; $DD_KV_TRANSFER_LANES (0-16,
// default 1) sets PoolClientOptions::transfer_lanes. `locate` (one pool only): see PoolLocate.
// Whether host:port names this machine (loopback or its hostname).
bool NamesThisHost(const std::string& address);

// `inproc_prefix_cache_bytes`, `inproc_owner_bytes`: the in-process store's prefix cache and
// one tenant's share of it (NewInProcessKvStore); a pool's is bounded by its tenant's quota.
absl::StatusOr<std::unique_ptr<KvStore>> OpenKvStore(const std::string& uri, const std::string& token,
                                                     const LinkModel& link, int64_t inproc_prefix_cache_bytes = 0,
                                                     int64_t inproc_owner_bytes = 0, PoolLocate locate = {});

}  // namespace dd::kvpool
