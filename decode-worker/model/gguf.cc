#include "decode-worker/model/gguf.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dd::model {
namespace {

constexpr uint64_t kMaxStringLen = 1ull << 24;   // 16 MiB: no real key or token is larger
constexpr uint64_t kMaxArrayLen = 1ull << 28;
constexpr uint32_t kMaxDims = 4;

// Bounds-checked cursor over the header.
class Cursor {
 public:
  Cursor(const uint8_t* base, size_t size, const std::string& path) : base_(base), size_(size), path_(path) {}

  absl::Status Need(uint64_t n, absl::string_view what) {
    if (n > size_ - pos_) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": truncated header: ", what, " needs ", n,
                                                     " bytes at offset ", pos_, " but the file has ",
                                                     size_));
    }
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> Read(absl::string_view what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<absl::string_view> ReadString(absl::string_view what) {
    ASSIGN_OR_RETURN(uint64_t len, Read<uint64_t>(what));
    if (len > kMaxStringLen) {
      return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what, ": string length ", len, " is implausible"));
    }
    RETURN_IF_ERROR(Need(len, what));
    absl::string_view s(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return s;
  }
  absl::Status Skip(uint64_t n, absl::string_view what) {
    RETURN_IF_ERROR(Need(n, what));
    pos_ += n;
    return absl::OkStatus();
  }
  const uint8_t* here() const { return base_ + pos_; }
  uint64_t pos() const { return pos_; }

 private:
  const uint8_t* base_;
  size_t size_;
  uint64_t pos_ = 0;
  const std::string& path_;
};

int ScalarSize(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kBool: return 1;
    case GgufValueType::kU16: case GgufValueType::kI16: return 2;
    case GgufValueType::kU32: case GgufValueType::kI32: case GgufValueType::kF32: return 4;
    case GgufValueType::kU64: case GgufValueType::kI64: case GgufValueType::kF64: return 8;
    default: return 0;
  }
}

bool IsInteger(GgufValueType t) {
  return t == GgufValueType::kU8 || t == GgufValueType::kI8 || t == GgufValueType::kU16 ||
         t == GgufValueType::kI16 || t == GgufValueType::kU32 || t == GgufValueType::kI32 ||
         t == GgufValueType::kU64 || t == GgufValueType::kI64 || t == GgufValueType::kBool;
}

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Reads an integer of type t; false if it does not fit in int64.
bool LoadInt(GgufValueType t, const uint8_t* p, int64_t* out) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kBool: *out = Load<uint8_t>(p); return true;
    case GgufValueType::kI8: *out = Load<int8_t>(p); return true;
    case GgufValueType::kU16: *out = Load<uint16_t>(p); return true;
    case GgufValueType::kI16: *out = Load<int16_t>(p); return true;
    case GgufValueType::kU32: *out = Load<uint32_t>(p); return true;
    case GgufValueType::kI32: *out = Load<int32_t>(p); return true;
    case GgufValueType::kI64: *out = Load<int64_t>(p); return true;
    case GgufValueType::kU64: {
      const uint64_t v = Load<uint64_t>(p);
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
      *out = static_cast<int64_t>(v);
      return true;
    }
    default: return false;
  }
}

}  // namespace

absl::StatusOr<GgufFile> GgufFile::Open(const std::string& path) {
  GgufFile g;
  ASSIGN_OR_RETURN(g.file_, MappedFile::Open(path));
  Cursor c(g.file_.data(), g.file_.size(), path);
  ASSIGN_OR_RETURN(uint32_t magic, c.Read<uint32_t>("magic"));
  if (magic != 0x46554747u) {  // "GGUF" little-endian
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a GGUF file (bad magic)"));
  }
  ASSIGN_OR_RETURN(g.version_, c.Read<uint32_t>("version"));
  if (g.version_ != 3) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": GGUF version ", g.version_, " is not supported (need 3)"));
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, c.Read<uint64_t>("tensor_count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, c.Read<uint64_t>("kv_count"));
  if (n_tensors > (1u << 20) || n_kv > (1u << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": implausible tensor_count ", n_tensors, " or kv_count ", n_kv));
  }
  for (uint64_t i = 0; i < n_kv; ++i) {
    ASSIGN_OR_RETURN(absl::string_view key, c.ReadString(absl::StrCat("metadata key #", i)));
    const std::string where = absl::StrCat("metadata '", key, "'");
    ASSIGN_OR_RETURN(uint32_t type_raw, c.Read<uint32_t>(where));
    GgufValue v{static_cast<GgufValueType>(type_raw)};
    if (type_raw > 12) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": unknown value type ", type_raw));
    }
    if (v.type == GgufValueType::kString) {
      ASSIGN_OR_RETURN(absl::string_view s, c.ReadString(where));
      v.data = reinterpret_cast<const uint8_t*>(s.data());
      v.count = s.size();
    } else if (v.type == GgufValueType::kArray) {
      ASSIGN_OR_RETURN(uint32_t et, c.Read<uint32_t>(where));
      if (et > 12 || et == static_cast<uint32_t>(GgufValueType::kArray)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": unsupported array item type ", et));
      }
      v.elem_type = static_cast<GgufValueType>(et);
      ASSIGN_OR_RETURN(v.count, c.Read<uint64_t>(where));
      if (v.count > kMaxArrayLen) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": implausible array length ", v.count));
      }
      v.data = c.here();
      if (v.elem_type == GgufValueType::kString) {
        for (uint64_t j = 0; j < v.count; ++j) RETURN_IF_ERROR(c.ReadString(where).status());
      } else {
        RETURN_IF_ERROR(c.Skip(v.count * ScalarSize(v.elem_type), where));
      }
    } else {
      v.data = c.here();
      RETURN_IF_ERROR(c.Skip(ScalarSize(v.type), where));
    }
    if (!g.kv_.emplace(std::string(key), v).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": duplicate metadata key '", key, "'"));
    }
  }
  ASSIGN_OR_RETURN(int64_t alignment, g.GetIntOr("general.alignment", 32));
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": general.alignment ", alignment, " is not a power of two"));
  }
  struct Pending { uint64_t offset; };
  std::vector<Pending> offsets;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    ASSIGN_OR_RETURN(absl::string_view name, c.ReadString(absl::StrCat("tensor #", i, " name")));
    const std::string where = absl::StrCat("tensor '", name, "'");
    GgufTensor t;
    t.name = std::string(name);
    ASSIGN_OR_RETURN(uint32_t n_dims, c.Read<uint32_t>(where));
    if (n_dims == 0 || n_dims > kMaxDims) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": n_dims ", n_dims, " out of range [1, 4]"));
    }
    t.n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(uint64_t dim, c.Read<uint64_t>(where));
      if (dim == 0 || dim > (1ull << 40) || static_cast<uint64_t>(t.n_elements) > (1ull << 42) / dim) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": dimension ", d, " = ", dim, " is invalid"));
      }
      t.shape.push_back(static_cast<int64_t>(dim));
      t.n_elements *= static_cast<int64_t>(dim);
    }
    ASSIGN_OR_RETURN(uint32_t type_raw, c.Read<uint32_t>(where));
    auto info = kernels::GetDTypeInfo(type_raw);
    if (!info.ok()) return Annotate(info.status(), absl::StrCat(path, ": ", where));
    t.type = info->type;
    auto row_bytes = kernels::RowBytes(t.type, t.shape[0]);
    if (!row_bytes.ok()) return Annotate(row_bytes.status(), absl::StrCat(path, ": ", where));
    t.n_bytes = *row_bytes * (t.n_elements / t.shape[0]);
    ASSIGN_OR_RETURN(uint64_t offset, c.Read<uint64_t>(where));
    if (offset % alignment != 0) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": data offset ", offset, " not aligned to ", alignment));
    }
    offsets.push_back({offset});
    if (!g.tensor_index_.emplace(t.name, g.tensors_.size()).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": duplicate ", where));
    }
    g.tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  for (size_t i = 0; i < g.tensors_.size(); ++i) {
    GgufTensor& t = g.tensors_[i];
    const uint64_t begin = data_start + offsets[i].offset;
    const uint64_t end = begin + static_cast<uint64_t>(t.n_bytes);
    if (begin < data_start || end < begin || end > g.file_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "': data [", begin, ", ", end,
                                                     ") past end of file (size ", g.file_.size(),
                                                     "); the file is truncated or corrupt"));
    }
    t.data = g.file_.data() + begin;
  }
  return g;
}

absl::StatusOr<const GgufValue*> GgufFile::Lookup(absl::string_view key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) {
    return absl::NotFoundError(absl::StrCat(path(), ": metadata key '", key, "' is missing"));
  }
  return &it->second;
}

static absl::Status WrongType(const std::string& path, absl::string_view key, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": metadata '", key, "' is not ", want));
}

absl::StatusOr<int64_t> GgufFile::GetInt(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  int64_t out;
  if (!IsInteger(v->type) || !LoadInt(v->type, v->data, &out)) return WrongType(path(), key, "an integer");
  return out;
}

absl::StatusOr<double> GgufFile::GetFloat(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  if (v->type == GgufValueType::kF32) return Load<float>(v->data);
  if (v->type == GgufValueType::kF64) return Load<double>(v->data);
  int64_t i;
  if (IsInteger(v->type) && LoadInt(v->type, v->data, &i)) return static_cast<double>(i);
  return WrongType(path(), key, "a number");
}

absl::StatusOr<bool> GgufFile::GetBool(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  if (v->type != GgufValueType::kBool) return WrongType(path(), key, "a bool");
  return v->data[0] != 0;
}

absl::StatusOr<std::string> GgufFile::GetString(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  if (v->type != GgufValueType::kString) return WrongType(path(), key, "a string");
  return std::string(reinterpret_cast<const char*>(v->data), v->count);
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  if (v->type != GgufValueType::kArray || v->elem_type != GgufValueType::kString) {
    return WrongType(path(), key, "an array of strings");
  }
  std::vector<std::string> out;
  out.reserve(v->count);
  const uint8_t* p = v->data;  // lengths were bounds-checked in Open()
  for (uint64_t i = 0; i < v->count; ++i) {
    const uint64_t len = Load<uint64_t>(p);
    out.emplace_back(reinterpret_cast<const char*>(p + 8), len);
    p += 8 + len;
  }
  return out;
}

absl::StatusOr<std::vector<float>> GgufFile::GetFloatArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  if (v->type != GgufValueType::kArray) return WrongType(path(), key, "an array");
  std::vector<float> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    const uint8_t* p = v->data + i * ScalarSize(v->elem_type);
    int64_t iv;
    if (v->elem_type == GgufValueType::kF32) out[i] = Load<float>(p);
    else if (v->elem_type == GgufValueType::kF64) out[i] = static_cast<float>(Load<double>(p));
    else if (IsInteger(v->elem_type) && LoadInt(v->elem_type, p, &iv)) out[i] = static_cast<float>(iv);
    else return WrongType(path(), key, "an array of numbers");
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(absl::string_view key) const {
  ASSIGN_OR_RETURN(const GgufValue* v, Lookup(key));
  if (v->type != GgufValueType::kArray || !IsInteger(v->elem_type)) {
    return WrongType(path(), key, "an array of integers");
  }
  std::vector<int64_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    if (!LoadInt(v->elem_type, v->data + i * ScalarSize(v->elem_type), &out[i])) {
      return WrongType(path(), key, "an array of int64-representable integers");
    }
  }
  return out;
}

absl::StatusOr<int64_t> GgufFile::GetIntOr(absl::string_view key, int64_t def) const {
  return Has(key) ? GetInt(key) : absl::StatusOr<int64_t>(def);
}
absl::StatusOr<double> GgufFile::GetFloatOr(absl::string_view key, double def) const {
  return Has(key) ? GetFloat(key) : absl::StatusOr<double>(def);
}
absl::StatusOr<bool> GgufFile::GetBoolOr(absl::string_view key, bool def) const {
  return Has(key) ? GetBool(key) : absl::StatusOr<bool>(def);
}

absl::StatusOr<const GgufTensor*> GgufFile::FindTensor(absl::string_view name) const {
  const GgufTensor* t = FindTensorOrNull(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat(path(), ": tensor '", name, "' is missing"));
  }
  return t;
}

const GgufTensor* GgufFile::FindTensorOrNull(absl::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace dd::model
