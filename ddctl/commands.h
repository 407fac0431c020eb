// ddctl subcommands. Flags are parsed in main.cc into CliConfig; commands see only the struct.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "decode-worker/engine/engine.h"

namespace dd::ddctl {

struct CliConfig {
  std::string model_path;       // flag --model > env DD_MODEL > default cache path
  bool model_path_defaulted = false;
  std::string prompt, prompt_file;
  engine::GenerateOptions generate;
  engine::EngineOptions engine;
  bool json = false;
  bool raw_prompt = false;      // tokenize the prompt without BOS
  std::string tokens, positions, out;
  std::string text;
};

absl::Status RunGenerate(const CliConfig& cfg);
absl::Status RunLogits(const CliConfig& cfg);
absl::Status RunTokenize(const CliConfig& cfg);
absl::Status RunInfo(const CliConfig& cfg);

}  // namespace dd::ddctl
