#include "decode-worker/model/transformer.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dd::model {
namespace {

using backend::Queue;

constexpr int64_t kAlignFloats = 16;  // 64 bytes
int64_t Aligned(int64_t n) { return (n + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

// The workspace's regions for `rows` rows, in floats, in the order EnsureRows lays them out.
std::vector<int64_t> Regions(const ModelConfig& c, int64_t rows) {
  const int64_t d = c.n_embd, q_dim = c.n_head * c.head_dim, kv_dim = c.n_head_kv * c.head_dim;
  const int64_t half = c.rope_dim / 2;
  return {rows * d,          rows * d,        rows * q_dim, rows * kv_dim, rows * kv_dim, rows * q_dim,
          rows * d,          rows * c.n_ff,   rows * c.n_ff,
          2 * rows * half,   2 * rows * half,  // RoPE angles: global layers' rows, then sliding layers'
          Transformer::kLogitRows * c.n_vocab,
          Transformer::kLogitRows};  // the speculative rows' tokens (int32)
}

}  // namespace

// Region i starts (i + 1) (i + 2) / 2 cache lines further than packing alone would put it: the
// regions' sizes (rows × a model width) are often multiples of 4 KiB, and starts that far apart
// would share L1 cache sets, which a batch-1 pass touching the head of every region at once
// would thrash.
static int64_t Stagger(size_t i) { return kAlignFloats * static_cast<int64_t>(i + 1); }

int64_t Transformer::WorkspaceBytes(const ModelConfig& config, int64_t rows) {
  int64_t floats = 0;
  const std::vector<int64_t> sizes = Regions(config, rows);
  for (size_t i = 0; i < sizes.size(); ++i) floats += Aligned(sizes[i]) + Stagger(i);
  return floats * static_cast<int64_t>(sizeof(float));
}

int64_t Transformer::WorkspaceRowBytes(const ModelConfig& config) {
  // Regions of one row less those of none (the fixed logits and tokens), rounding included:
  // a region's rows × width rounds up to 16 floats at most once.
  const std::vector<int64_t> one = Regions(config, 1), none = Regions(config, 0);
  int64_t floats = 0;
  for (size_t i = 0; i < one.size(); ++i) floats += one[i] - none[i];
  return (floats + kAlignFloats * static_cast<int64_t>(one.size())) * static_cast<int64_t>(sizeof(float));
}

Transformer::Transformer(const LoadedModel& model, backend::Device& device, MatMulKind kind)
    : model_(model),
      device_(device),
      ops_(device.ops()),
      kind_(kind),
      logits_in_place_(device.caps().host_reads_device_memory) {}

absl::StatusOr<std::unique_ptr<Transformer>> Transformer::Create(const LoadedModel& model, backend::Device& device,
                                                                 MatMulKind kind, int64_t rows) {
  std::unique_ptr<Transformer> t(new Transformer(model, device, kind));
  ASSIGN_OR_RETURN(t->weights_, DeviceWeights::Upload(model, device));
  RETURN_IF_ERROR(t->EnsureRows(std::max<int64_t>(rows, 1)));
  return t;
}

Transformer::~Transformer() {
  if (workspace_) {
    (void)device_.Synchronize(device_.Record(Queue::kCompute));
    device_.Free(workspace_);
  }
}

absl::Status Transformer::EnsureRows(int64_t rows) {
  if (rows <= rows_) return absl::OkStatus();
  if (workspace_) {
    RETURN_IF_ERROR(device_.Synchronize(device_.Record(Queue::kCompute)));
    device_.Free(workspace_);
    rows_ = 0;
  }
  ASSIGN_OR_RETURN(workspace_,
                   device_.Allocate(backend::MemoryTag::kWorkspace, WorkspaceBytes(model_.config, rows)));
  rows_ = rows;
  float* p = static_cast<float*>(workspace_.data);
  float* tokens_out = nullptr;
  float** regions[] = {&x_,   &xn_,       &q_,        &k_,       &v_,         &attn_,
                       &o_,   &gate_,     &up_,       &rope_cos_, &rope_sin_, &logits_, &tokens_out};
  const std::vector<int64_t> sizes = Regions(model_.config, rows);
  for (size_t i = 0; i < sizes.size(); ++i) {
    p += Stagger(i);
    *regions[i] = p;
    p += Aligned(sizes[i]);
  }
  argmax_ = reinterpret_cast<int32_t*>(tokens_out);
  return absl::OkStatus();
}

void Transformer::Linear(const kernels::WeightView& w, const float* x, int64_t n_rows, int64_t x_stride,
                         const float* bias, float* y, int64_t y_stride) {
  ops_.Linear(w, kind_, x, n_rows, x_stride, bias, y, y_stride);
}

void Transformer::RmsNormRows(const float* x, const float* w, int64_t n_rows, float* y) {
  ops_.RmsNormRows(x, w, model_.config.norm_eps, n_rows, model_.config.n_embd, y);
}

void Transformer::RowInputs(absl::Span<const BatchRow> rows) {
  tokens_.resize(rows.size());
  positions_.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    tokens_[i] = rows[i].token;
    positions_[i] = rows[i].pos;
  }
}

void Transformer::Embed(absl::Span<const BatchRow> rows) {
  RowInputs(rows);
  ops_.Embed(weights_->token_embd, tokens_, model_.config.embed_scale, x_);
}

void Transformer::RopeAngles(absl::Span<const BatchRow> rows) {
  const ModelConfig& c = model_.config;
  const int64_t n = static_cast<int64_t>(rows.size()), half = c.rope_dim / 2;
  RowInputs(rows);
  // Angles for global layers [0, n*half) and sliding layers [n*half, 2n*half).
  ops_.RopeAngles(c.inv_freq.data(), half, positions_, rope_cos_, rope_sin_);
  if (!c.inv_freq_swa.empty()) {
    ops_.RopeAngles(c.inv_freq_swa.data(), half, positions_, rope_cos_ + n * half, rope_sin_ + n * half);
  }
}

absl::Status Transformer::Layers(absl::Span<const BatchRow> rows, AttentionBackend& attention, int64_t l0,
                                 int64_t l1) {
  const ModelConfig& c = model_.config;
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t d = c.n_embd, hd = c.head_dim;
  const int64_t q_dim = c.n_head * hd, kv_dim = c.n_head_kv * hd;
  const int64_t half = c.rope_dim / 2;
  for (int64_t l = l0; l < l1; ++l) {
    const DeviceLayerWeights& L = weights_->layers[l];
    const bool swa = c.layer_is_swa[l];
    // Each half of a layer around its attention is a static segment (ops.h): the same launches
    // every step at a batch size, which a GPU replays as one.
    ops_.BeginSegment(2 * l);
    RmsNormRows(x_, L.attn_norm, n, xn_);
    Linear(L.wq, xn_, n, d, L.bq, q_, q_dim);
    Linear(L.wk, xn_, n, d, L.bk, k_, kv_dim);
    Linear(L.wv, xn_, n, d, L.bv, v_, kv_dim);
    const int64_t angle_base = (swa && !c.inv_freq_swa.empty()) ? n : 0;
    const float* cs = rope_cos_ + angle_base * half;
    const float* sn = rope_sin_ + angle_base * half;
    const float* q_norm = c.qk_norm ? L.q_norm : nullptr;
    const float* k_norm = c.qk_norm ? L.k_norm : nullptr;
    ops_.HeadNormRope(q_, n, q_dim, c.n_head, hd, q_norm, c.norm_eps, cs, sn, half, c.rope_neox);
    ops_.HeadNormRope(k_, n, kv_dim, c.n_head_kv, hd, k_norm, c.norm_eps, cs, sn, half, c.rope_neox);
    ops_.EndSegment();
    AttentionCall call;
    call.layer = l;
    call.sliding = swa;
    call.window = c.sliding_window;
    call.scale = c.attn_scale;
    call.rows = rows;
    call.buffer = workspace_;
    call.q = q_;
    call.k = k_;
    call.v = v_;
    call.out = attn_;
    RETURN_IF_ERROR(attention.Attend(call));
    ops_.BeginSegment(2 * l + 1);
    Linear(L.wo, attn_, n, q_dim, nullptr, o_, d);
    if (c.post_norms) RmsNormRows(o_, L.post_attn_norm, n, o_);
    ops_.Add(x_, o_, n * d);

    RmsNormRows(x_, L.ffn_norm, n, xn_);
    Linear(L.w_gate, xn_, n, d, nullptr, gate_, c.n_ff);
    Linear(L.w_up, xn_, n, d, nullptr, up_, c.n_ff);
    ops_.GatedMul(c.gelu ? backend::GatedActivation::kGeluTanh : backend::GatedActivation::kSilu, gate_, up_, gate_,
                  n, c.n_ff);
    Linear(L.w_down, gate_, n, c.n_ff, nullptr, o_, d);
    if (c.post_norms) RmsNormRows(o_, L.post_ffn_norm, n, o_);
    ops_.Add(x_, o_, n * d);
    ops_.EndSegment();
  }
  return absl::OkStatus();
}

absl::Status Transformer::RowsToHost(absl::Span<const int64_t> rows, std::vector<float>* out) {
  const int64_t d = model_.config.n_embd;
  const size_t at = out->size();
  out->resize(at + rows.size() * d);
  for (size_t i = 0; i < rows.size(); ++i) {
    RETURN_IF_ERROR(device_.CopyToHost(Queue::kCompute, workspace_, Offset(x_ + rows[i] * d), out->data() + at + i * d,
                                       d * static_cast<int64_t>(sizeof(float))));
  }
  return absl::OkStatus();
}

absl::Status Transformer::Logits(int64_t m, std::vector<float>* logits) {
  const ModelConfig& c = model_.config;
  const int64_t d = c.n_embd, V = c.n_vocab;
  logits->resize(m * V);
  if (logits_in_place_) {
    Linear(weights_->output, xn_, m, d, nullptr, logits->data(), V);
    if (c.final_logit_softcap > 0) ops_.Softcap(logits->data(), m * V, c.final_logit_softcap);
    return absl::OkStatus();
  }
  for (int64_t r0 = 0; r0 < m; r0 += kLogitRows) {
    const int64_t k = std::min(kLogitRows, m - r0);
    Linear(weights_->output, xn_ + r0 * d, k, d, nullptr, logits_, V);
    if (c.final_logit_softcap > 0) ops_.Softcap(logits_, k * V, c.final_logit_softcap);
    RETURN_IF_ERROR(device_.CopyToHost(Queue::kCompute, workspace_, Offset(logits_), logits->data() + r0 * V,
                                       k * V * static_cast<int64_t>(sizeof(float))));
  }
  return absl::OkStatus();
}

absl::Status Transformer::SpecTokens(int64_t m, std::vector<int32_t>* tokens) {
  const ModelConfig& c = model_.config;
  const int64_t d = c.n_embd, V = c.n_vocab;
  tokens->resize(m);
  for (int64_t r0 = 0; r0 < m; r0 += kLogitRows) {
    const int64_t k = std::min(kLogitRows, m - r0);
    Linear(weights_->output, o_ + r0 * d, k, d, nullptr, logits_, V);
    if (c.final_logit_softcap > 0) ops_.Softcap(logits_, k * V, c.final_logit_softcap);
    ops_.ArgmaxRows(logits_, k, V, argmax_);
    RETURN_IF_ERROR(device_.CopyToHost(Queue::kCompute, workspace_, Offset(reinterpret_cast<float*>(argmax_)),
                                       tokens->data() + r0, k * static_cast<int64_t>(sizeof(int32_t))));
  }
  return absl::OkStatus();
}

absl::Status Transformer::Forward(absl::Span<const BatchRow> rows, AttentionBackend& attention,
                                  std::vector<float>* logits, std::vector<float>* spec_hidden, const Carry* carry,
                                  std::vector<int32_t>* spec_tokens) {
  if (spec_hidden != nullptr && spec_tokens != nullptr) {
    return absl::InvalidArgumentError("a speculative row gives its hidden state or its token, not both");
  }
  const ModelConfig& c = model_.config;
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t d = c.n_embd;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(float));
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
  RETURN_IF_ERROR(EnsureRows(n));
  // The rows that start from their embedding run the carried layers alone.
  std::vector<BatchRow> fresh;
  if (resumes) {
    for (const BatchRow& r : rows) {
      if (r.resume == nullptr) fresh.push_back(r);
    }
  }
  const absl::Span<const BatchRow> first = resumes ? absl::Span<const BatchRow>(fresh) : rows;
  Embed(first);
  if (carry_layers > 0 && !first.empty()) {
    RopeAngles(first);
    RETURN_IF_ERROR(Layers(first, attention, 0, carry_layers));
  }
  if (carry != nullptr && carry->spec_out != nullptr) {
    carry->spec_out->clear();
    std::vector<int64_t> spec;
    for (size_t i = 0; i < first.size(); ++i) {
      if (first[i].speculative) spec.push_back(static_cast<int64_t>(i));
    }
    RETURN_IF_ERROR(RowsToHost(spec, carry->spec_out));
  }
  if (resumes) {
    // Spread the fresh rows' residuals to their places, the resumed ones beside them. From the
    // last row back: fresh row j goes to row i >= j, so no row is overwritten before it moves.
    // The resumed residuals are host memory the caller keeps until Forward returns.
    for (int64_t i = n - 1, j = static_cast<int64_t>(first.size()) - 1; i >= 0; --i) {
      const int64_t to = Offset(x_ + i * d);
      if (rows[i].resume != nullptr) {
        RETURN_IF_ERROR(device_.CopyToDevice(Queue::kCompute, rows[i].resume, workspace_, to, row_bytes));
      } else if (j-- != i) {
        RETURN_IF_ERROR(device_.Copy(Queue::kCompute, workspace_, Offset(x_ + (j + 1) * d), workspace_, to, row_bytes));
      }
    }
  }
  if (resumes || carry_layers == 0 || first.empty()) RopeAngles(rows);  // else computed above for the same rows
  RETURN_IF_ERROR(Layers(rows, attention, carry_layers, c.n_layer));

  std::vector<int64_t> out_rows, spec_rows;
  const bool split = spec_hidden != nullptr || spec_tokens != nullptr;
  for (int64_t i = 0; i < n; ++i) {
    if (!rows[i].want_logits) continue;
    (split && rows[i].speculative ? spec_rows : out_rows).push_back(i);
  }
  if (spec_tokens != nullptr) spec_tokens->clear();
  if (split) {
    if (spec_hidden != nullptr) spec_hidden->assign(spec_rows.size() * d, 0.0f);
    if (!spec_rows.empty()) {
      ops_.RmsNormSelected(x_, spec_rows, weights_->output_norm, c.norm_eps, d, o_);
      if (spec_hidden != nullptr) {
        RETURN_IF_ERROR(device_.CopyToHost(Queue::kCompute, workspace_, Offset(o_), spec_hidden->data(),
                                           static_cast<int64_t>(spec_rows.size()) * row_bytes));
      } else {
        RETURN_IF_ERROR(SpecTokens(static_cast<int64_t>(spec_rows.size()), spec_tokens));
      }
    }
  }
  const int64_t m = static_cast<int64_t>(out_rows.size());
  ops_.RmsNormSelected(x_, out_rows, weights_->output_norm, c.norm_eps, d, xn_);
  RETURN_IF_ERROR(Logits(m, logits));
  return device_.Synchronize(device_.Record(Queue::kCompute));
}

}  // namespace dd::model
