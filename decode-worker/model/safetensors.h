// Reader for Hugging Face safetensors files over a memory mapping.
//
// File layout: an 8-byte little-endian header length N, N bytes of a JSON object mapping tensor
// names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section
// that follows the header), plus an optional "__metadata__" object of strings.
//
// SafetensorsFile::Open validates the whole header before returning: header length within the
// file (and at most 100 MB), valid JSON, every field's type, offsets inside the data section,
// byte size == product(shape) × element size for every dtype the format defines, and no two
// tensors overlapping. A dtype this engine cannot compute with (I64, F8_*, ...) is not an error
// until the tensor is used (SafetensorsTensor::KernelDType). Errors name the file, the tensor
// and the field. After a successful Open, `data` is readable for `n_bytes` bytes.
//
// SafetensorsDir opens every *.safetensors file in a directory (single file or shards) and
// indexes tensors across them. Both classes own their mappings; all pointers and references
// they hand out live as long as the object. Immutable after Open, so const use is thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "dd/kernels/dtype.h"
#include "decode-worker/model/mapped_file.h"

namespace dd::model {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;           // as written in the header: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;  // row-major; shape.back() is the contiguous dimension
  const uint8_t* data = nullptr;
  int64_t n_bytes = 0;
  const std::string* file = nullptr;  // path of the file holding it, for error messages

  int64_t n_elements() const;
  // F32, F16 and BF16 map to kernel types; anything else is Unimplemented naming the file,
  // tensor and dtype.
  absl::StatusOr<kernels::DType> KernelDType() const;
};

class SafetensorsFile {
 public:
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

  // NotFound when the file is missing; InvalidArgument naming file/tensor/field otherwise.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Tensors point at path(); the object stays where Open put it.
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, SafetensorsTensor, std::less<>>& tensors() const { return tensors_; }
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }

  // NotFound naming the file and tensor.
  absl::StatusOr<const SafetensorsTensor*> FindTensor(std::string_view name) const;
  const SafetensorsTensor* FindTensorOrNull(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  absl::Status ParseHeader();

  MappedFile file_;
  std::map<std::string, SafetensorsTensor, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

class SafetensorsDir {
 public:
  // Opens all *.safetensors in `dir` (sorted by name). NotFound when the directory is missing or
  // holds none; InvalidArgument when a tensor name appears in two files, or when
  // model.safetensors.index.json is present and maps a tensor to a file that does not hold it.
  static absl::StatusOr<std::unique_ptr<SafetensorsDir>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  size_t num_tensors() const { return index_.size(); }

  // NotFound naming the directory and tensor.
  absl::StatusOr<const SafetensorsTensor*> FindTensor(std::string_view name) const;
  const SafetensorsTensor* FindTensorOrNull(std::string_view name) const;

 private:
  absl::Status CheckIndexJson(const std::string& path) const;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsTensor*, std::less<>> index_;
};

}  // namespace dd::model
