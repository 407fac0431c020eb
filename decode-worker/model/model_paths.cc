#include "decode-worker/model/model_paths.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace dd::model {
namespace {

struct KnownModel {
  std::string_view name;
  std::string_view file;
};
constexpr KnownModel kKnownModels[] = {
    {"gemma", "gemma-3-270m-q4_k_m.gguf"},
    {"smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"},
};

}  // namespace

std::string ModelCacheDir() {
  if (const char* dir = std::getenv("DD_MODEL_DIR"); dir != nullptr && *dir != '\0') return dir;
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : ".", "/.cache/dualdecoder/models");
}

std::optional<std::string> KnownModelPath(std::string_view name) {
  for (const KnownModel& m : kKnownModels) {
    if (m.name == name) return ModelCacheDir() + "/" + std::string(m.file);
  }
  return std::nullopt;
}

std::string ResolveModelArg(std::string_view arg) {
  if (auto known = KnownModelPath(arg)) return *known;
  return std::string(arg);
}

}  // namespace dd::model
