#include "decode-worker/model/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace dd::model {
namespace {

using nlohmann::json;

// Element sizes of every dtype the safetensors format defines with a whole-byte size.
// Names not listed here (sub-byte float formats, future types) are accepted at open without a
// size check; they fail in KernelDType() if a model uses them.
int64_t ElementSize(std::string_view dtype) {
  static const std::map<std::string_view, int64_t> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2},  {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"I64", 8}, {"U64", 8},  {"F64", 8},
  };
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

// A JSON integer in [0, INT64_MAX]; false for anything else (negative, float, too big, ...).
bool NonNegativeInt(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0) return false;
    *out = i;
    return true;
  }
  return false;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

struct Extent {
  int64_t begin, end;
  const std::string* name;
};

}  // namespace

int64_t SafetensorsTensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // cannot overflow: checked at Open
  return n;
}

absl::StatusOr<kernels::DType> SafetensorsTensor::KernelDType() const {
  if (dtype == "F32") return kernels::DType::kF32;
  if (dtype == "F16") return kernels::DType::kF16;
  if (dtype == "BF16") return kernels::DType::kBF16;
  return absl::UnimplementedError(absl::StrCat(file ? *file : std::string("<safetensors>"), ": tensor '", name,
                                               "': dtype ", dtype, " is not supported (F32, F16, BF16)"));
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  ASSIGN_OR_RETURN(f->file_, MappedFile::Open(path));
  RETURN_IF_ERROR(f->ParseHeader());
  return f;
}

absl::Status SafetensorsFile::ParseHeader() {
  const std::string& p = file_.path();
  auto bad = [&](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(p, ": ", parts...)); };
  const uint64_t size = file_.size();
  if (size < 8) return bad("file is ", size, " bytes, too short for the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file_.data()[i];
  if (header_len > kMaxHeaderBytes) {
    return bad("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  }
  if (header_len > size - 8) {
    return bad("header length ", header_len, " runs past the end of the file (", size, " bytes)");
  }
  const char* text = reinterpret_cast<const char*>(file_.data() + 8);
  const json header = json::parse(text, text + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return bad("header is not valid JSON");
  if (!header.is_object()) return bad("header is not a JSON object");

  const uint8_t* data = file_.data() + 8 + header_len;
  const int64_t data_size = static_cast<int64_t>(size - 8 - header_len);
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return bad("__metadata__ is not a JSON object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) return bad("__metadata__ field '", key, "' is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor '", name, "': ");
    if (!entry.is_object()) return bad(where, "entry is not a JSON object");
    SafetensorsTensor t;
    t.name = name;
    t.file = &file_.path();

    const auto dtype = entry.find("dtype");
    if (dtype == entry.end() || !dtype->is_string()) return bad(where, "field 'dtype' is missing or not a string");
    t.dtype = dtype->get<std::string>();

    const auto shape = entry.find("shape");
    if (shape == entry.end() || !shape->is_array()) return bad(where, "field 'shape' is missing or not an array");
    int64_t n_elements = 1;
    for (const json& d : *shape) {
      int64_t dim = 0;
      if (!NonNegativeInt(d, &dim)) return bad(where, "field 'shape' holds ", d.dump(), ", not a non-negative integer");
      if (__builtin_mul_overflow(n_elements, dim, &n_elements)) return bad(where, "field 'shape' overflows");
      t.shape.push_back(dim);
    }

    const auto offsets = entry.find("data_offsets");
    int64_t begin = 0, end = 0;
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 ||
        !NonNegativeInt((*offsets)[0], &begin) || !NonNegativeInt((*offsets)[1], &end)) {
      return bad(where, "field 'data_offsets' must be [begin, end] with non-negative integers");
    }
    if (begin > end) return bad(where, "field 'data_offsets' [", begin, ", ", end, "] has begin > end");
    if (end > data_size) {
      return bad(where, "field 'data_offsets' [", begin, ", ", end, "] is past the end of the data section (",
                 data_size, " bytes)");
    }
    t.data = data + begin;
    t.n_bytes = end - begin;

    if (const int64_t elem = ElementSize(t.dtype); elem > 0) {
      int64_t want = 0;
      if (__builtin_mul_overflow(n_elements, elem, &want) || want != t.n_bytes) {
        return bad(where, "field 'data_offsets' spans ", t.n_bytes, " bytes but shape ", ShapeString(t.shape),
                   " of ", t.dtype, " needs ", n_elements, " x ", elem);
      }
    }
    auto [it, inserted] = tensors_.emplace(name, std::move(t));
    if (end > begin) extents.push_back({begin, end, &it->first});
  }

  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].begin < extents[i - 1].end) {
      return bad("tensor '", *extents[i].name, "': field 'data_offsets' overlaps tensor '", *extents[i - 1].name,
                 "'");
    }
  }
  return absl::OkStatus();
}

const SafetensorsTensor* SafetensorsFile::FindTensorOrNull(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<const SafetensorsTensor*> SafetensorsFile::FindTensor(std::string_view name) const {
  if (const SafetensorsTensor* t = FindTensorOrNull(name)) return t;
  return absl::NotFoundError(absl::StrCat(path(), ": no tensor '", std::string(name), "'"));
}

absl::StatusOr<std::unique_ptr<SafetensorsDir>> SafetensorsDir::Open(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  std::vector<std::string> paths;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".safetensors") paths.push_back(it->path().string());
  }
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot list directory: ", ec.message()));
  if (paths.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no *.safetensors files"));
  std::sort(paths.begin(), paths.end());

  auto d = std::make_unique<SafetensorsDir>();
  d->dir_ = dir;
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
    for (const auto& [name, tensor] : file->tensors()) {
      auto [it, inserted] = d->index_.emplace(name, &tensor);
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor '", name, "' appears in both ",
                                                       *it->second->file, " and ", path));
      }
    }
    d->files_.push_back(std::move(file));
  }
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path, ec)) RETURN_IF_ERROR(d->CheckIndexJson(index_path.string()));
  return d;
}

// The index is redundant with the shard headers; checking it catches a missing or stale shard.
absl::Status SafetensorsDir::CheckIndexJson(const std::string& path) const {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open"));
  std::stringstream buf;
  buf << in.rdbuf();
  const json index = json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a valid JSON object"));
  }
  const auto map = index.find("weight_map");
  if (map == index.end() || !map->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": field 'weight_map' is missing or not an object"));
  }
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map entry '", name, "' is not a string"));
    }
    const std::string want = file.get<std::string>();
    const SafetensorsTensor* t = FindTensorOrNull(name);
    if (t == nullptr || std::filesystem::path(*t->file).filename() != want) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": weight_map puts tensor '", name, "' in ", want,
                                                     ", but ", t ? "it is in " + *t->file : "no file holds it"));
    }
  }
  return absl::OkStatus();
}

const SafetensorsTensor* SafetensorsDir::FindTensorOrNull(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

absl::StatusOr<const SafetensorsTensor*> SafetensorsDir::FindTensor(std::string_view name) const {
  if (const SafetensorsTensor* t = FindTensorOrNull(name)) return t;
  return absl::NotFoundError(absl::StrCat(dir_, ": no tensor '", std::string(name), "' in any *.safetensors file"));
}

}  // namespace dd::model
