// Helpers shared by the C++ benchmark drivers.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "decode-worker/model/weights.h"

namespace dd::bench {

inline std::vector<int64_t> Ints(const std::vector<std::string>& v) {
  std::vector<int64_t> out;
  for (const auto& s : v) out.push_back(std::stoll(s));
  return out;
}

// Makes prompts of any length from natural text: BOS, then the file's tokens, repeated.
class TextPrompts {
 public:
  static absl::StatusOr<TextPrompts> Load(const model::LoadedModel& model, const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    TextPrompts p;
    p.bos_ = model.tokenizer->bos_id();
    p.text_ = model.tokenizer->Encode(ss.str(), false, false);
    if (p.text_.empty()) return absl::NotFoundError(absl::StrCat("no text in ", path));
    return p;
  }
  std::vector<int32_t> Of(int64_t n) const {
    std::vector<int32_t> p = {bos_};
    while (static_cast<int64_t>(p.size()) < n) p.push_back(text_[(p.size() - 1) % text_.size()]);
    return p;
  }

 private:
  int32_t bos_ = 0;
  std::vector<int32_t> text_;
};

}  // namespace dd::bench
