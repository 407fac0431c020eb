// The decoder forward pass for llama / qwen2 / gemma3, on any compute backend: every
// operation goes through backend::Ops (dd/backend/ops.h) and every byte it computes on lives
// in device memory — the weights (DeviceWeights) and one workspace buffer for the
// activations — so nothing here calls a kernel or touches device memory from the host.
//
// Forward() runs a batch of token rows from any number of sequences (prefill chunks and
// decode rows mixed) through all layers. Attention is delegated to an AttentionBackend, so
// the KV strategy (dense, sparse, dual-token) is the caller's choice. Every kernel is
// batch-invariant: a row's logits are bit-identical whatever else shares its batch.
// Not thread-safe: one Forward at a time (the workspace is shared).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "dd/backend/device.h"
#include "dd/backend/ops.h"
#include "decode-worker/model/attention.h"
#include "decode-worker/model/device_weights.h"
#include "decode-worker/model/weights.h"

namespace dd::model {

class Transformer {
 public:
  // How weight matrices multiply activations (backend::LinearKind):
  //   kInt8: activations quantized to int8 blocks of 32, integer dot products (the fast path,
  //          like llama.cpp; logits differ from kF32 by activation rounding, ~0.5% relative);
  //   kF32:  weights dequantized to f32, f32 dot products (exact w.r.t. the file's weights;
  //          what the reference tests compare at tight tolerance).
  // Both are batch-invariant.
  using MatMulKind = backend::LinearKind;

  // Rows of logits computed per LM-head call: the workspace holds this many rows of n_vocab
  // floats whatever the batch (a pass wanting more logits runs the head in pieces, with the
  // same bits: the ops are row-independent).
  static constexpr int64_t kLogitRows = 64;

  // Uploads the weights to `device` and allocates the workspace for `rows` rows per pass (a
  // larger pass grows it first). `model` and `device` must outlive the Transformer.
  static absl::StatusOr<std::unique_ptr<Transformer>> Create(const LoadedModel& model, backend::Device& device,
                                                             MatMulKind kind = MatMulKind::kInt8, int64_t rows = 512);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  // Workspace bytes for passes of up to `rows` rows (what Create allocates for `rows`).
  static int64_t WorkspaceBytes(const ModelConfig& config, int64_t rows);
  // What one more row of a pass adds to the workspace, at most: its activations (the logits'
  // kLogitRows rows are there for any pass). WorkspaceBytes(rows) never exceeds
  // WorkspaceBytes(r0) + (rows - r0) × this for r0 ≥ 1.
  static int64_t WorkspaceRowBytes(const ModelConfig& config);

  // logits (resized) receives n_vocab floats per row with want_logits, in row order.
  // With `spec_hidden`, speculative rows with want_logits skip the LM head: spec_hidden
  // (resized) gets their final normalized hidden state (n_embd floats each, in row order) and
  // logits only the other rows' (the caller scores a shortlist; softcapping is monotonic, so
  // it does not change an argmax). With `spec_tokens` instead, their logits stay on the device:
  // spec_tokens (resized) gets each one's greedy token (Ops::ArgmaxRows of the softcapped
  // logits: the host's Argmax of what `logits` would hold), in row order. Outputs are in host
  // memory, complete when Forward returns.
  // InvalidArgument for a token id outside the vocabulary or a position past the context.
  //
  // The dual-token step's carry: when the first `layers` layers attend exactly (no sparse
  // selection), a speculative row's residual after them equals, bit for bit, that of the next
  // step's real row with the same token at the same position (every kernel is
  // batch-invariant). `spec_out` (resized) receives each speculative row's residual entering
  // layer `layers` (n_embd floats, in row order); rows with BatchRow::resume start there.
  struct Carry {
    int64_t layers = 0;
    std::vector<float>* spec_out = nullptr;
  };
  absl::Status Forward(absl::Span<const BatchRow> rows, AttentionBackend& attention,
                       std::vector<float>* logits, std::vector<float>* spec_hidden = nullptr,
                       const Carry* carry = nullptr, std::vector<int32_t>* spec_tokens = nullptr);

  // Grows the workspace now to hold passes of `rows` rows (the engine, at admission: a decode
  // step of every admitted request then allocates nothing).
  absl::Status ReserveRows(int64_t rows) { return EnsureRows(rows); }

  const ModelConfig& config() const { return model_.config; }
  const DeviceWeights& weights() const { return *weights_; }
  int64_t workspace_bytes() const { return workspace_.bytes; }

 private:
  Transformer(const LoadedModel& model, backend::Device& device, MatMulKind kind);
  // Makes the workspace hold passes of `rows` rows and points the activations into it.
  absl::Status EnsureRows(int64_t rows);
  void Linear(const kernels::WeightView& w, const float* x, int64_t n_rows, int64_t x_stride, const float* bias,
              float* y, int64_t y_stride);
  void RmsNormRows(const float* x, const float* w, int64_t n_rows, float* y);
  // Activations of `rows`: the tokens and positions the ops read.
  void RowInputs(absl::Span<const BatchRow> rows);
  void Embed(absl::Span<const BatchRow> rows);
  void RopeAngles(absl::Span<const BatchRow> rows);
  // Layers [l0, l1) for `rows`, whose residuals are in x_.
  absl::Status Layers(absl::Span<const BatchRow> rows, AttentionBackend& attention, int64_t l0, int64_t l1);
  // Rows `rows` of x_ (n_embd floats each) to the end of `out` (on the compute queue).
  absl::Status RowsToHost(absl::Span<const int64_t> rows, std::vector<float>* out);
  // The LM head over the m rows of xn_ into logits (host), kLogitRows at a time.
  absl::Status Logits(int64_t m, std::vector<float>* logits);
  // The LM head over the m rows of o_, each row's greedy token into *tokens (host).
  absl::Status SpecTokens(int64_t m, std::vector<int32_t>* tokens);
  // Offset in bytes of device pointer p in the workspace.
  int64_t Offset(const float* p) const {
    return static_cast<int64_t>(reinterpret_cast<const char*>(p) - static_cast<const char*>(workspace_.data));
  }

  const LoadedModel& model_;
  backend::Device& device_;
  backend::Ops& ops_;
  MatMulKind kind_;
  // The device's memory is host memory (MemoryCaps, read once): the LM head writes straight
  // into the caller's rows (no copy of n_vocab floats per row), the same bits.
  const bool logits_in_place_;
  std::unique_ptr<DeviceWeights> weights_;
  backend::DeviceBuffer workspace_;
  int64_t rows_ = 0;  // rows the workspace holds
  std::vector<int32_t> tokens_;
  std::vector<int64_t> positions_;
  // Device pointers into the workspace.
  float *x_ = nullptr, *xn_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *attn_ = nullptr, *o_ = nullptr;
  float *gate_ = nullptr, *up_ = nullptr, *rope_cos_ = nullptr, *rope_sin_ = nullptr, *logits_ = nullptr;
  int32_t* argmax_ = nullptr;  // kLogitRows tokens
};

}  // namespace dd::model
