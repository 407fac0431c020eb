// The pool's UCX side (DESIGN §7, §12): one UCP context and worker, each tenant region
// registered separately (its own remote key), and a thread that progresses the worker. Over
// shared-memory transports a worker's gets are one-sided; over tcp UCX emulates RMA in
// software and gets complete only as fast as this thread progresses, so it sleeps on the
// worker's event fd rather than spinning.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace dd::kvpool {

class UcxServer {
 public:
  static absl::StatusOr<std::unique_ptr<UcxServer>> Create();
  ~UcxServer();
  // Registers [base, base + bytes) for remote access; returns the packed remote key.
  absl::StatusOr<std::string> Register(void* base, size_t bytes);
  // Starts the progress thread; call after every Register.
  void Start();
  const std::string& worker_address() const { return address_; }

 private:
  UcxServer() = default;
  void Progress();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace dd::kvpool
