// Hands a tenant's region descriptor to a same-host worker (the shm:// data path), over a
// Unix-domain socket, after checking the tenant's token
// (docs/decisions/0017-pool-regions-memfd.md). Regions are anonymous memory files (region.h): there
// is no name in /dev/shm to list or open, and nothing outlives the pool but the mappings of workers
// that hold them.
//
// Protocol (one exchange per connection): the client sends its bearer token and '\n' (at most
// 512 bytes, all within 2 s of connecting); the server answers one byte carrying the descriptor
// (SCM_RIGHTS), or closes the connection when the token is unknown or the peer's uid
// (SO_PEERCRED) is not allowed. Clients are served concurrently by one poll loop, each with its
// own total deadline, so idle or dripping connections (up to kMaxClients at once; more are
// closed at accept) cannot delay the others.
//
// The socket is abstract (`@dd-kvpool-<pid>-<random>`, no file; per network namespace) unless
// a filesystem path is given (containers that share a host path but not a network namespace).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd::kvpool {

class FdServer {
 public:
  // The region descriptor for a token, or -1 when the token is unknown.
  using Lookup = std::function<int(absl::string_view token)>;
  static constexpr int kMaxClients = 1024;
  // `path` empty: an abstract socket with a fresh name. Peers whose uid is not the pool's own
  // or in `allowed_uids` get nothing.
  static absl::StatusOr<std::unique_ptr<FdServer>> Start(const std::string& path, Lookup lookup,
                                                         std::vector<uint32_t> allowed_uids = {});
  ~FdServer();
  // "@name" for an abstract socket, else the path: what clients pass to ReceiveRegionFd.
  const std::string& address() const { return address_; }

 private:
  FdServer() = default;
  void Serve();
  std::string address_, path_;
  int listen_fd_ = -1, wake_fd_ = -1;
  Lookup lookup_;
  std::vector<uint32_t> allowed_uids_;
  std::thread thread_;
};

// Client side: connects to `address`, shows `token`, returns the received descriptor.
// PERMISSION_DENIED when the pool refused (unknown token or uid), DEADLINE_EXCEEDED when it did
// not answer within 5 s.
absl::StatusOr<int> ReceiveRegionFd(const std::string& address, const std::string& token);

}  // namespace dd::kvpool
