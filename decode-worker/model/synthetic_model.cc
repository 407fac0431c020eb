#include "decode-worker/model/synthetic_model.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "decode-worker/model/gguf.h"
#include "decode-worker/model/model_config.h"
#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/unicode_data.h"

namespace dd::model {
namespace {

using kernels::DType;

constexpr int64_t kAlignment = 32;

// Where a block type keeps its f16 scale `d` (and its offset term `m`, -1: none), and what
// one unit of d gives: the weights' standard deviation over uniformly random quant bytes, and
// the m that centres them (w = d·sc·q − dmin·m for Q4_K, d·q + m for Q4_1).
struct BlockScale {
  DType type;
  int d_offset, m_offset;
  double std_per_d, m_per_d;
};
constexpr BlockScale kBlockScales[] = {
    {DType::kQ4_K, 0, 2, 257.0, 7.5},   // 6-bit scales and mins, 4-bit quants
    {DType::kQ6_K, 208, -1, 1366.0, 0},  // int8 scales, quants − 32
    {DType::kQ8_0, 0, -1, 73.9, 0},
    {DType::kQ4_0, 0, -1, 4.64, 0},      // quants − 8
    {DType::kQ4_1, 0, 2, 4.61, -7.5},
    {DType::kQ5_0, 0, -1, 9.25, 0},      // quants − 16
};

const BlockScale* ScaleOf(DType t) {
  for (const BlockScale& b : kBlockScales) {
    if (b.type == t) return &b;
  }
  return nullptr;
}

struct Tensor {
  std::string name;
  DType type;
  int64_t cols = 0, rows = 1;  // ggml ne0, ne1 (rows 1 and `vector`: one dimension)
  bool vector = false;
  std::vector<float> values;   // F32 tensors' contents (empty: random blocks)
  int64_t bytes = 0;
  uint64_t offset = 0;         // in the data section
};

// The GGUF header, built in memory.
class Header {
 public:
  void Str(absl::string_view s) {
    U64(s.size());
    out_.append(s.data(), s.size());
  }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Key(absl::string_view key, GgufValueType type) {
    Str(key);
    U32(static_cast<uint32_t>(type));
    ++keys_;
  }
  void KvStr(absl::string_view key, absl::string_view v) {
    Key(key, GgufValueType::kString);
    Str(v);
  }
  void KvU32(absl::string_view key, int64_t v) {
    Key(key, GgufValueType::kU32);
    U32(static_cast<uint32_t>(v));
  }
  void KvF32(absl::string_view key, double v) {
    Key(key, GgufValueType::kF32);
    const float f = static_cast<float>(v);
    Raw(&f, 4);
  }
  void KvBool(absl::string_view key, bool v) {
    Key(key, GgufValueType::kBool);
    const uint8_t b = v ? 1 : 0;
    Raw(&b, 1);
  }
  void KvStrings(absl::string_view key, const std::vector<std::string>& v) {
    Key(key, GgufValueType::kArray);
    U32(static_cast<uint32_t>(GgufValueType::kString));
    U64(v.size());
    for (const std::string& s : v) Str(s);
  }
  void KvI32s(absl::string_view key, const std::vector<int32_t>& v) {
    Key(key, GgufValueType::kArray);
    U32(static_cast<uint32_t>(GgufValueType::kI32));
    U64(v.size());
    Raw(v.data(), v.size() * 4);
  }
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string& bytes() { return out_; }
  uint64_t keys() const { return keys_; }

 private:
  std::string out_;
  uint64_t keys_ = 0;
};

// ModelConfig's checks on the shape, before anything is sized from it.
absl::Status CheckShape(const SyntheticShape& s) {
  ModelConfig c;
  c.n_layer = s.n_layer, c.n_embd = s.n_embd, c.n_head = s.n_head, c.n_head_kv = s.n_head_kv;
  c.head_dim = s.head_dim, c.n_ff = s.n_ff, c.n_vocab = s.n_vocab, c.n_ctx_train = s.n_ctx, c.rope_dim = s.head_dim;
  RETURN_IF_ERROR(c.CheckShape());
  if (s.arch != "llama" && s.arch != "gemma3") {
    return absl::InvalidArgumentError(absl::StrCat("synthetic shape '", s.name, "': arch '", s.arch,
                                                   "' is not llama or gemma3"));
  }
  if (s.n_vocab < 257 || s.n_head <= 0 || s.n_head_kv <= 0 || s.n_head % s.n_head_kv != 0 || s.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic shape '", s.name,
                                                   "': needs n_vocab > 256, n_head a multiple of n_head_kv > 0 and "
                                                   "an even head_dim"));
  }
  for (DType t : {s.matrices, s.fallback, s.embedding, s.output}) {
    if (ScaleOf(t) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("synthetic shape '", s.name, "': block type ",
                                                     static_cast<int>(t),
                                                     " is not one of Q4_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0"));
    }
  }
  return absl::OkStatus();
}

// The type a matrix with `cols` inputs gets: `want`, or the fallback where rows would not hold
// whole blocks of it (then the fallback's blocks must fit).
absl::StatusOr<DType> MatrixType(const SyntheticShape& s, DType want, int64_t cols) {
  for (DType t : {want, s.fallback}) {
    ASSIGN_OR_RETURN(const kernels::DTypeInfo info, kernels::GetDTypeInfo(static_cast<uint32_t>(t)));
    if (cols % info.block_elems == 0) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat("synthetic shape '", s.name, "': rows of ", cols,
                                                 " elements hold whole blocks of neither block type"));
}

absl::StatusOr<std::vector<Tensor>> TensorsOf(const SyntheticShape& s) {
  std::vector<Tensor> out;
  auto matrix = [&](std::string name, DType want, int64_t cols, int64_t rows) -> absl::Status {
    ASSIGN_OR_RETURN(const DType t, MatrixType(s, want, cols));
    out.push_back({std::move(name), t, cols, rows, false, {}});
    return absl::OkStatus();
  };
  auto vector = [&](std::string name, std::vector<float> values) {
    const int64_t n = static_cast<int64_t>(values.size());
    out.push_back({std::move(name), DType::kF32, n, 1, true, std::move(values)});
  };
  const std::vector<float> ones(s.n_embd, 1.0f), head_ones(s.head_dim, 1.0f);
  RETURN_IF_ERROR(matrix("token_embd.weight", s.embedding, s.n_embd, s.n_vocab));
  vector("output_norm.weight", ones);
  if (!s.tied) RETURN_IF_ERROR(matrix("output.weight", s.output, s.n_embd, s.n_vocab));
  if (s.llama3_rope) {
    vector("rope_freqs.weight", Llama3FreqFactors(s.rope_base, s.head_dim, 8.0, 1.0, 4.0, 8192.0));
  }
  const int64_t q_dim = s.n_head * s.head_dim, kv_dim = s.n_head_kv * s.head_dim;
  for (int64_t l = 0; l < s.n_layer; ++l) {
    const std::string p = absl::StrCat("blk.", l, ".");
    vector(p + "attn_norm.weight", ones);
    RETURN_IF_ERROR(matrix(p + "attn_q.weight", s.matrices, s.n_embd, q_dim));
    RETURN_IF_ERROR(matrix(p + "attn_k.weight", s.matrices, s.n_embd, kv_dim));
    RETURN_IF_ERROR(matrix(p + "attn_v.weight", s.matrices, s.n_embd, kv_dim));
    RETURN_IF_ERROR(matrix(p + "attn_output.weight", s.matrices, q_dim, s.n_embd));
    vector(p + "ffn_norm.weight", ones);
    RETURN_IF_ERROR(matrix(p + "ffn_gate.weight", s.matrices, s.n_embd, s.n_ff));
    RETURN_IF_ERROR(matrix(p + "ffn_up.weight", s.matrices, s.n_embd, s.n_ff));
    RETURN_IF_ERROR(matrix(p + "ffn_down.weight", s.matrices, s.n_ff, s.n_embd));
    if (s.arch == "gemma3") {
      vector(p + "attn_q_norm.weight", head_ones);
      vector(p + "attn_k_norm.weight", head_ones);
      vector(p + "post_attention_norm.weight", ones);
      vector(p + "post_ffw_norm.weight", ones);
    }
  }
  uint64_t offset = 0;
  for (Tensor& t : out) {
    ASSIGN_OR_RETURN(const int64_t row, kernels::RowBytes(t.type, t.cols));
    t.bytes = row * t.rows;
    t.offset = offset;
    offset += (t.bytes + kAlignment - 1) / kAlignment * kAlignment;
  }
  return out;
}

std::string HeaderOf(const SyntheticShape& s, const std::vector<Tensor>& tensors) {
  Header kv;
  const std::string a = s.arch + ".";
  kv.KvStr("general.architecture", s.arch);
  kv.KvStr("general.name", absl::StrCat("synthetic ", s.name, " (random weights)"));
  kv.KvU32("general.alignment", kAlignment);
  kv.KvU32(a + "block_count", s.n_layer);
  kv.KvU32(a + "context_length", s.n_ctx);
  kv.KvU32(a + "embedding_length", s.n_embd);
  kv.KvU32(a + "feed_forward_length", s.n_ff);
  kv.KvU32(a + "attention.head_count", s.n_head);
  kv.KvU32(a + "attention.head_count_kv", s.n_head_kv);
  kv.KvU32(a + "attention.key_length", s.head_dim);
  kv.KvU32(a + "attention.value_length", s.head_dim);
  kv.KvF32(a + "attention.layer_norm_rms_epsilon", s.norm_eps);
  kv.KvF32(a + "rope.freq_base", s.rope_base);
  kv.KvU32(a + "rope.dimension_count", s.head_dim);
  if (s.arch == "gemma3" && s.sliding_window > 0) kv.KvU32(a + "attention.sliding_window", s.sliding_window);
  // One token per byte (GPT-2's printable mapping), end of text, then unused padding.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (int b = 0; b < 256; ++b) {
    unicode::AppendUtf8(internal::ByteToUnicode(static_cast<uint8_t>(b)), &tokens.emplace_back());
    types.push_back(static_cast<int32_t>(TokenType::kNormal));
  }
  tokens.push_back("<|endoftext|>");
  types.push_back(static_cast<int32_t>(TokenType::kControl));
  for (int64_t i = 257; i < s.n_vocab; ++i) {
    tokens.push_back(absl::StrCat("<unused_", i, ">"));
    types.push_back(static_cast<int32_t>(TokenType::kUnused));
  }
  kv.KvStr("tokenizer.ggml.model", "gpt2");
  kv.KvStr("tokenizer.ggml.pre", "gpt2");
  kv.KvStrings("tokenizer.ggml.tokens", tokens);
  kv.KvI32s("tokenizer.ggml.token_type", types);
  kv.KvU32("tokenizer.ggml.bos_token_id", 256);
  kv.KvU32("tokenizer.ggml.eos_token_id", 256);
  kv.KvBool("tokenizer.ggml.add_bos_token", false);

  Header h;
  h.Raw("GGUF", 4);
  h.U32(3);
  h.U64(tensors.size());
  h.U64(kv.keys());
  h.Raw(kv.bytes().data(), kv.bytes().size());
  for (const Tensor& t : tensors) {
    h.Str(t.name);
    h.U32(t.vector ? 1 : 2);
    h.U64(t.cols);
    if (!t.vector) h.U64(t.rows);
    h.U32(static_cast<uint32_t>(t.type));
    h.U64(t.offset);
  }
  h.bytes().resize((h.bytes().size() + kAlignment - 1) / kAlignment * kAlignment, '\0');
  return std::move(h.bytes());
}

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Random blocks of tensor `t`, written in pieces through `buf`; each block's scales set for
// weights of standard deviation 1/sqrt(cols).
absl::Status WriteBlocks(const Tensor& t, uint64_t seed, std::FILE* f, std::vector<uint8_t>& buf) {
  const BlockScale& sc = *ScaleOf(t.type);
  ASSIGN_OR_RETURN(const kernels::DTypeInfo info, kernels::GetDTypeInfo(static_cast<uint32_t>(t.type)));
  const double d = 1.0 / (sc.std_per_d * std::sqrt(static_cast<double>(t.cols)));
  const uint16_t d16 = kernels::F32ToF16(static_cast<float>(d));
  const uint16_t m16 = kernels::F32ToF16(static_cast<float>(d * sc.m_per_d));
  const int64_t per_piece = static_cast<int64_t>(buf.size()) / info.block_bytes;
  const int64_t blocks = t.bytes / info.block_bytes;
  uint64_t state = seed;
  for (int64_t b0 = 0; b0 < blocks; b0 += per_piece) {
    const int64_t n = std::min(per_piece, blocks - b0);
    const size_t bytes = static_cast<size_t>(n * info.block_bytes);
    for (size_t i = 0; i < bytes; i += 8) {
      const uint64_t r = SplitMix(state);
      std::memcpy(buf.data() + i, &r, std::min<size_t>(8, bytes - i));
    }
    for (int64_t b = 0; b < n; ++b) {
      uint8_t* block = buf.data() + b * info.block_bytes;
      std::memcpy(block + sc.d_offset, &d16, 2);
      if (sc.m_offset >= 0) std::memcpy(block + sc.m_offset, &m16, 2);
    }
    if (std::fwrite(buf.data(), 1, bytes, f) != bytes) return absl::InternalError("short write");
  }
  return absl::OkStatus();
}

// The whole file but the tensors' bytes: the shape checked, the tensors placed, the header.
struct FileLayout {
  std::vector<Tensor> tensors;
  std::string header;
  int64_t total = 0;  // the file's size
};
absl::StatusOr<FileLayout> LayoutOf(const SyntheticShape& shape) {
  RETURN_IF_ERROR(CheckShape(shape));
  FileLayout f;
  ASSIGN_OR_RETURN(f.tensors, TensorsOf(shape));
  f.header = HeaderOf(shape, f.tensors);
  f.total = static_cast<int64_t>(f.header.size() + f.tensors.back().offset) + f.tensors.back().bytes;
  return f;
}

}  // namespace

std::vector<std::string> SyntheticShapeNames() { return {"llama-3.1-8b", "gemma3-270m", "smollm2-135m"}; }

absl::StatusOr<SyntheticShape> SyntheticShapeNamed(absl::string_view name) {
  SyntheticShape s;
  s.name = std::string(name);
  if (name == "llama-3.1-8b") {
    s.arch = "llama";
    s.n_layer = 32, s.n_embd = 4096, s.n_head = 32, s.n_head_kv = 8, s.head_dim = 128, s.n_ff = 14336;
    s.n_vocab = 128256, s.n_ctx = 131072, s.rope_base = 500000.0, s.llama3_rope = true;
  } else if (name == "gemma3-270m") {
    s.arch = "gemma3";
    s.n_layer = 18, s.n_embd = 640, s.n_head = 4, s.n_head_kv = 1, s.head_dim = 256, s.n_ff = 2048;
    s.n_vocab = 262144, s.n_ctx = 32768, s.rope_base = 1e6, s.norm_eps = 1e-6, s.tied = true;
    s.sliding_window = 512;
    s.embedding = kernels::DType::kQ8_0;
  } else if (name == "smollm2-135m") {
    s.arch = "llama";
    s.n_layer = 30, s.n_embd = 576, s.n_head = 9, s.n_head_kv = 3, s.head_dim = 64, s.n_ff = 1536;
    s.n_vocab = 49152, s.n_ctx = 8192, s.rope_base = 100000.0, s.tied = true;
    s.matrices = s.fallback = kernels::DType::kQ4_1;
    s.embedding = kernels::DType::kQ8_0;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown synthetic shape '", name, "' (known: ",
                                                   absl::StrJoin(SyntheticShapeNames(), ", "), ")"));
  }
  return s;
}

absl::StatusOr<int64_t> SyntheticGgufBytes(const SyntheticShape& shape, const SyntheticOptions&) {
  ASSIGN_OR_RETURN(const FileLayout file, LayoutOf(shape));
  return file.total;
}

absl::Status WriteSyntheticGguf(const SyntheticShape& shape, const SyntheticOptions& options, const std::string& path) {
  ASSIGN_OR_RETURN(const FileLayout file, LayoutOf(shape));
  const std::vector<Tensor>& tensors = file.tensors;
  const std::string& header = file.header;
  const int64_t total = file.total;
  // A name of this writer's own beside the file: concurrent writers do not clobber each other.
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(tmp.c_str(), "wb"), &std::fclose);
  if (!f) return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  auto fail = [&](absl::string_view what, int err) {
    f.reset();
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return absl::InternalError(absl::StrCat("writing ", tmp, ": ", what, err != 0 ? ": " : "",
                                            err != 0 ? std::strerror(err) : ""));
  };
  if (std::fwrite(header.data(), 1, header.size(), f.get()) != header.size()) return fail("header", errno);
  std::vector<uint8_t> buf(8 << 20);
  int64_t written = static_cast<int64_t>(header.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    const int64_t at = static_cast<int64_t>(header.size() + t.offset);
    if (written < at) {
      static const char kZeros[kAlignment] = {};
      if (std::fwrite(kZeros, 1, at - written, f.get()) != static_cast<size_t>(at - written)) {
        return fail("padding", errno);
      }
    }
    if (!t.values.empty()) {
      const size_t bytes = t.values.size() * sizeof(float);
      if (std::fwrite(t.values.data(), 1, bytes, f.get()) != bytes) return fail(t.name, errno);
    } else if (absl::Status st = WriteBlocks(t, options.seed * 0x100000001B3ull + i, f.get(), buf); !st.ok()) {
      return fail(absl::StrCat(t.name, ": ", st.message()), errno);
    }
    written = at + t.bytes;
    if (options.progress) options.progress(written, total);
  }
  if (std::fflush(f.get()) != 0) return fail("flush", errno);
  if (std::fclose(f.release()) != 0) return fail("close", errno);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return absl::InternalError(absl::StrCat("renaming ", tmp, " to ", path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace dd::model
