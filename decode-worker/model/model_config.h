// Architecture hyper-parameters, read from file metadata (GGUF keys or HF config.json) —
// never from a model's name. One struct covers llama, qwen2 and gemma3.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace dd::model {

enum class Arch { kLlama, kQwen2, kGemma3 };

struct ModelConfig {
  // Upper bounds on what a file may claim (CheckShape); the largest open models are far below.
  static constexpr int64_t kMaxLayers = 1024;
  static constexpr int64_t kMaxWidth = 1 << 17;     // n_embd; n_ff up to 8x this
  static constexpr int64_t kMaxHeads = 1024;
  static constexpr int64_t kMaxHeadDim = 1024;
  static constexpr int64_t kMaxContext = 1 << 24;   // 16M positions
  static constexpr int64_t kMaxVocab = 1 << 23;

  Arch arch = Arch::kLlama;
  std::string arch_name;        // "llama", "qwen2", "gemma3"
  std::string name;             // general.name or the HF model type, for display
  int64_t n_layer = 0;
  int64_t n_embd = 0;
  int64_t n_head = 0;
  int64_t n_head_kv = 0;
  int64_t head_dim = 0;         // key/value length per head
  int64_t n_ff = 0;
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;      // the model's context length; prompts beyond it are refused
  float norm_eps = 1e-5f;

  // RoPE. inv_freq for global layers and (gemma3) sliding-window layers, rot_dim/2 entries,
  // already divided by any llama-3 frequency factors / linear scaling.
  int64_t rope_dim = 0;
  bool rope_neox = false;       // rotate-half pairing (HF layout) vs adjacent pairs (GGUF llama)
  std::vector<float> inv_freq;
  std::vector<float> inv_freq_swa;

  // Sliding-window attention: layer_is_swa[l] layers attend to the last `sliding_window`
  // positions (position i sees j iff i - window < j <= i).
  int64_t sliding_window = 0;
  std::vector<bool> layer_is_swa;

  float embed_scale = 1.0f;     // gemma3: sqrt(n_embd)
  float attn_scale = 0.0f;      // softmax scale; 1/sqrt(head_dim) unless the file says otherwise
  bool qk_norm = false;         // gemma3: RMSNorm per head on q and k before RoPE
  bool post_norms = false;      // gemma3: norms after attention and FFN, before the residual add
  bool gelu = false;            // gemma3: GeGLU (tanh GELU); else SwiGLU
  bool qkv_bias = false;        // qwen2
  bool tied_embeddings = false;
  float final_logit_softcap = 0.0f;  // > 0: logits = cap * tanh(logits / cap)

  // Bounds the shape fields a file sets (layers, widths, heads, head and RoPE dims, context)
  // before anything is sized from them: a hostile file must not make the loader allocate
  // gigabytes or overflow a product. Limits are far above any model this serves.
  absl::Status CheckShape() const;
  // Checks internal consistency (CheckShape, divisibility, positive sizes); errors name the field.
  absl::Status Validate() const;
};

// Computes inv_freq[i] = base^(-2i/rot_dim) / factor(i).
std::vector<float> RopeInvFreq(double base, int64_t rot_dim, const std::vector<float>& freq_factors,
                               double linear_scale);

// Llama-3 rope frequency factors (HF rope_scaling rope_type "llama3"), as the divisors that
// GGUF stores in rope_freqs.weight.
std::vector<float> Llama3FreqFactors(double base, int64_t rot_dim, double factor, double low_freq_factor,
                                     double high_freq_factor, double original_max_pos);

}  // namespace dd::model
