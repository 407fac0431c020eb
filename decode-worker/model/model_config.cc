#include "decode-worker/model/model_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dd::model {

absl::Status ModelConfig::CheckShape() const {
  auto bad = [&](absl::string_view field, int64_t v, int64_t max) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: ", field, " = ", v, " is invalid (must be in 1..", max, ")"));
  };
  if (n_layer <= 0 || n_layer > kMaxLayers) return bad("n_layer", n_layer, kMaxLayers);
  if (n_embd <= 0 || n_embd > kMaxWidth) return bad("n_embd", n_embd, kMaxWidth);
  if (n_ff <= 0 || n_ff > kMaxWidth * 8) return bad("n_ff", n_ff, kMaxWidth * 8);
  if (n_head <= 0 || n_head > kMaxHeads) return bad("n_head", n_head, kMaxHeads);
  if (n_head_kv <= 0 || n_head_kv > n_head) return bad("n_head_kv", n_head_kv, n_head);
  if (head_dim <= 0 || head_dim > kMaxHeadDim) return bad("head_dim", head_dim, kMaxHeadDim);
  if (rope_dim <= 0 || rope_dim > head_dim) return bad("rope_dim", rope_dim, head_dim);
  if (n_ctx_train <= 0 || n_ctx_train > kMaxContext) return bad("n_ctx_train", n_ctx_train, kMaxContext);
  return absl::OkStatus();
}

absl::Status ModelConfig::Validate() const {
  RETURN_IF_ERROR(CheckShape());
  auto bad = [&](absl::string_view field, int64_t v) {
    return absl::InvalidArgumentError(absl::StrCat("model config: ", field, " = ", v, " is invalid"));
  };
  if (n_head % n_head_kv != 0) return bad("n_head_kv (must divide n_head)", n_head_kv);
  if (head_dim % 2 != 0) return bad("head_dim", head_dim);
  if (rope_dim % 2 != 0) return bad("rope_dim", rope_dim);
  if (n_vocab <= 0 || n_vocab > kMaxVocab) return bad("n_vocab", n_vocab);
  if (static_cast<int64_t>(layer_is_swa.size()) != n_layer) return bad("layer_is_swa size", layer_is_swa.size());
  for (bool swa : layer_is_swa) {
    if (swa && sliding_window <= 0) return bad("sliding_window", sliding_window);
  }
  if (static_cast<int64_t>(inv_freq.size()) != rope_dim / 2) return bad("inv_freq size", inv_freq.size());
  if (!(norm_eps > 0) || !std::isfinite(norm_eps)) {
    return absl::InvalidArgumentError(absl::StrCat("model config: norm_eps ", norm_eps, " is invalid"));
  }
  return absl::OkStatus();
}

std::vector<float> RopeInvFreq(double base, int64_t rot_dim, const std::vector<float>& freq_factors,
                               double linear_scale) {
  std::vector<float> out(rot_dim / 2);
  for (int64_t i = 0; i < rot_dim / 2; ++i) {
    double f = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(rot_dim));
    if (!freq_factors.empty()) f /= freq_factors[i];
    out[i] = static_cast<float>(f / linear_scale);
  }
  return out;
}

std::vector<float> Llama3FreqFactors(double base, int64_t rot_dim, double factor, double low_freq_factor,
                                     double high_freq_factor, double original_max_pos) {
  const double low_wavelen = original_max_pos / low_freq_factor;
  const double high_wavelen = original_max_pos / high_freq_factor;
  std::vector<float> out(rot_dim / 2);
  for (int64_t i = 0; i < rot_dim / 2; ++i) {
    const double freq = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(rot_dim));
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      out[i] = 1.0f;
    } else if (wavelen > low_wavelen) {
      out[i] = static_cast<float>(factor);
    } else {
      const double smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      out[i] = static_cast<float>(1.0 / ((1 - smooth) / factor + smooth));
    }
  }
  return out;
}

}  // namespace dd::model
