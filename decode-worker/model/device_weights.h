// A model's weights on a compute device: every matrix and vector of ModelWeights uploaded
// (Device::Upload, tag kWeights), as views and pointers the ops take. On the cpu device the
// upload uses the loaded model's memory in place; elsewhere it is a copy. The bytes uploaded
// are what MemoryPlan counts as weights (a tied output matrix once).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "dd/backend/device.h"
#include "decode-worker/model/weights.h"

namespace dd::model {

struct DeviceLayerWeights {
  kernels::WeightView wq, wk, wv, wo, w_gate, w_up, w_down;
  // nullptr where the model has no such vector.
  const float *attn_norm = nullptr, *ffn_norm = nullptr;
  const float *post_attn_norm = nullptr, *post_ffn_norm = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

class DeviceWeights {
 public:
  // `model` and `device` must outlive the result.
  static absl::StatusOr<std::unique_ptr<DeviceWeights>> Upload(const LoadedModel& model, backend::Device& device);
  ~DeviceWeights();  // frees the buffers
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  kernels::WeightView token_embd, output;
  const float* output_norm = nullptr;
  std::vector<DeviceLayerWeights> layers;
  int64_t bytes() const { return bytes_; }

 private:
  explicit DeviceWeights(backend::Device& device) : device_(device) {}
  absl::Status Add(const kernels::WeightView& host, kernels::WeightView* out);
  absl::Status Add(const std::vector<float>& host, const float** out);

  backend::Device& device_;
  std::vector<backend::DeviceBuffer> buffers_;
  int64_t bytes_ = 0;
};

}  // namespace dd::model
