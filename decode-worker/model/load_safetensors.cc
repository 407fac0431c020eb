// Hugging Face directory → LoadedModel: hyper-parameters from config.json, weights as views into
// the mapped *.safetensors shards, tokenizer from tokenizer.json.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <glog/logging.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "dd/kernels/cpu_ops.h"
#include "decode-worker/model/safetensors.h"
#include "decode-worker/model/weights.h"

namespace dd::model {
namespace {

using nlohmann::json;

// Typed access to the fields of one JSON object of config.json; errors name the file and the
// field (`prefix` names a nested object, e.g. "rope_scaling."). A null field counts as absent.
class ConfigFields {
 public:
  ConfigFields(const json& obj, const std::string& path, std::string prefix = "")
      : obj_(obj), path_(path), prefix_(std::move(prefix)) {}

  bool Has(const char* field) const { return obj_.contains(field) && !obj_[field].is_null(); }

  absl::StatusOr<int64_t> Int(const char* field) const {
    if (!Has(field)) return Missing(field);
    const json& v = obj_[field];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX)) {
      return WrongType(field, "an integer");
    }
    return v.get<int64_t>();
  }
  absl::StatusOr<double> Float(const char* field) const {
    if (!Has(field)) return Missing(field);
    if (!obj_[field].is_number()) return WrongType(field, "a number");
    return obj_[field].get<double>();
  }
  absl::StatusOr<std::string> String(const char* field) const {
    if (!Has(field)) return Missing(field);
    if (!obj_[field].is_string()) return WrongType(field, "a string");
    return obj_[field].get<std::string>();
  }
  absl::StatusOr<bool> Bool(const char* field) const {
    if (!Has(field)) return Missing(field);
    if (!obj_[field].is_boolean()) return WrongType(field, "a boolean");
    return obj_[field].get<bool>();
  }
  absl::StatusOr<int64_t> IntOr(const char* field, int64_t def) const { return Has(field) ? Int(field) : def; }
  absl::StatusOr<double> FloatOr(const char* field, double def) const { return Has(field) ? Float(field) : def; }
  absl::StatusOr<bool> BoolOr(const char* field, bool def) const { return Has(field) ? Bool(field) : def; }

  absl::Status Invalid(const char* field, std::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": field '", prefix_, field, "' ", std::string(why)));
  }
  absl::Status Unsupported(const char* field, std::string_view why) const {
    return absl::UnimplementedError(absl::StrCat(path_, ": field '", prefix_, field, "' ", std::string(why)));
  }

 private:
  absl::Status Missing(const char* field) const { return Invalid(field, "is missing"); }
  absl::Status WrongType(const char* field, const char* want) const {
    return Invalid(field, absl::StrCat("must be ", want, ", got ", obj_[field].dump()));
  }

  const json& obj_;
  const std::string& path_;
  std::string prefix_;
};

absl::StatusOr<json> ReadJsonObject(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  std::ifstream in(path);
  if (!in) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open"));
  std::stringstream buf;
  buf << in.rdbuf();
  json j = json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

absl::StatusOr<Arch> ReadArch(const ConfigFields& f, const json& j, const std::string& path) {
  std::string name;
  if (f.Has("architectures")) {
    const json& a = j["architectures"];
    if (!a.is_array() || a.empty() || !a[0].is_string()) {
      return f.Invalid("architectures", "must be a non-empty array of strings");
    }
    name = a[0].get<std::string>();
    if (name == "LlamaForCausalLM") return Arch::kLlama;
    if (name == "Qwen2ForCausalLM") return Arch::kQwen2;
  } else {
    ASSIGN_OR_RETURN(name, f.String("model_type"));
    if (name == "llama") return Arch::kLlama;
    if (name == "qwen2") return Arch::kQwen2;
  }
  return absl::UnimplementedError(absl::StrCat(path, ": architecture '", name,
                                               "' is not supported (LlamaForCausalLM, Qwen2ForCausalLM)"));
}

// HF rope_scaling → llama-3 frequency factors or a linear scale; rope_theta must be set in c.
absl::Status ReadRopeScaling(const json& j, const std::string& path, double theta, ModelConfig& c) {
  std::vector<float> factors;
  double linear = 1.0;
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    if (!rs.is_object()) return ConfigFields(j, path).Invalid("rope_scaling", "must be an object or null");
    const ConfigFields s(rs, path, "rope_scaling.");
    const char* type_field = s.Has("rope_type") ? "rope_type" : "type";
    ASSIGN_OR_RETURN(std::string type, s.String(type_field));
    if (type == "llama3") {
      ASSIGN_OR_RETURN(double factor, s.Float("factor"));
      ASSIGN_OR_RETURN(double low, s.Float("low_freq_factor"));
      ASSIGN_OR_RETURN(double high, s.Float("high_freq_factor"));
      ASSIGN_OR_RETURN(double orig, s.Float("original_max_position_embeddings"));
      if (!(factor > 0)) return s.Invalid("factor", "must be > 0");
      if (!(low > 0) || !(high > low)) return s.Invalid("high_freq_factor", "must exceed low_freq_factor > 0");
      if (!(orig > 0)) return s.Invalid("original_max_position_embeddings", "must be > 0");
      factors = Llama3FreqFactors(theta, c.rope_dim, factor, low, high, orig);
    } else if (type == "linear") {
      ASSIGN_OR_RETURN(linear, s.Float("factor"));
      if (!(linear > 0)) return s.Invalid("factor", "must be > 0");
    } else if (type != "default") {  // transformers writes "default" for no scaling
      return s.Unsupported(type_field, absl::StrCat("'", type, "' is not supported (llama3, linear)"));
    }
  }
  c.inv_freq = RopeInvFreq(theta, c.rope_dim, factors, linear);
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ReadConfig(const std::string& path) {
  ASSIGN_OR_RETURN(json j, ReadJsonObject(path));
  const ConfigFields f(j, path);
  ModelConfig c;
  ASSIGN_OR_RETURN(c.arch, ReadArch(f, j, path));
  c.arch_name = c.arch == Arch::kQwen2 ? "qwen2" : "llama";
  c.name = f.Has("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : c.arch_name;

  // Variants these weights cannot express: refuse rather than compute something else.
  ASSIGN_OR_RETURN(std::string act, f.Has("hidden_act") ? f.String("hidden_act") : std::string("silu"));
  if (act != "silu") return f.Unsupported("hidden_act", absl::StrCat("'", act, "' is not supported (silu)"));
  for (const char* field : {"attention_bias", "mlp_bias"}) {
    ASSIGN_OR_RETURN(bool on, f.BoolOr(field, false));
    if (on && c.arch == Arch::kLlama) return f.Unsupported(field, "true is not supported");
  }
  ASSIGN_OR_RETURN(bool swa, f.BoolOr("use_sliding_window", false));
  if (swa) return f.Unsupported("use_sliding_window", "true is not supported");

  ASSIGN_OR_RETURN(c.n_embd, f.Int("hidden_size"));
  ASSIGN_OR_RETURN(c.n_ff, f.Int("intermediate_size"));
  ASSIGN_OR_RETURN(c.n_layer, f.Int("num_hidden_layers"));
  ASSIGN_OR_RETURN(c.n_head, f.Int("num_attention_heads"));
  if (c.n_head <= 0) return f.Invalid("num_attention_heads", "must be > 0");
  ASSIGN_OR_RETURN(c.n_head_kv, f.IntOr("num_key_value_heads", c.n_head));
  if (!f.Has("head_dim") && c.n_embd % c.n_head != 0) {
    return f.Invalid("hidden_size", "must be a multiple of num_attention_heads when head_dim is absent");
  }
  ASSIGN_OR_RETURN(c.head_dim, f.IntOr("head_dim", c.n_embd / c.n_head));
  ASSIGN_OR_RETURN(double eps, f.Float("rms_norm_eps"));
  c.norm_eps = static_cast<float>(eps);
  ASSIGN_OR_RETURN(c.n_ctx_train, f.Int("max_position_embeddings"));
  ASSIGN_OR_RETURN(c.n_vocab, f.Int("vocab_size"));
  ASSIGN_OR_RETURN(c.tied_embeddings, f.BoolOr("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(double theta, f.FloatOr("rope_theta", 10000.0));
  if (!(theta > 0)) return f.Invalid("rope_theta", "must be > 0");

  c.rope_neox = true;  // HF checkpoints keep q/k in rotate-half layout
  c.rope_dim = c.head_dim;
  RETURN_IF_ERROR(Annotate(c.CheckShape(), path));  // before anything is sized from it
  if (c.rope_dim % 2 == 0) RETURN_IF_ERROR(ReadRopeScaling(j, path, theta, c));
  c.layer_is_swa.assign(c.n_layer, false);
  c.attn_scale = c.head_dim > 0 ? 1.0f / std::sqrt(static_cast<float>(c.head_dim)) : 0.0f;
  c.qkv_bias = c.arch == Arch::kQwen2;
  RETURN_IF_ERROR(Annotate(c.Validate(), path));
  return c;
}

// Binds tensors of a SafetensorsDir to the shapes the config requires.
class Binder {
 public:
  Binder(const SafetensorsDir& st, LoadedModel& m) : st_(st), m_(m) {}

  absl::StatusOr<kernels::WeightView> Matrix(const std::string& name, int64_t rows, int64_t cols) {
    ASSIGN_OR_RETURN(const SafetensorsTensor* t, Find(name, {rows, cols}));
    ASSIGN_OR_RETURN(kernels::DType type, t->KernelDType());
    ASSIGN_OR_RETURN(int64_t row_bytes, kernels::RowBytes(type, cols));
    const uint8_t* data = t->data;
    const size_t align = type == kernels::DType::kF32 ? 4 : 2;
    if (reinterpret_cast<uintptr_t>(data) % align != 0) {
      // Kernels read elements in place; give them an aligned copy (unusual files only).
      auto copy = std::make_shared<std::vector<float>>((t->n_bytes + 3) / 4);
      std::memcpy(copy->data(), data, t->n_bytes);
      data = reinterpret_cast<const uint8_t*>(copy->data());
      m_.storage.push_back(std::move(copy));
    }
    return kernels::WeightView{type, data, rows, cols, row_bytes};
  }

  absl::StatusOr<std::vector<float>> Vector(const std::string& name, int64_t n) {
    ASSIGN_OR_RETURN(const SafetensorsTensor* t, Find(name, {n}));
    ASSIGN_OR_RETURN(kernels::DType type, t->KernelDType());
    std::vector<float> out(n);
    kernels::DequantizeRow(type, t->data, out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(out[i])) {
        return absl::InvalidArgumentError(absl::StrCat(*t->file, ": tensor '", name, "': element ", i,
                                                       " is not finite"));
      }
    }
    return out;
  }

  void WarnAboutUnused() const {
    std::vector<std::string> unused;
    for (const auto& file : st_.files()) {
      for (const auto& [name, t] : file->tensors()) {
        if (!used_.count(name)) unused.push_back(name);
      }
    }
    if (unused.empty()) return;
    if (unused.size() > 5) unused.resize(5);
    LOG(WARNING) << st_.dir() << ": " << st_.num_tensors() - used_.size()
                 << " tensors are not used by the model, e.g. " << absl::StrJoin(unused, ", ");
  }

 private:
  absl::StatusOr<const SafetensorsTensor*> Find(const std::string& name, const std::vector<int64_t>& want) {
    ASSIGN_OR_RETURN(const SafetensorsTensor* t, st_.FindTensor(name));
    if (t->shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(*t->file, ": tensor '", name, "': shape [",
                                                     absl::StrJoin(t->shape, ", "), "] but config.json needs [",
                                                     absl::StrJoin(want, ", "), "]"));
    }
    used_.insert(name);
    return t;
  }

  const SafetensorsDir& st_;
  LoadedModel& m_;
  std::set<std::string> used_;
};

absl::Status BindWeights(const SafetensorsDir& st, LoadedModel& m) {
  const ModelConfig& c = m.config;
  ModelWeights& w = m.weights;
  Binder b(st, m);
  ASSIGN_OR_RETURN(w.token_embd, b.Matrix("model.embed_tokens.weight", c.n_vocab, c.n_embd));
  if (c.tied_embeddings) {
    w.output = w.token_embd;
  } else {
    ASSIGN_OR_RETURN(w.output, b.Matrix("lm_head.weight", c.n_vocab, c.n_embd));
  }
  ASSIGN_OR_RETURN(w.output_norm, b.Vector("model.norm.weight", c.n_embd));
  const int64_t q_dim = c.n_head * c.head_dim, kv_dim = c.n_head_kv * c.head_dim;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights L;
    ASSIGN_OR_RETURN(L.attn_norm, b.Vector(p + "input_layernorm.weight", c.n_embd));
    ASSIGN_OR_RETURN(L.wq, b.Matrix(p + "self_attn.q_proj.weight", q_dim, c.n_embd));
    ASSIGN_OR_RETURN(L.wk, b.Matrix(p + "self_attn.k_proj.weight", kv_dim, c.n_embd));
    ASSIGN_OR_RETURN(L.wv, b.Matrix(p + "self_attn.v_proj.weight", kv_dim, c.n_embd));
    ASSIGN_OR_RETURN(L.wo, b.Matrix(p + "self_attn.o_proj.weight", c.n_embd, q_dim));
    if (c.qkv_bias) {
      ASSIGN_OR_RETURN(L.bq, b.Vector(p + "self_attn.q_proj.bias", q_dim));
      ASSIGN_OR_RETURN(L.bk, b.Vector(p + "self_attn.k_proj.bias", kv_dim));
      ASSIGN_OR_RETURN(L.bv, b.Vector(p + "self_attn.v_proj.bias", kv_dim));
    }
    // HF's post_attention_layernorm is the norm in front of the MLP.
    ASSIGN_OR_RETURN(L.ffn_norm, b.Vector(p + "post_attention_layernorm.weight", c.n_embd));
    ASSIGN_OR_RETURN(L.w_gate, b.Matrix(p + "mlp.gate_proj.weight", c.n_ff, c.n_embd));
    ASSIGN_OR_RETURN(L.w_up, b.Matrix(p + "mlp.up_proj.weight", c.n_ff, c.n_embd));
    ASSIGN_OR_RETURN(L.w_down, b.Matrix(p + "mlp.down_proj.weight", c.n_embd, c.n_ff));
    w.layers.push_back(std::move(L));
  }
  b.WarnAboutUnused();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadedModel>> LoadSafetensorsDir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat(dir, ": no such directory"));
  auto m = std::make_unique<LoadedModel>();
  m->source_path = dir;
  m->format = "safetensors";
  ASSIGN_OR_RETURN(m->config, ReadConfig((fs::path(dir) / "config.json").string()));

  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsDir> opened, SafetensorsDir::Open(dir));
  std::shared_ptr<SafetensorsDir> st = std::move(opened);
  m->storage.push_back(st);
  RETURN_IF_ERROR(BindWeights(*st, *m));

  const std::string tok_path = (fs::path(dir) / "tokenizer.json").string();
  if (!fs::exists(tok_path, ec)) return absl::NotFoundError(absl::StrCat(tok_path, ": no such file"));
  ASSIGN_OR_RETURN(TokenizerSpec spec, Tokenizer::SpecFromHfTokenizerJson(tok_path));
  auto tok = Tokenizer::Create(std::move(spec));
  if (!tok.ok()) return Annotate(tok.status(), tok_path);
  m->tokenizer = std::move(*tok);
  // HF pads vocab_size beyond the tokenizer (e.g. Qwen2); only the reverse is an error.
  if (m->tokenizer->vocab_size() > m->config.n_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(tok_path, ": ", m->tokenizer->vocab_size(),
                                                   " tokens but config.json vocab_size is ", m->config.n_vocab));
  }
  return m;
}

}  // namespace dd::model
