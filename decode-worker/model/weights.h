// Model weights as views into the mapped model files, plus the model's own small buffers.
//
// Matrices are kernels::WeightView over mmapped bytes (rows = output features). Vectors
// (norms, biases) are converted to f32 and owned here. A ModelWeights keeps its files alive.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dd/kernels/dtype.h"
#include "decode-worker/model/model_config.h"
#include "decode-worker/model/tokenizer.h"

namespace dd::model {

struct LayerWeights {
  kernels::WeightView wq, wk, wv, wo;          // wq: (n_head*head_dim) × n_embd, wo: n_embd × (n_head*head_dim)
  kernels::WeightView w_gate, w_up, w_down;
  std::vector<float> attn_norm, ffn_norm;
  std::vector<float> post_attn_norm, post_ffn_norm;  // gemma3
  std::vector<float> q_norm, k_norm;                 // gemma3, head_dim each
  std::vector<float> bq, bk, bv;                     // qwen2
};

struct ModelWeights {
  kernels::WeightView token_embd;  // n_vocab × n_embd
  kernels::WeightView output;      // n_vocab × n_embd (== token_embd when tied)
  std::vector<float> output_norm;
  std::vector<LayerWeights> layers;
};

// A loaded model: config, weights, tokenizer, and the storage the views point into.
struct LoadedModel {
  ModelConfig config;
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string source_path;
  std::string format;                         // "gguf" or "safetensors"
  std::string chat_template;                  // the file's Jinja chat template ("" = none)
  std::vector<std::shared_ptr<void>> storage; // mapped files and converted buffers
};

// Loads a .gguf file or a Hugging Face directory (config.json + *.safetensors + tokenizer.json).
// NotFound for a missing path; InvalidArgument naming file, tensor and field for bad content.
absl::StatusOr<std::unique_ptr<LoadedModel>> LoadModel(const std::string& path);

absl::StatusOr<std::unique_ptr<LoadedModel>> LoadGguf(const std::string& path);
absl::StatusOr<std::unique_ptr<LoadedModel>> LoadSafetensorsDir(const std::string& dir);

}  // namespace dd::model
