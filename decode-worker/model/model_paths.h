// Where fetched models live and the short names that select them: the one place that knows the
// file names scripts/fetch-model writes (tests, flags and tools all ask here).
//
// The cache directory is $DD_MODEL_DIR, else $HOME/.cache/dualdecoder/models. Reading the
// environment here is deliberate: fetch-model, the tests and every binary must agree on it.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace dd::model {

// Short names of the models scripts/fetch-model provides: "gemma" (the default) and "smollm2".
inline constexpr std::string_view kDefaultModelName = "gemma";

std::string ModelCacheDir();
// The cache path of a known short name; nullopt for anything else.
std::optional<std::string> KnownModelPath(std::string_view name);
// A --model value: a known short name becomes its cache path, anything else is a path as is.
std::string ResolveModelArg(std::string_view arg);

}  // namespace dd::model
