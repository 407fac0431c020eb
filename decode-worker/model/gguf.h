// GGUF v3 reader over a memory-mapped file.
//
// Open() validates the whole header before returning: every string and array length, every
// metadata value type, every tensor's type, shape, offset and size against the file size and
// alignment. Errors name the file and the field or tensor ("model.gguf: tensor 'blk.3.attn_q
// .weight': data [off, off+len) past end of file (size N)"). After a successful Open, tensor
// data pointers are safe to read for their full byte size.
//
// The GgufFile owns the mapping; all views (strings, arrays, tensor data) live as long as it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "dd/kernels/dtype.h"
#include "decode-worker/model/mapped_file.h"

namespace dd::model {

enum class GgufValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// A metadata value; for arrays `elem_type`/`count` describe the items, which start at `data`.
struct GgufValue {
  GgufValueType type;
  GgufValueType elem_type = GgufValueType::kU8;
  uint64_t count = 0;
  const uint8_t* data = nullptr;  // scalar bytes, string bytes (count = length) or array items
};

struct GgufTensor {
  std::string name;
  kernels::DType type;
  std::vector<int64_t> shape;  // ggml order: shape[0] is the contiguous (row) dimension
  int64_t n_elements = 0;
  int64_t n_bytes = 0;
  const uint8_t* data = nullptr;
};

class GgufFile {
 public:
  static absl::StatusOr<GgufFile> Open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  uint32_t version() const { return version_; }
  bool Has(absl::string_view key) const { return kv_.count(std::string(key)) > 0; }

  // Typed getters convert between integer widths when the value fits; a missing key or an
  // incompatible type is an error naming the key.
  absl::StatusOr<int64_t> GetInt(absl::string_view key) const;
  absl::StatusOr<double> GetFloat(absl::string_view key) const;
  absl::StatusOr<bool> GetBool(absl::string_view key) const;
  absl::StatusOr<std::string> GetString(absl::string_view key) const;
  absl::StatusOr<std::vector<std::string>> GetStringArray(absl::string_view key) const;
  absl::StatusOr<std::vector<float>> GetFloatArray(absl::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(absl::string_view key) const;
  // Defaults used only when the key is absent (a present key of the wrong type is an error).
  absl::StatusOr<int64_t> GetIntOr(absl::string_view key, int64_t def) const;
  absl::StatusOr<double> GetFloatOr(absl::string_view key, double def) const;
  absl::StatusOr<bool> GetBoolOr(absl::string_view key, bool def) const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // NotFound naming the file and tensor.
  absl::StatusOr<const GgufTensor*> FindTensor(absl::string_view name) const;
  const GgufTensor* FindTensorOrNull(absl::string_view name) const;

 private:
  absl::StatusOr<const GgufValue*> Lookup(absl::string_view key) const;

  MappedFile file_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue, std::less<>> kv_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace dd::model
