// The only place that decides, at compile time, whether the CUDA backend exists.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dd/backend/cpu_device.h"
#include "dd/backend/registry.h"
#include "dd/backend/sim_device.h"

#if DD_HAVE_CUDA
#include "cuda/cuda_entry.h"
#endif

namespace dd::backend {

std::vector<BackendInfo> ListBackends() {
  std::vector<BackendInfo> out;
  out.push_back({"cpu", true, true, "always available"});
#if DD_HAVE_CUDA
  BackendInfo cuda{"cuda", true, false, ""};
  cuda.usable = kernels::cuda::ProbeDevice(&cuda.detail);
  out.push_back(cuda);
#else
  out.push_back({"cuda", false, false, "not compiled (nvcc not found at build time)"});
#endif
  return out;
}

bool CudaUsable() {
#if DD_HAVE_CUDA
  std::string detail;
  return kernels::cuda::ProbeDevice(&detail);
#else
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(absl::string_view name, const DeviceOptions& options) {
  if (name == "auto") return CreateDevice(ResolveDeviceName(name), options);
  if (name == "cpu") {
    if (options.pool == nullptr) return absl::InvalidArgumentError("the cpu device needs a thread pool");
    if (options.budget_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative device memory budget ", options.budget_bytes));
    }
    return std::make_unique<CpuDevice>(options.budget_bytes, *options.pool);
  }
  if (name == "cuda") {
#if DD_HAVE_CUDA
    return kernels::cuda::CreateCudaDevice(options.budget_bytes, options.cuda_graphs,
                                          options.cuda_copy_engine_prefetch);
#else
    return absl::UnavailableError("--device cuda: this build has no CUDA backend (nvcc was not found at build time)");
#endif
  }
  if (name == "sim") {
    const char* fault_env = std::getenv("DD_SIM_FAULT");
    absl::StatusOr<SimFault> fault = ParseSimFault(fault_env != nullptr ? fault_env : "");
    if (!fault.ok()) return absl::InvalidArgumentError(absl::StrCat("$DD_SIM_FAULT: ", fault.status().message()));
    return CreateSimDevice({.budget_bytes = options.budget_bytes, .pool = options.pool, .fault = *fault});
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown device '", name, "' (known: auto, cpu, sim, cuda)"));
}

std::string ResolveDeviceName(absl::string_view name, std::string* why) {
  if (name != "auto") {
    if (why != nullptr) *why = "requested";
    return std::string(name);
  }
  // For tests of the start-up device check on machines without a GPU: the sim device stands
  // where a usable CUDA device would (the check then decides, as it does for cuda).
  if (const char* c = std::getenv("DD_AUTO_DEVICE_CANDIDATE"); c != nullptr && absl::string_view(c) == "sim") {
    if (why != nullptr) *why = "auto: sim stands for the GPU ($DD_AUTO_DEVICE_CANDIDATE, for tests)";
    return "sim";
  }
  for (const BackendInfo& b : ListBackends()) {
    if (b.name != "cuda") continue;
    if (why != nullptr) *why = absl::StrCat("auto: ", b.usable ? "CUDA device " : "cuda not usable, ", b.detail);
    return b.usable ? "cuda" : "cpu";
  }
  if (why != nullptr) *why = "auto: no cuda backend";
  return "cpu";
}

}  // namespace dd::backend
