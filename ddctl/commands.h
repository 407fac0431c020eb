// ddctl subcommands. Flags are parsed in main.cc into CliConfig; commands see only the struct.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "decode-worker/engine/engine.h"
#include "proto/tls.h"

namespace dd::ddctl {

struct CliConfig {
  std::string prompt, prompt_file;
  engine::GenerateOptions generate;
  engine::EngineOptions engine;
  bool json = false;
  bool raw_prompt = false;      // tokenize the prompt without BOS
  bool chat = false;            // generate: the prompt is a user message (model's chat format)
  std::string system;           // generate --chat: optional system message
  std::string tokens, positions, out;
  std::string text;
  int64_t context = 4096;       // fidelity: prompt tokens taken from the file
  int64_t score_tokens = 64;    // fidelity: teacher-forced positions scored after it
  std::string fidelity_budgets; // fidelity: comma-separated budgets, one sparse run each
  std::string fidelity_layers;  // fidelity: comma-separated layers, one run each with only it sparse
  std::string fidelity_key_ranks;  // fidelity: comma-separated key ranks, one run each with keys rebuilt (0: off)
  std::string fidelity_reconstructions;  // fidelity: off, auto, all, layers:L+L, one run each
  std::string fidelity_reference_kv_dtype;  // fidelity: the full run's KV type ("": the engine's)
  std::string questions_file;   // answer: JSON lines of questions over the shared context
  int64_t answer_group = 16;    // answer: slots run together (question forks + choice forks)
  // Service commands.
  std::string server;           // a router (or `ddctl serve`): generate goes there when set
  std::string worker;           // stats: a worker's address
  std::string service;          // grpc-health: the service name ("" = the server)
  std::string model_name;       // generate --server: the model to ask for (empty = any)
  std::string listen = "127.0.0.1:0", metrics_listen = "127.0.0.1:0";  // serve
  std::string internal_listen = "127.0.0.1:0";  // serve: router registry + worker service
  std::string cluster_secret;                   // --cluster_secret_file, loaded
  TlsFiles tls;                                 // --tls_cert/--tls_key/--tls_ca, loaded
  std::string api_key;                          // --api_key_file or $DD_API_KEY: router calls
  int64_t deadline_ms = 0;      // client deadline (0 = none for generate, 10 s for the others)
  std::string request_id;       // generate --server: the request's id (empty: ddctl makes one)
  int64_t reconnect_ms = 60000;  // generate --server: how long to keep reconnecting after the stream breaks
  bool events = false;          // generate --server: one JSON line per streamed message
  std::string shape;            // synth-model: the shape's name
};

// Shared by the commands: the model named by the flags (--model, $DD_MODEL or the default;
// a missing default model names scripts/fetch-model), and the prompt from --prompt or --prompt_file.
absl::StatusOr<std::unique_ptr<model::LoadedModel>> Load(const CliConfig& cfg);
// " (auto: ...)" when the flags chose the device, for the start-up line; "" when it was named.
std::string DeviceWhy(const engine::EngineOptions& o);
// cfg.engine after the start-up device check (worker::ApplyDeviceCheck) on `model`: the device
// the engine may run on, or the refusal.
absl::StatusOr<engine::EngineOptions> CheckedEngineOptions(const model::LoadedModel& model, const CliConfig& cfg);
absl::StatusOr<std::string> ReadPrompt(const CliConfig& cfg);

absl::Status RunGenerate(const CliConfig& cfg);
absl::Status RunLogits(const CliConfig& cfg);
absl::Status RunTokenize(const CliConfig& cfg);
absl::Status RunInfo(const CliConfig& cfg);
// synth-model: writes a random-weight model of --shape to --out (model/synthetic_model.h).
absl::Status RunSynthModel(const CliConfig& cfg);
// Teacher-forced fidelity of a sparse mode against full on the same text (eval/README.md,
// "Predictors and fidelity"): per position KL(full || mode) of the next-token distributions and
// both NLLs of the true token.
absl::Status RunFidelity(const CliConfig& cfg);
// Many questions over one shared context, prefilled once (answer_cmd.cc).
absl::Status RunAnswer(const CliConfig& cfg);
// The start-up device check of --device against the cpu, alone, with its comparison
// (device_check_cmd.cc); FAILED_PRECONDITION when it fails.
absl::Status RunDeviceCheck(const CliConfig& cfg);
// Service commands (serve_cmd.cc).
absl::Status RunServe(const CliConfig& cfg);
absl::Status RunRemoteGenerate(const CliConfig& cfg);
absl::Status RunHealth(const CliConfig& cfg);
// DualDecoder.Cancel of the named stream --request_id through a router (the first of --server's
// list that answers); NOT_FOUND when no worker held it.
absl::Status RunCancel(const CliConfig& cfg);
// grpc.health.v1.Health/Check on any of our servers; prints the status, OK only when SERVING.
absl::Status RunGrpcHealth(const CliConfig& cfg);
absl::Status RunStats(const CliConfig& cfg);
absl::Status RunWorkers(const CliConfig& cfg);

}  // namespace dd::ddctl
