// The `sim` backend: a simulated device that runs the engine's asynchronous logic on any
// machine and checks every ordering the engine relies on.
//
//  - Device memory is host memory the host cannot touch: each buffer is its own mapping,
//    inaccessible (PROT_NONE) except to the queue work that declared it, so a host read or
//    write of device memory faults at once. A freed buffer is unmapped.
//  - Each queue is a thread that runs its work in order, each item after a random delay
//    (jitter), and after the events it was told to wait for.
//  - The hazard checker works on the program order, not on timing, so a missing wait fails on
//    every run: every piece of work declares the device ranges it reads and writes, and when it
//    is submitted to queue Q, each range it reads must have been written by Q itself or by work
//    Q has waited for (an event at or after it), and each range it writes must have no earlier
//    reader or writer on another queue that Q has not waited for. A violation aborts, naming
//    both pieces of work. Freeing a buffer whose last use the host has not synchronized with
//    aborts the same way.
//
// Ops run the cpu backend's kernels on the compute queue's thread. Not thread-safe: one thread
// submits (like the engine's compute thread).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/thread_pool.h"
#include "dd/backend/device.h"

namespace dd::backend {

// A deliberately wrong op, for tests only: it proves that the start-up device check
// (decode-worker/engine/device_check.h) refuses a device whose kernels are wrong.
//   kDecodeAttentionOffByOne: every decode row attends over all its keys but the newest (its
//   own), as a kernel with an off-by-one loop bound would; prefill is untouched.
// Set by $DD_SIM_FAULT (decode_attention_off_by_one) where the device is created by name.
enum class SimFault { kNone, kDecodeAttentionOffByOne };
absl::StatusOr<SimFault> ParseSimFault(absl::string_view name);  // "" → kNone

struct SimOptions {
  int64_t budget_bytes = 0;    // 0 = unlimited
  ThreadPool* pool = nullptr;  // the threads the ops' kernels split over (required)
  uint64_t seed = 1;           // jitter
  int64_t max_jitter_us = 100;
  SimFault fault = SimFault::kNone;
};

// A sim device; INVALID_ARGUMENT without a pool or with a negative budget or jitter.
absl::StatusOr<std::unique_ptr<Device>> CreateSimDevice(const SimOptions& options);

}  // namespace dd::backend
