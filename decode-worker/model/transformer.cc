#include "decode-worker/model/transformer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dd::model {

Transformer::Transformer(const LoadedModel& model, backend::Ops& ops, MatMulKind kind)
    : model_(model), ops_(ops), kind_(kind) {}

void Transformer::Linear(const kernels::WeightView& w, const float* x, int64_t n_rows, int64_t x_stride,
                         const std::vector<float>& bias, float* y, int64_t y_stride) {
  ops_.Linear(w, kind_, x, n_rows, x_stride, bias.empty() ? nullptr : bias.data(), y, y_stride);
}

void Transformer::RmsNormRows(const float* x, const std::vector<float>& w, int64_t n_rows, float* y) {
  ops_.RmsNormRows(x, w.data(), model_.config.norm_eps, n_rows, model_.config.n_embd, y);
}

void Transformer::RowInputs(absl::Span<const BatchRow> rows) {
  tokens_.resize(rows.size());
  positions_.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    tokens_[i] = rows[i].token;
    positions_[i] = rows[i].pos;
  }
}

void Transformer::Resize(int64_t n) {
  const ModelConfig& c = model_.config;
  const int64_t d = c.n_embd, q_dim = c.n_head * c.head_dim, kv_dim = c.n_head_kv * c.head_dim;
  x_.resize(n * d);
  xn_.resize(n * d);
  q_.resize(n * q_dim);
  k_.resize(n * kv_dim);
  v_.resize(n * kv_dim);
  attn_.resize(n * q_dim);
  o_.resize(n * d);
  gate_.resize(n * c.n_ff);
  up_.resize(n * c.n_ff);
  rope_cos_.resize(2 * n * (c.rope_dim / 2));
  rope_sin_.resize(2 * n * (c.rope_dim / 2));
}

void Transformer::Embed(absl::Span<const BatchRow> rows) {
  RowInputs(rows);
  ops_.Embed(model_.weights.token_embd, tokens_, model_.config.embed_scale, x_.data());
}

void Transformer::RopeAngles(absl::Span<const BatchRow> rows) {
  const ModelConfig& c = model_.config;
  const int64_t n = static_cast<int64_t>(rows.size()), half = c.rope_dim / 2;
  RowInputs(rows);
  // Angles for global layers [0, n*half) and sliding layers [n*half, 2n*half).
  ops_.RopeAngles(c.inv_freq.data(), half, positions_, rope_cos_.data(), rope_sin_.data());
  if (!c.inv_freq_swa.empty()) {
    ops_.RopeAngles(c.inv_freq_swa.data(), half, positions_, &rope_cos_[n * half], &rope_sin_[n * half]);
  }
}

absl::Status Transformer::Layers(absl::Span<const BatchRow> rows, AttentionBackend& attention, int64_t l0,
                                 int64_t l1) {
  const ModelConfig& c = model_.config;
  const ModelWeights& w = model_.weights;
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t d = c.n_embd, hd = c.head_dim;
  const int64_t q_dim = c.n_head * hd, kv_dim = c.n_head_kv * hd;
  const int64_t half = c.rope_dim / 2;
  for (int64_t l = l0; l < l1; ++l) {
    const LayerWeights& L = w.layers[l];
    const bool swa = c.layer_is_swa[l];
    RmsNormRows(x_.data(), L.attn_norm, n, xn_.data());
    Linear(L.wq, xn_.data(), n, d, L.bq, q_.data(), q_dim);
    Linear(L.wk, xn_.data(), n, d, L.bk, k_.data(), kv_dim);
    Linear(L.wv, xn_.data(), n, d, L.bv, v_.data(), kv_dim);
    const int64_t angle_base = (swa && !c.inv_freq_swa.empty()) ? n : 0;
    const float* cs = &rope_cos_[angle_base * half];
    const float* sn = &rope_sin_[angle_base * half];
    const float* q_norm = c.qk_norm ? L.q_norm.data() : nullptr;
    const float* k_norm = c.qk_norm ? L.k_norm.data() : nullptr;
    ops_.HeadNormRope(q_.data(), n, q_dim, c.n_head, hd, q_norm, c.norm_eps, cs, sn, half, c.rope_neox);
    ops_.HeadNormRope(k_.data(), n, kv_dim, c.n_head_kv, hd, k_norm, c.norm_eps, cs, sn, half, c.rope_neox);
    AttentionCall call;
    call.layer = l;
    call.sliding = swa;
    call.window = c.sliding_window;
    call.scale = c.attn_scale;
    call.rows = rows;
    call.q = q_.data();
    call.k = k_.data();
    call.v = v_.data();
    call.out = attn_.data();
    RETURN_IF_ERROR(attention.Attend(call));
    Linear(L.wo, attn_.data(), n, q_dim, {}, o_.data(), d);
    if (c.post_norms) RmsNormRows(o_.data(), L.post_attn_norm, n, o_.data());
    ops_.Add(x_.data(), o_.data(), n * d);

    RmsNormRows(x_.data(), L.ffn_norm, n, xn_.data());
    Linear(L.w_gate, xn_.data(), n, d, {}, gate_.data(), c.n_ff);
    Linear(L.w_up, xn_.data(), n, d, {}, up_.data(), c.n_ff);
    ops_.GatedMul(c.gelu ? backend::GatedActivation::kGeluTanh : backend::GatedActivation::kSilu, gate_.data(),
                  up_.data(), gate_.data(), n, c.n_ff);
    Linear(L.w_down, gate_.data(), n, c.n_ff, {}, o_.data(), d);
    if (c.post_norms) RmsNormRows(o_.data(), L.post_ffn_norm, n, o_.data());
    ops_.Add(x_.data(), o_.data(), n * d);
  }
  return absl::OkStatus();
}

absl::Status Transformer::Forward(absl::Span<const BatchRow> rows, AttentionBackend& attention,
                                  std::vector<float>* logits, std::vector<float>* spec_hidden, const Carry* carry) {
  const ModelConfig& c = model_.config;
  const ModelWeights& w = model_.weights;
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t d = c.n_embd;
  const int64_t carry_layers = carry != nullptr ? carry->layers : 0;
  if (carry_layers < 0 || carry_layers > c.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("carry of ", carry_layers, " layers in a ", c.n_layer, "-layer model"));
  }
  bool resumes = false;
  for (const BatchRow& r : rows) {
    if (r.token < 0 || r.token >= c.n_vocab) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", r.token, " outside the vocabulary [0, ", c.n_vocab, ")"));
    }
    if (r.pos < 0 || r.pos >= c.n_ctx_train) {
      return absl::InvalidArgumentError(absl::StrCat("position ", r.pos, " outside the model context [0, ", c.n_ctx_train, ")"));
    }
    if (r.resume != nullptr && (carry_layers == 0 || r.speculative)) {
      return absl::InvalidArgumentError("a resumed row needs a carry of at least one layer and must be a real row");
    }
    resumes = resumes || r.resume != nullptr;
  }
  // The rows that start from their embedding run the carried layers alone.
  std::vector<BatchRow> fresh;
  if (resumes) {
    for (const BatchRow& r : rows) {
      if (r.resume == nullptr) fresh.push_back(r);
    }
  }
  const absl::Span<const BatchRow> first = resumes ? absl::Span<const BatchRow>(fresh) : rows;
  Resize(n);
  Embed(first);
  if (carry_layers > 0 && !first.empty()) {
    RopeAngles(first);
    RETURN_IF_ERROR(Layers(first, attention, 0, carry_layers));
  }
  if (carry != nullptr && carry->spec_out != nullptr) {
    carry->spec_out->clear();
    for (size_t i = 0; i < first.size(); ++i) {
      if (first[i].speculative) carry->spec_out->insert(carry->spec_out->end(), &x_[i * d], &x_[(i + 1) * d]);
    }
  }
  if (resumes) {
    // Spread the fresh rows' residuals to their places, the resumed ones beside them. From the
    // last row back: fresh row j goes to row i >= j, so no row is overwritten before it moves.
    for (int64_t i = n - 1, j = static_cast<int64_t>(first.size()) - 1; i >= 0; --i) {
      const float* src = rows[i].resume != nullptr ? rows[i].resume : &x_[j-- * d];
      std::copy_backward(src, src + d, &x_[(i + 1) * d]);
    }
  }
  if (resumes || carry_layers == 0 || first.empty()) RopeAngles(rows);  // else computed above for the same rows
  RETURN_IF_ERROR(Layers(rows, attention, carry_layers, c.n_layer));

  std::vector<int64_t> out_rows;
  if (spec_hidden != nullptr) spec_hidden->clear();
  for (int64_t i = 0; i < n; ++i) {
    if (!rows[i].want_logits) continue;
    if (spec_hidden != nullptr && rows[i].speculative) {
      spec_hidden->resize(spec_hidden->size() + d);
      const int64_t row[] = {i};
      ops_.RmsNormSelected(x_.data(), row, w.output_norm.data(), c.norm_eps, d,
                           spec_hidden->data() + spec_hidden->size() - d);
      continue;
    }
    out_rows.push_back(i);
  }
  const int64_t m = static_cast<int64_t>(out_rows.size());
  ops_.RmsNormSelected(x_.data(), out_rows, w.output_norm.data(), c.norm_eps, d, xn_.data());
  logits->resize(m * c.n_vocab);
  if (m > 0) Linear(w.output, xn_.data(), m, d, {}, logits->data(), c.n_vocab);
  if (c.final_logit_softcap > 0) ops_.Softcap(logits->data(), m * c.n_vocab, c.final_logit_softcap);
  return absl::OkStatus();
}

}  // namespace dd::model
