// The compute backends: which this build has and which the machine can run, and creating a
// device by name ("cpu", "sim", "cuda"). kernels/registry.cc holds the only #if that decides
// whether the CUDA backend exists.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/thread_pool.h"
#include "dd/backend/device.h"

namespace dd::backend {

// A backend of this build. The cpu backend is always present and usable; the CUDA backend is
// compiled when the build found nvcc, and usable only when a device answers at run time (any
// CUDA error while probing counts as no device: without a driver, cudaGetDeviceCount answers
// cudaErrorInsufficientDriver).
struct BackendInfo {
  std::string name;    // "cpu" or "cuda"
  bool compiled = false;
  bool usable = false;
  std::string detail;  // the device's name, or why it is unusable
};
std::vector<BackendInfo> ListBackends();
bool CudaUsable();

struct DeviceOptions {
  int64_t budget_bytes = 0;     // device memory budget (0 = unlimited)
  ThreadPool* pool = nullptr;   // cpu: the threads the ops run on (required; outlives the device)
  bool cuda_graphs = false;     // cuda: static segments (ops.h) launched as CUDA graphs
  bool cuda_copy_engine_prefetch = false;  // cuda: prefetch gathers by the copy engines
};

// The named device ("auto": ResolveDeviceName's choice). INVALID_ARGUMENT for an unknown name (the message lists the known ones);
// UNAVAILABLE for a backend this build or machine cannot run, saying why (not compiled, no
// device, driver).
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(absl::string_view name, const DeviceOptions& options);

// The device "auto" stands for: "cuda" where a CUDA device is usable, else "cpu" ("sim" when
// $DD_AUTO_DEVICE_CANDIDATE=sim, for tests). A device other than cpu is only a candidate: the
// binaries that serve take it only once the start-up device check passes
// (decode-worker/engine/device_check.h). Any other
// name is returned as it is. *why (optional) says how the name was chosen, for the start-up
// line: "requested", or "auto: <the CUDA probe's answer>".
std::string ResolveDeviceName(absl::string_view name, std::string* why = nullptr);

}  // namespace dd::backend
