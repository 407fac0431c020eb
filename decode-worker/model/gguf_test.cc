#include "decode-worker/model/gguf.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dd::model {
namespace {

// Builds a small GGUF v3 file in memory: two metadata keys and one F32 tensor.
class GgufBuilder {
 public:
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Str(const std::string& s) { U64(s.size()); Raw(s.data(), s.size()); }
  void Raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  void Align(size_t a) { while (bytes.size() % a) bytes.push_back(0); }
  std::vector<uint8_t> bytes;
};

struct Spec {
  uint32_t magic = 0x46554747u;
  uint32_t version = 3;
  uint32_t tensor_type = 0;   // F32
  uint64_t dim0 = 8, dim1 = 2;
  uint64_t offset = 0;
  uint32_t meta_type = 4;     // u32
  size_t data_floats = 16;
};

std::vector<uint8_t> Build(const Spec& s) {
  GgufBuilder b;
  b.U32(s.magic);
  b.U32(s.version);
  b.U64(1);  // tensors
  b.U64(2);  // kv
  b.Str("general.architecture");
  b.U32(8);
  b.Str("llama");
  b.Str("llama.block_count");
  b.U32(s.meta_type);
  b.U32(7);
  b.Str("w");
  b.U32(2);
  b.U64(s.dim0);
  b.U64(s.dim1);
  b.U32(s.tensor_type);
  b.U64(s.offset);
  b.Align(32);
  for (size_t i = 0; i < s.data_floats; ++i) {
    float f = static_cast<float>(i);
    b.Raw(&f, 4);
  }
  return b.bytes;
}

std::string WriteTemp(const std::vector<uint8_t>& bytes, const std::string& name) {
  const std::string path = (std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()) + ".gguf")).string();
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return path;
}

TEST(GgufTest, ParsesValidFile) {
  const std::string path = WriteTemp(Build(Spec{}), "valid");
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(*f->GetString("general.architecture"), "llama");
  EXPECT_EQ(*f->GetInt("llama.block_count"), 7);
  EXPECT_FALSE(f->GetString("llama.block_count").ok());  // wrong type is an error
  auto t = f->FindTensor("w");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->n_elements, 16);
  float v;
  std::memcpy(&v, (*t)->data + 5 * 4, 4);
  EXPECT_EQ(v, 5.0f);
  auto missing = f->FindTensor("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("'nope'"), std::string::npos);
  std::remove(path.c_str());
}

void ExpectError(const Spec& s, const std::string& needle) {
  const std::string path = WriteTemp(Build(s), "bad");
  auto f = GgufFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(std::string(f.status().message()).find(needle), std::string::npos) << f.status();
  EXPECT_NE(std::string(f.status().message()).find(path), std::string::npos) << "error must name the file";
  std::remove(path.c_str());
}

TEST(GgufTest, RejectsCorruptHeaders) {
  Spec s;
  s.magic = 0x12345678;
  ExpectError(s, "bad magic");
  s = Spec{};
  s.version = 2;
  ExpectError(s, "version 2");
  s = Spec{};
  s.tensor_type = 2;  // Q4_0: unsupported
  ExpectError(s, "tensor 'w'");
  s = Spec{};
  s.offset = 64;  // data would run past the end
  ExpectError(s, "past end of file");
  s = Spec{};
  s.offset = 4;  // misaligned
  ExpectError(s, "not aligned");
  s = Spec{};
  s.meta_type = 99;
  ExpectError(s, "llama.block_count");
  s = Spec{};
  s.tensor_type = 8;  // Q8_0 needs rows of 32
  ExpectError(s, "block size");
  s = Spec{};
  s.dim0 = 0;
  ExpectError(s, "dimension 0");
}

// Every truncation of a valid file is an error, never a crash or an out-of-bounds read
// (run under ASan in CI).
TEST(GgufTest, EveryTruncationFailsCleanly) {
  const std::vector<uint8_t> full = Build(Spec{});
  for (size_t n = 1; n < full.size(); n += (n < 200 ? 1 : 7)) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + n);
    const std::string path = WriteTemp(cut, "trunc");
    auto f = GgufFile::Open(path);
    EXPECT_FALSE(f.ok()) << "truncated at " << n;
    std::remove(path.c_str());
  }
}

TEST(GgufTest, MissingFileIsNotFound) {
  auto f = GgufFile::Open("/nonexistent/model.gguf");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dd::model
