// The decoder forward pass for llama / qwen2 / gemma3, on any compute backend: every
// operation goes through backend::Ops (dd/backend/ops.h); nothing here calls a kernel.
//
// Forward() runs a batch of token rows from any number of sequences (prefill chunks and
// decode rows mixed) through all layers. Attention is delegated to an AttentionBackend, so
// the KV strategy (dense, sparse, dual-token) is the caller's choice. Every kernel is
// batch-invariant: a row's logits are bit-identical whatever else shares its batch.
// Not thread-safe: one Forward at a time (scratch buffers are members).
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "dd/backend/ops.h"
#include "decode-worker/model/attention.h"
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

  // `model` and `ops` must outlive the Transformer.
  Transformer(const LoadedModel& model, backend::Ops& ops, MatMulKind kind = MatMulKind::kInt8);

  // logits (resized) receives n_vocab floats per row with want_logits, in row order.
  // With `spec_hidden`, speculative rows with want_logits skip the LM head: spec_hidden
  // (resized) gets their final normalized hidden state (n_embd floats each, in row order) and
  // logits only the other rows' (the caller scores a shortlist; softcapping is monotonic, so
  // it does not change an argmax).
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
                       const Carry* carry = nullptr);

  const ModelConfig& config() const { return model_.config; }

 private:
  void Linear(const kernels::WeightView& w, const float* x, int64_t n_rows, int64_t x_stride,
              const std::vector<float>& bias, float* y, int64_t y_stride);
  void RmsNormRows(const float* x, const std::vector<float>& w, int64_t n_rows, float* y);
  // Activations of `rows`: the tokens and positions the ops read.
  void RowInputs(absl::Span<const BatchRow> rows);
  // Sizes the scratch for n rows; the token embeddings and RoPE angles of `rows`.
  void Resize(int64_t n);
  void Embed(absl::Span<const BatchRow> rows);
  void RopeAngles(absl::Span<const BatchRow> rows);
  // Layers [l0, l1) for `rows`, whose residuals are in x_.
  absl::Status Layers(absl::Span<const BatchRow> rows, AttentionBackend& attention, int64_t l0, int64_t l1);

  const LoadedModel& model_;
  backend::Ops& ops_;
  MatMulKind kind_;
  std::vector<int32_t> tokens_;
  std::vector<int64_t> positions_;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, o_, gate_, up_, rope_cos_, rope_sin_;
};

}  // namespace dd::model
