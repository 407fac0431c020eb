// ddctl subcommands. Flags are parsed in main.cc into CliConfig; commands see only the struct.
#pragma once

#include <cstdint>
#include <memory>
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
  int64_t context = 4096;       // fidelity: prompt tokens taken from the file
  int64_t score_tokens = 64;    // fidelity: teacher-forced positions scored after it
};

// Shared by the commands: the model named by the config (a missing default model names
// scripts/fetch-model), and the prompt from --prompt or --prompt_file.
absl::StatusOr<std::unique_ptr<model::LoadedModel>> Load(const CliConfig& cfg);
absl::StatusOr<std::string> ReadPrompt(const CliConfig& cfg);

absl::Status RunGenerate(const CliConfig& cfg);
absl::Status RunLogits(const CliConfig& cfg);
absl::Status RunTokenize(const CliConfig& cfg);
absl::Status RunInfo(const CliConfig& cfg);
// Teacher-forced fidelity of a sparse mode against full on the same text (issue 4): per
// position KL(full || mode) of the next-token distributions and both NLLs of the true token.
absl::Status RunFidelity(const CliConfig& cfg);

}  // namespace dd::ddctl
