// The only place that decides, at compile time, whether the CUDA backend exists.
#include "absl/strings/str_cat.h"
#include "dd/kernels/backend.h"

#if DD_HAVE_CUDA
#include "cuda/cuda_entry.h"
#endif

namespace dd::kernels {

std::vector<BackendInfo> ListBackends() {
  std::vector<BackendInfo> out;
  out.push_back({"cpu", true, true, "always available"});
#if DD_HAVE_CUDA
  BackendInfo cuda{"cuda", true, false, ""};
  cuda.usable = cuda::ProbeDevice(&cuda.detail);
  out.push_back(cuda);
#else
  out.push_back({"cuda", false, false, "not compiled (nvcc not found at build time)"});
#endif
  return out;
}

bool CudaUsable() {
#if DD_HAVE_CUDA
  std::string detail;
  return cuda::ProbeDevice(&detail);
#else
  return false;
#endif
}

absl::Status CudaDequantizeRows(DType t, const void* src, int64_t rows, int64_t cols, float* dst) {
#if DD_HAVE_CUDA
  if (!CudaUsable()) return absl::UnavailableError("no usable CUDA device");
  return cuda::DequantizeRows(t, src, rows, cols, dst);
#else
  return absl::UnavailableError("built without CUDA");
#endif
}

}  // namespace dd::kernels
