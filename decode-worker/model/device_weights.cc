#include "decode-worker/model/device_weights.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dd::model {

absl::Status DeviceWeights::Add(const kernels::WeightView& host, kernels::WeightView* out) {
  *out = host;
  if (host.data == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(backend::DeviceBuffer buf,
                   device_.Upload(backend::MemoryTag::kWeights, host.data, host.rows * host.row_bytes));
  buffers_.push_back(buf);
  bytes_ += buf.bytes;
  out->data = static_cast<const uint8_t*>(buf.data);
  return absl::OkStatus();
}

absl::Status DeviceWeights::Add(const std::vector<float>& host, const float** out) {
  *out = nullptr;
  if (host.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(backend::DeviceBuffer buf,
                   device_.Upload(backend::MemoryTag::kWeights, host.data(),
                                  static_cast<int64_t>(host.size() * sizeof(float))));
  buffers_.push_back(buf);
  bytes_ += buf.bytes;
  *out = static_cast<const float*>(buf.data);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceWeights>> DeviceWeights::Upload(const LoadedModel& model,
                                                                     backend::Device& device) {
  std::unique_ptr<DeviceWeights> d(new DeviceWeights(device));
  const ModelWeights& w = model.weights;
  RETURN_IF_ERROR(d->Add(w.token_embd, &d->token_embd));
  if (w.output.data == w.token_embd.data) {
    d->output = d->token_embd;  // tied
  } else {
    RETURN_IF_ERROR(d->Add(w.output, &d->output));
  }
  RETURN_IF_ERROR(d->Add(w.output_norm, &d->output_norm));
  d->layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& h = w.layers[l];
    DeviceLayerWeights& L = d->layers[l];
    for (auto [from, to] : {std::pair{&h.wq, &L.wq}, {&h.wk, &L.wk}, {&h.wv, &L.wv}, {&h.wo, &L.wo},
                            {&h.w_gate, &L.w_gate}, {&h.w_up, &L.w_up}, {&h.w_down, &L.w_down}}) {
      RETURN_IF_ERROR(d->Add(*from, to));
    }
    for (auto [from, to] : {std::pair{&h.attn_norm, &L.attn_norm}, {&h.ffn_norm, &L.ffn_norm},
                            {&h.post_attn_norm, &L.post_attn_norm}, {&h.post_ffn_norm, &L.post_ffn_norm},
                            {&h.q_norm, &L.q_norm}, {&h.k_norm, &L.k_norm}, {&h.bq, &L.bq}, {&h.bk, &L.bk},
                            {&h.bv, &L.bv}}) {
      RETURN_IF_ERROR(d->Add(*from, to));
    }
  }
  return d;
}

DeviceWeights::~DeviceWeights() {
  for (backend::DeviceBuffer& b : buffers_) device_.Free(b);
}

}  // namespace dd::model
