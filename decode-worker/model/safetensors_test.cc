#include "decode-worker/model/safetensors.h"

#include <unistd.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "decode-worker/model/weights.h"

namespace dd::model {
namespace {

using ::testing::HasSubstr;
using kernels::DType;
using nlohmann::json;
namespace fs = std::filesystem;

struct FakeTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// Small multiples of 1/8: exact in F32, F16 and BF16.
float Val(int64_t i, int seed) { return static_cast<float>((i * 7 + seed) % 32 - 16) * 0.125f; }

FakeTensor Make(std::string name, std::string dtype, std::vector<int64_t> shape, int seed = 0) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::string b;
  for (int64_t i = 0; i < n; ++i) {
    const float v = Val(i, seed);
    const uint16_t h = dtype == "F16" ? kernels::F32ToF16(v) : std::bit_cast<uint32_t>(v) >> 16;
    if (dtype == "F32") b.append(reinterpret_cast<const char*>(&v), 4);
    else if (dtype == "F16" || dtype == "BF16") b.append(reinterpret_cast<const char*>(&h), 2);
    else b.append(8, '\0');  // I64
  }
  return {std::move(name), std::move(dtype), std::move(shape), std::move(b)};
}

std::string WithLength(uint64_t n, const std::string& rest) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s + rest;
}

std::string Raw(const json& header, const std::string& data) {
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  return WithLength(h.size(), h + data);
}

std::string Safetensors(const std::vector<FakeTensor>& ts, json header = json::object()) {
  std::string data;
  for (const FakeTensor& t : ts) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape},
                      {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  return Raw(header, data);
}

std::string Utf8(uint32_t cp) {
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

// A GPT-2 byte-level BPE tokenizer.json whose vocabulary is the 256 byte tokens, no merges.
json ByteTokenizerJson() {
  json vocab = json::object();
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    vocab[Utf8(printable ? b : next++)] = b;
  }
  return {{"version", "1.0"}, {"added_tokens", json::array()}, {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"post_processor", nullptr}, {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}, {"byte_fallback", false}}}};
}

json LlamaConfig() {
  return {{"architectures", json::array({"LlamaForCausalLM"})}, {"model_type", "llama"}, {"hidden_size", 8},
          {"intermediate_size", 12}, {"num_hidden_layers", 2}, {"num_attention_heads", 2},
          {"num_key_value_heads", 1}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
          {"max_position_embeddings", 128}, {"vocab_size", 256}, {"hidden_act", "silu"}};
}

// Every tensor the config needs; seeds make each tensor's values distinct.
std::vector<FakeTensor> ModelTensors(const json& c, bool qkv_bias = false) {
  const int64_t e = c["hidden_size"], ff = c["intermediate_size"], vocab = c["vocab_size"];
  const int64_t hd = e / c["num_attention_heads"].get<int64_t>();
  const int64_t q = hd * c["num_attention_heads"].get<int64_t>(), kv = hd * c["num_key_value_heads"].get<int64_t>();
  std::vector<FakeTensor> v = {Make("model.embed_tokens.weight", "F16", {vocab, e}, 1),
                               Make("lm_head.weight", "F32", {vocab, e}, 2), Make("model.norm.weight", "F32", {e}, 3)};
  for (int l = 0; l < c["num_hidden_layers"]; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (FakeTensor t : {Make(p + "input_layernorm.weight", "BF16", {e}, 4 + l),
                         Make(p + "self_attn.q_proj.weight", "BF16", {q, e}, 6),
                         Make(p + "self_attn.k_proj.weight", "F32", {kv, e}, 7),
                         Make(p + "self_attn.v_proj.weight", "F32", {kv, e}, 8),
                         Make(p + "self_attn.o_proj.weight", "F32", {e, q}, 9),
                         Make(p + "post_attention_layernorm.weight", "F32", {e}, 10),
                         Make(p + "mlp.gate_proj.weight", "F32", {ff, e}, 11),
                         Make(p + "mlp.up_proj.weight", "F32", {ff, e}, 12),
                         Make(p + "mlp.down_proj.weight", "F32", {e, ff}, 13)}) {
      v.push_back(std::move(t));
    }
    if (qkv_bias) {
      v.push_back(Make(p + "self_attn.q_proj.bias", "F32", {q}, 14));
      v.push_back(Make(p + "self_attn.k_proj.bias", "F32", {kv}, 15));
      v.push_back(Make(p + "self_attn.v_proj.bias", "F32", {kv}, 16));
    }
  }
  return v;
}

std::vector<FakeTensor> Without(std::vector<FakeTensor> v, const std::string& name) {
  std::erase_if(v, [&](const FakeTensor& t) { return t.name == name; });
  return v;
}

void ExpectError(const absl::Status& s, absl::StatusCode code, const std::vector<std::string>& parts) {
  EXPECT_EQ(s.code(), code) << s;
  for (const std::string& p : parts) EXPECT_THAT(std::string(s.message()), HasSubstr(p));
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / ("st_" + std::string(info->name()) + "_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  void Write(const std::string& name, const std::string& bytes) const {
    std::ofstream(Path(name), std::ios::binary) << bytes;
  }
  // config.json, tokenizer.json and the tensors split round-robin over `shards` files.
  void WriteModel(const json& config, const std::vector<FakeTensor>& tensors, int shards = 1) const {
    Write("config.json", config.dump());
    Write("tokenizer.json", ByteTokenizerJson().dump());
    if (shards == 1) return Write("model.safetensors", Safetensors(tensors));
    json weight_map = json::object();
    for (int s = 0; s < shards; ++s) {
      const std::string file = "model-0000" + std::to_string(s + 1) + "-of-0000" + std::to_string(shards) + ".safetensors";
      std::vector<FakeTensor> part;
      for (size_t i = s; i < tensors.size(); i += shards) {
        part.push_back(tensors[i]);
        weight_map[tensors[i].name] = file;
      }
      Write(file, Safetensors(part));
    }
    Write("model.safetensors.index.json", json{{"metadata", json::object()}, {"weight_map", weight_map}}.dump());
  }
  absl::StatusOr<std::unique_ptr<LoadedModel>> Load() const { return LoadSafetensorsDir(dir_.string()); }

  fs::path dir_;
};

TEST_F(SafetensorsTest, LoadsTinyLlamaWithViewsAndConvertedVectors) {
  WriteModel(LlamaConfig(), ModelTensors(LlamaConfig()));
  auto m = Load();
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config;
  EXPECT_EQ(c.arch, Arch::kLlama);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_head_kv, 1);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_EQ(c.n_ff, 12);
  EXPECT_EQ(c.n_ctx_train, 128);
  EXPECT_TRUE(c.rope_neox);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_FLOAT_EQ(c.attn_scale, 0.5f);
  ASSERT_EQ(c.inv_freq.size(), 2u);
  EXPECT_FLOAT_EQ(c.inv_freq[1], 0.01f);  // 10000^(-2/4)
  EXPECT_EQ((*m)->format, "safetensors");
  EXPECT_EQ((*m)->source_path, dir_.string());
  EXPECT_EQ((*m)->tokenizer->vocab_size(), 256);

  const ModelWeights& w = (*m)->weights;
  EXPECT_EQ(w.token_embd.type, DType::kF16);
  EXPECT_EQ(w.token_embd.rows, 256);
  EXPECT_EQ(w.token_embd.cols, 8);
  EXPECT_EQ(w.token_embd.row_bytes, 16);
  uint16_t h;
  std::memcpy(&h, w.token_embd.data + 5 * 16 + 3 * 2, 2);
  EXPECT_EQ(kernels::F16ToF32(h), Val(5 * 8 + 3, 1));
  EXPECT_EQ(w.output.type, DType::kF32);
  float f;
  std::memcpy(&f, w.output.data + 7 * 32 + 4 * 4, 4);
  EXPECT_EQ(f, Val(7 * 8 + 4, 2));
  ASSERT_EQ(w.layers.size(), 2u);
  const LayerWeights& L = w.layers[1];
  EXPECT_EQ(L.wq.type, DType::kBF16);
  EXPECT_EQ(L.wq.rows, 8);
  std::memcpy(&h, L.wq.data + 2 * L.wq.row_bytes + 7 * 2, 2);
  EXPECT_EQ(kernels::BF16ToF32(h), Val(2 * 8 + 7, 6));
  EXPECT_EQ(L.wk.rows, 4);
  EXPECT_EQ(L.wk.cols, 8);
  EXPECT_EQ(L.w_down.rows, 8);
  EXPECT_EQ(L.w_down.cols, 12);
  ASSERT_EQ(L.attn_norm.size(), 8u);
  ASSERT_EQ(L.ffn_norm.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(L.attn_norm[i], Val(i, 5)) << i;  // BF16 → f32
    EXPECT_EQ(L.ffn_norm[i], Val(i, 10)) << i;  // post_attention_layernorm
  }
  EXPECT_TRUE(L.bq.empty());
}

TEST_F(SafetensorsTest, TiedEmbeddingsNeedNoLmHead) {
  json c = LlamaConfig();
  c["tie_word_embeddings"] = true;
  WriteModel(c, Without(ModelTensors(c), "lm_head.weight"));
  auto m = Load();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->weights.output.data, (*m)->weights.token_embd.data);
}

TEST_F(SafetensorsTest, LoadsShardedQwen2WithBiases) {
  json c = LlamaConfig();
  c["architectures"] = json::array({"Qwen2ForCausalLM"});
  c["vocab_size"] = 300;  // padded beyond the tokenizer, as Qwen2 does
  c["use_sliding_window"] = false;
  WriteModel(c, ModelTensors(c, /*qkv_bias=*/true), /*shards=*/3);
  auto m = Load();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->config.arch, Arch::kQwen2);
  EXPECT_TRUE((*m)->config.qkv_bias);
  EXPECT_EQ((*m)->weights.token_embd.rows, 300);
  ASSERT_EQ((*m)->weights.layers[0].bk.size(), 4u);
  EXPECT_EQ((*m)->weights.layers[0].bk[3], Val(3, 15));
}

TEST_F(SafetensorsTest, RopeScaling) {
  json c = LlamaConfig();
  // head_dim 4: frequencies 1 (wavelength 6.3 < 64/4, kept) and 0.01 (wavelength 628 > 64/1, / 8).
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  WriteModel(c, ModelTensors(c));
  auto m = Load();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FLOAT_EQ((*m)->config.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ((*m)->config.inv_freq[1], 0.01f / 8);

  c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  Write("config.json", c.dump());
  m = Load();
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FLOAT_EQ((*m)->config.inv_freq[1], 0.005f);

  c["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}};
  Write("config.json", c.dump());
  ExpectError(Load().status(), absl::StatusCode::kUnimplemented, {"config.json", "rope_scaling.type", "yarn"});
}

TEST_F(SafetensorsTest, MalformedFilesAreRejectedNamingTensorAndField) {
  const std::string full = Safetensors({Make("w", "F32", {4})});
  const std::string d24(24, '\0');
  auto entry = [](json shape, json offsets) {
    return json{{"dtype", "F32"}, {"shape", shape}, {"data_offsets", offsets}};
  };
  const struct {
    std::string bytes;
    std::vector<std::string> parts;
  } cases[] = {
      {"\x05\x00\x00", {"too short"}},
      {full.substr(0, full.size() - 4), {"'w'", "data_offsets", "past the end"}},
      {WithLength(1000, "{}"), {"header length 1000", "past the end"}},
      {WithLength(200u << 20, "{}"), {"exceeds the limit"}},
      {WithLength(9, "{not json"), {"not valid JSON"}},
      {WithLength(5, "[1,2]"), {"not a JSON object"}},
      {Raw({{"w", entry({2}, {0, 16})}}, d24.substr(0, 8)), {"'w'", "data_offsets", "past the end"}},
      {Raw({{"w", entry({2, 3}, {0, 20})}}, d24), {"'w'", "shape [2, 3]", "6 x 4"}},
      {Raw({{"w", entry({1}, {8, 4})}}, d24), {"'w'", "begin > end"}},
      {Raw({{"w", entry({-2}, {0, 8})}}, d24), {"'w'", "'shape'"}},
      {Raw({{"w", entry({2}, {0})}}, d24), {"'w'", "'data_offsets'"}},
      {Raw({{"w", {{"shape", {2}}, {"data_offsets", {0, 8}}}}}, d24), {"'w'", "'dtype'"}},
      {Raw({{"a", entry({2}, {0, 8})}, {"b", entry({2}, {4, 12})}}, d24), {"'b'", "overlaps", "'a'"}},
      {Raw({{"__metadata__", 5}}, ""), {"__metadata__"}},
  };
  for (const auto& tc : cases) {
    Write("bad.safetensors", tc.bytes);
    auto f = SafetensorsFile::Open(Path("bad.safetensors"));
    SCOPED_TRACE(tc.parts[0]);
    ASSERT_FALSE(f.ok());
    std::vector<std::string> parts = tc.parts;
    parts.push_back(Path("bad.safetensors"));
    ExpectError(f.status(), absl::StatusCode::kInvalidArgument, parts);
  }
}

TEST_F(SafetensorsTest, MetadataAndUnusedUnsupportedDtypesAreAccepted) {
  Write("x.safetensors", Safetensors({Make("ids", "I64", {3}), Make("w", "F32", {2})},
                                     {{"__metadata__", {{"format", "pt"}}}}));
  auto f = SafetensorsFile::Open(Path("x.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->tensors().size(), 2u);
  ASSERT_TRUE((*f)->FindTensor("ids").ok());
  EXPECT_EQ((*(*f)->FindTensor("ids"))->n_bytes, 24);
  ExpectError((*(*f)->FindTensor("ids"))->KernelDType().status(), absl::StatusCode::kUnimplemented, {"'ids'", "I64"});
  EXPECT_EQ((*f)->FindTensor("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SafetensorsTest, UsedUnsupportedDtypeFailsTheLoad) {
  std::vector<FakeTensor> ts = Without(ModelTensors(LlamaConfig()), "model.norm.weight");
  ts.push_back(Make("model.norm.weight", "I64", {8}));
  WriteModel(LlamaConfig(), ts);
  ExpectError(Load().status(), absl::StatusCode::kUnimplemented, {"model.norm.weight", "I64"});
}

TEST_F(SafetensorsTest, ShardErrors) {
  const std::vector<FakeTensor> ts = ModelTensors(LlamaConfig());
  WriteModel(LlamaConfig(), ts, 2);
  Write("extra.safetensors", Safetensors({ts[0]}));
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"model.embed_tokens.weight", "extra.safetensors"});

  fs::remove(Path("extra.safetensors"));
  fs::remove(Path("model-00002-of-00002.safetensors"));  // the index still names it
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"index.json", "model-00002-of-00002"});
}

TEST_F(SafetensorsTest, BadModelContentIsRejected) {
  const json good = LlamaConfig();
  auto with = [&](const char* field, json value) {
    json c = good;
    if (value.is_null()) c.erase(field); else c[field] = value;
    return c;
  };
  WriteModel(good, Without(ModelTensors(good), "model.layers.1.mlp.down_proj.weight"));
  ExpectError(Load().status(), absl::StatusCode::kNotFound, {"model.layers.1.mlp.down_proj.weight"});

  std::vector<FakeTensor> ts = Without(ModelTensors(good), "model.layers.0.self_attn.k_proj.weight");
  ts.push_back(Make("model.layers.0.self_attn.k_proj.weight", "F32", {8, 8}));
  WriteModel(good, ts);
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument,
              {"model.layers.0.self_attn.k_proj.weight", "[8, 8]", "needs [4, 8]"});

  WriteModel(with("hidden_size", nullptr), ModelTensors(good));
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"config.json", "hidden_size", "missing"});
  WriteModel(with("num_hidden_layers", "two"), ModelTensors(good));
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"config.json", "num_hidden_layers"});
  WriteModel(with("architectures", json::array({"MistralForCausalLM"})), ModelTensors(good));
  ExpectError(Load().status(), absl::StatusCode::kUnimplemented, {"config.json", "MistralForCausalLM"});
  json qwen = with("architectures", json::array({"Qwen2ForCausalLM"}));
  qwen["use_sliding_window"] = true;
  WriteModel(qwen, ModelTensors(good, true));
  ExpectError(Load().status(), absl::StatusCode::kUnimplemented, {"use_sliding_window"});

  // Shapes a file claims are bounded before anything is sized from them (the GGUF fuzzer found a
  // 2^31 RoPE dimension allocating 4 GiB before validation; the same path exists here).
  WriteModel(with("head_dim", int64_t{1} << 31), ModelTensors(good));
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"config.json", "head_dim = 2147483648", "1..1024"});
  WriteModel(with("num_hidden_layers", int64_t{1} << 40), ModelTensors(good));
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"n_layer = 1099511627776"});
  WriteModel(with("num_key_value_heads", 3), ModelTensors(good));
  ExpectError(Load().status(), absl::StatusCode::kInvalidArgument, {"n_head_kv = 3"});

  WriteModel(good, ModelTensors(good));
  fs::remove(Path("tokenizer.json"));
  ExpectError(Load().status(), absl::StatusCode::kNotFound, {"tokenizer.json"});
  fs::remove(Path("config.json"));
  ExpectError(Load().status(), absl::StatusCode::kNotFound, {"config.json"});
}

}  // namespace
}  // namespace dd::model
