// GGUF → LoadedModel: hyper-parameters from `{arch}.*` metadata, tokenizer from
// `tokenizer.ggml.*`, weights as views into the mapping.
#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dd/kernels/cpu_ops.h"
#include "decode-worker/model/gguf.h"
#include "decode-worker/model/weights.h"

namespace dd::model {
namespace {

struct Ctx {
  const GgufFile& f;
  const ModelConfig& cfg;
};

absl::Status ShapeError(const GgufFile& f, const GgufTensor& t, int64_t want0, int64_t want1) {
  std::string got;
  for (int64_t d : t.shape) absl::StrAppend(&got, got.empty() ? "" : ", ", d);
  return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tensor '", t.name, "': shape [", got,
                                                 "] but the model config needs [", want0, ", ", want1, "]"));
}

// A matrix with `cols` input features (ggml ne0) and `rows` output features (ne1).
absl::StatusOr<kernels::WeightView> Matrix(const GgufFile& f, const std::string& name, int64_t cols, int64_t rows) {
  ASSIGN_OR_RETURN(const GgufTensor* t, f.FindTensor(name));
  if (t->shape.size() != 2 || t->shape[0] != cols || t->shape[1] != rows) return ShapeError(f, *t, cols, rows);
  ASSIGN_OR_RETURN(int64_t row_bytes, kernels::RowBytes(t->type, cols));
  return kernels::WeightView{t->type, t->data, rows, cols, row_bytes};
}

absl::StatusOr<std::vector<float>> Vector(const GgufFile& f, const std::string& name, int64_t n) {
  ASSIGN_OR_RETURN(const GgufTensor* t, f.FindTensor(name));
  if (t->shape.size() != 1 || t->shape[0] != n) return ShapeError(f, *t, n, 1);
  std::vector<float> out(n);
  kernels::DequantizeRow(t->type, t->data, out.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": tensor '", name, "': element ", i, " is not finite"));
    }
  }
  return out;
}

absl::StatusOr<ModelConfig> ReadConfig(const GgufFile& f) {
  ModelConfig c;
  ASSIGN_OR_RETURN(c.arch_name, f.GetString("general.architecture"));
  if (c.arch_name == "llama") c.arch = Arch::kLlama;
  else if (c.arch_name == "qwen2") c.arch = Arch::kQwen2;
  else if (c.arch_name == "gemma3") c.arch = Arch::kGemma3;
  else {
    return absl::UnimplementedError(absl::StrCat(f.path(), ": architecture '", c.arch_name,
                                                 "' is not supported (llama, qwen2, gemma3)"));
  }
  const std::string a = c.arch_name + ".";
  c.name = f.Has("general.name") ? f.GetString("general.name").value_or(c.arch_name) : c.arch_name;
  ASSIGN_OR_RETURN(c.n_layer, f.GetInt(a + "block_count"));
  ASSIGN_OR_RETURN(c.n_embd, f.GetInt(a + "embedding_length"));
  ASSIGN_OR_RETURN(c.n_ff, f.GetInt(a + "feed_forward_length"));
  ASSIGN_OR_RETURN(c.n_head, f.GetInt(a + "attention.head_count"));
  ASSIGN_OR_RETURN(c.n_head_kv, f.GetIntOr(a + "attention.head_count_kv", c.n_head));
  ASSIGN_OR_RETURN(c.n_ctx_train, f.GetInt(a + "context_length"));
  if (c.n_head <= 0) return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", a, "attention.head_count must be > 0"));
  ASSIGN_OR_RETURN(c.head_dim, f.GetIntOr(a + "attention.key_length", c.n_embd / c.n_head));
  ASSIGN_OR_RETURN(int64_t v_len, f.GetIntOr(a + "attention.value_length", c.head_dim));
  if (v_len != c.head_dim) {
    return absl::UnimplementedError(absl::StrCat(f.path(), ": value_length ", v_len, " != key_length ", c.head_dim));
  }
  ASSIGN_OR_RETURN(double eps, f.GetFloat(a + "attention.layer_norm_rms_epsilon"));
  c.norm_eps = static_cast<float>(eps);
  ASSIGN_OR_RETURN(c.rope_dim, f.GetIntOr(a + "rope.dimension_count", c.head_dim));
  ASSIGN_OR_RETURN(double rope_base, f.GetFloatOr(a + "rope.freq_base", 10000.0));
  double linear = 1.0;
  if (f.Has(a + "rope.scaling.type")) {
    ASSIGN_OR_RETURN(std::string type, f.GetString(a + "rope.scaling.type"));
    if (type == "linear") {
      ASSIGN_OR_RETURN(linear, f.GetFloat(a + "rope.scaling.factor"));
    } else if (type != "none") {
      return absl::UnimplementedError(absl::StrCat(f.path(), ": rope scaling type '", type, "' is not supported"));
    }
  }
  RETURN_IF_ERROR(Annotate(c.CheckShape(), f.path()));  // before anything is sized from it
  std::vector<float> factors;
  if (const GgufTensor* rf = f.FindTensorOrNull("rope_freqs.weight")) {
    if (rf->shape.size() != 1 || rf->shape[0] != c.rope_dim / 2) return ShapeError(f, *rf, c.rope_dim / 2, 1);
    ASSIGN_OR_RETURN(factors, Vector(f, "rope_freqs.weight", c.rope_dim / 2));
  }
  c.rope_neox = c.arch != Arch::kLlama;  // llama.cpp's converter permutes llama Q/K for adjacent pairs
  c.inv_freq = RopeInvFreq(rope_base, c.rope_dim, factors, linear);
  c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  c.layer_is_swa.assign(c.n_layer, false);
  if (c.arch == Arch::kGemma3) {
    c.embed_scale = std::sqrt(static_cast<float>(c.n_embd));
    c.qk_norm = c.post_norms = c.gelu = true;
    ASSIGN_OR_RETURN(c.sliding_window, f.GetIntOr(a + "attention.sliding_window", 0));
    // Gemma 3 files written by llama.cpp's converter carry neither the sliding-window pattern
    // nor the local RoPE base; these defaults are the Gemma 3 architecture's (every 6th layer
    // global; local layers use base 10000). A file that has the keys overrides them.
    ASSIGN_OR_RETURN(int64_t period, f.GetIntOr(a + "attention.sliding_window_pattern", 6));
    ASSIGN_OR_RETURN(double base_swa, f.GetFloatOr(a + "rope.freq_base_swa", 10000.0));
    if (period <= 0) return absl::InvalidArgumentError(absl::StrCat(f.path(), ": sliding_window_pattern must be > 0"));
    if (c.sliding_window > 0) {
      for (int64_t l = 0; l < c.n_layer; ++l) c.layer_is_swa[l] = (l + 1) % period != 0;
    }
    c.inv_freq_swa = RopeInvFreq(base_swa, c.rope_dim, {}, 1.0);
    ASSIGN_OR_RETURN(double scale, f.GetFloatOr(a + "attention.scale", c.attn_scale));
    c.attn_scale = static_cast<float>(scale);
    ASSIGN_OR_RETURN(double cap, f.GetFloatOr(a + "final_logit_softcapping", 0.0));
    c.final_logit_softcap = static_cast<float>(cap);
    if (f.Has(a + "attn_logit_softcapping")) {
      return absl::UnimplementedError(absl::StrCat(f.path(), ": ", a, "attn_logit_softcapping is not supported"));
    }
  }
  if (c.arch == Arch::kQwen2) c.qkv_bias = true;
  return c;
}

absl::StatusOr<TokenizerSpec> ReadTokenizer(const GgufFile& f) {
  TokenizerSpec s;
  ASSIGN_OR_RETURN(std::string model, f.GetString("tokenizer.ggml.model"));
  if (model == "llama") s.kind = TokenizerSpec::Kind::kSentencePieceBpe;
  else if (model == "gpt2") s.kind = TokenizerSpec::Kind::kByteLevelBpe;
  else {
    return absl::UnimplementedError(absl::StrCat(f.path(), ": tokenizer.ggml.model '", model,
                                                 "' is not supported (llama, gpt2)"));
  }
  ASSIGN_OR_RETURN(s.tokens, f.GetStringArray("tokenizer.ggml.tokens"));
  if (f.Has("tokenizer.ggml.scores")) {
    ASSIGN_OR_RETURN(s.scores, f.GetFloatArray("tokenizer.ggml.scores"));
  }
  if (f.Has("tokenizer.ggml.token_type")) {
    ASSIGN_OR_RETURN(std::vector<int64_t> types, f.GetIntArray("tokenizer.ggml.token_type"));
    for (int64_t t : types) s.types.push_back(static_cast<TokenType>(t));
  } else {
    s.types.assign(s.tokens.size(), TokenType::kNormal);
  }
  if (f.Has("tokenizer.ggml.merges")) {
    ASSIGN_OR_RETURN(s.merges, f.GetStringArray("tokenizer.ggml.merges"));
  }
  if (f.Has("tokenizer.ggml.pre")) {
    ASSIGN_OR_RETURN(s.pre, f.GetString("tokenizer.ggml.pre"));
  }
  ASSIGN_OR_RETURN(int64_t bos, f.GetIntOr("tokenizer.ggml.bos_token_id", -1));
  ASSIGN_OR_RETURN(int64_t eos, f.GetIntOr("tokenizer.ggml.eos_token_id", -1));
  ASSIGN_OR_RETURN(int64_t unk, f.GetIntOr("tokenizer.ggml.unknown_token_id", -1));
  ASSIGN_OR_RETURN(int64_t pad, f.GetIntOr("tokenizer.ggml.padding_token_id", -1));
  s.bos_id = static_cast<int32_t>(bos);
  s.eos_id = static_cast<int32_t>(eos);
  s.unk_id = static_cast<int32_t>(unk);
  s.pad_id = static_cast<int32_t>(pad);
  ASSIGN_OR_RETURN(s.add_bos, f.GetBoolOr("tokenizer.ggml.add_bos_token", s.kind == TokenizerSpec::Kind::kSentencePieceBpe));
  ASSIGN_OR_RETURN(s.add_space_prefix, f.GetBoolOr("tokenizer.ggml.add_space_prefix", false));
  if (eos >= 0) s.eog_ids.push_back(static_cast<int32_t>(eos));
  if (f.Has("tokenizer.ggml.eot_token_id")) {
    ASSIGN_OR_RETURN(int64_t eot, f.GetInt("tokenizer.ggml.eot_token_id"));
    s.eog_ids.push_back(static_cast<int32_t>(eot));
  }
  // Chat-turn terminators that files do not always flag as end-of-generation.
  for (size_t i = 0; i < s.tokens.size(); ++i) {
    const std::string& t = s.tokens[i];
    if ((t == "<end_of_turn>" || t == "<|eot_id|>" || t == "<|im_end|>" || t == "<|endoftext|>") &&
        s.types[i] == TokenType::kControl) {
      s.eog_ids.push_back(static_cast<int32_t>(i));
    }
  }
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadedModel>> LoadGguf(const std::string& path) {
  ASSIGN_OR_RETURN(GgufFile file, GgufFile::Open(path));
  auto f = std::make_shared<GgufFile>(std::move(file));
  auto m = std::make_unique<LoadedModel>();
  m->source_path = path;
  m->format = "gguf";
  ASSIGN_OR_RETURN(m->config, ReadConfig(*f));
  ModelConfig& c = m->config;
  ModelWeights& w = m->weights;

  ASSIGN_OR_RETURN(const GgufTensor* embd, f->FindTensor("token_embd.weight"));
  if (embd->shape.size() != 2 || embd->shape[0] != c.n_embd) return ShapeError(*f, *embd, c.n_embd, -1);
  c.n_vocab = embd->shape[1];
  ASSIGN_OR_RETURN(w.token_embd, Matrix(*f, "token_embd.weight", c.n_embd, c.n_vocab));
  if (f->FindTensorOrNull("output.weight") != nullptr) {
    ASSIGN_OR_RETURN(w.output, Matrix(*f, "output.weight", c.n_embd, c.n_vocab));
  } else {
    c.tied_embeddings = true;
    w.output = w.token_embd;
  }
  ASSIGN_OR_RETURN(w.output_norm, Vector(*f, "output_norm.weight", c.n_embd));
  const int64_t q_dim = c.n_head * c.head_dim, kv_dim = c.n_head_kv * c.head_dim;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    LayerWeights L;
    ASSIGN_OR_RETURN(L.attn_norm, Vector(*f, p + "attn_norm.weight", c.n_embd));
    ASSIGN_OR_RETURN(L.wq, Matrix(*f, p + "attn_q.weight", c.n_embd, q_dim));
    ASSIGN_OR_RETURN(L.wk, Matrix(*f, p + "attn_k.weight", c.n_embd, kv_dim));
    ASSIGN_OR_RETURN(L.wv, Matrix(*f, p + "attn_v.weight", c.n_embd, kv_dim));
    ASSIGN_OR_RETURN(L.wo, Matrix(*f, p + "attn_output.weight", q_dim, c.n_embd));
    ASSIGN_OR_RETURN(L.ffn_norm, Vector(*f, p + "ffn_norm.weight", c.n_embd));
    ASSIGN_OR_RETURN(L.w_gate, Matrix(*f, p + "ffn_gate.weight", c.n_embd, c.n_ff));
    ASSIGN_OR_RETURN(L.w_up, Matrix(*f, p + "ffn_up.weight", c.n_embd, c.n_ff));
    ASSIGN_OR_RETURN(L.w_down, Matrix(*f, p + "ffn_down.weight", c.n_ff, c.n_embd));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(L.bq, Vector(*f, p + "attn_q.bias", q_dim));
      ASSIGN_OR_RETURN(L.bk, Vector(*f, p + "attn_k.bias", kv_dim));
      ASSIGN_OR_RETURN(L.bv, Vector(*f, p + "attn_v.bias", kv_dim));
    }
    if (c.qk_norm) {
      ASSIGN_OR_RETURN(L.q_norm, Vector(*f, p + "attn_q_norm.weight", c.head_dim));
      ASSIGN_OR_RETURN(L.k_norm, Vector(*f, p + "attn_k_norm.weight", c.head_dim));
    }
    if (c.post_norms) {
      ASSIGN_OR_RETURN(L.post_attn_norm, Vector(*f, p + "post_attention_norm.weight", c.n_embd));
      ASSIGN_OR_RETURN(L.post_ffn_norm, Vector(*f, p + "post_ffw_norm.weight", c.n_embd));
    }
    w.layers.push_back(std::move(L));
  }
  RETURN_IF_ERROR(Annotate(c.Validate(), path));
  ASSIGN_OR_RETURN(TokenizerSpec spec, ReadTokenizer(*f));
  auto tok = Tokenizer::Create(std::move(spec));
  if (!tok.ok()) return Annotate(tok.status(), absl::StrCat(path, ": tokenizer"));
  m->tokenizer = std::move(*tok);
  if (m->tokenizer->vocab_size() != c.n_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": tokenizer has ", m->tokenizer->vocab_size(),
                                                   " tokens but token_embd.weight has ", c.n_vocab, " rows"));
  }
  if (f->Has("tokenizer.chat_template")) {
    ASSIGN_OR_RETURN(m->chat_template, f->GetString("tokenizer.chat_template"));
  }
  m->storage.push_back(f);
  return m;
}

absl::StatusOr<std::unique_ptr<LoadedModel>> LoadModel(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such model file or directory"));
  }
  if (std::filesystem::is_directory(path, ec)) return LoadSafetensorsDir(path);
  return LoadGguf(path);
}

}  // namespace dd::model
