#include "ddctl/npy.h"

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace dd::ddctl {

absl::Status WriteNpyF32(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  std::string dims;
  int64_t count = 1;
  for (int64_t d : shape) {
    absl::StrAppend(&dims, d, ",");
    count *= d;
  }
  if (shape.size() > 1) dims.pop_back();
  std::string header = absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  // Magic (6) + version (2) + header length (2) + header, padded with spaces to 64 bytes, '\n'.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  const uint16_t hlen = static_cast<uint16_t>(header.size());
  bool ok = std::fwrite("\x93NUMPY\x01\x00", 1, 8, f) == 8 && std::fwrite(&hlen, 2, 1, f) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data, sizeof(float), count, f) == static_cast<size_t>(count);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace dd::ddctl
