// ddctl device-check: the start-up device check alone (decode-worker/engine/device_check.h),
// printing the row-by-row comparison against the cpu; exit status 1 when it fails.
#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "ddctl/commands.h"
#include "decode-worker/engine/device_check.h"
#include "decode-worker/service/engine_flags.h"
#include "nlohmann/json.hpp"

namespace dd::ddctl {

absl::Status RunDeviceCheck(const CliConfig& cfg) {
  ASSIGN_OR_RETURN(auto model, Load(cfg));
  const engine::EngineOptions& o = cfg.engine;
  if (o.device == "cpu") {
    std::printf("device check: nothing to check: the device is the cpu (%s), the check's own reference\n",
                o.device_why.c_str());
    return absl::OkStatus();
  }
  std::fprintf(stderr, "[ddctl] device check: %s against cpu, %s mode, model %s (%s)\n", o.device.c_str(),
               std::string(engine::DecodeModeName(o.mode)).c_str(), model->config.name.c_str(), o.device_why.c_str());
  ASSIGN_OR_RETURN(const engine::DeviceCheckReport r,
                   engine::CheckDevice(*model, o, worker::DeviceCheckOptionsFromFlags()));
  if (cfg.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (const engine::DeviceCheckRow& row : r.rows) {
      rows.push_back({{"seq", row.seq}, {"step", row.step}, {"cpu_token", row.cpu_token},
                      {"device_token", row.device_token}, {"max_abs_diff", row.max_abs_diff},
                      {"cpu_std", row.cpu_std}, {"near_tie", row.near_tie}, {"ok", row.ok}});
    }
    nlohmann::json j = {{"device", r.device}, {"mode", r.mode}, {"model", model->config.name},
                        {"passed", r.passed}, {"reason", r.reason}, {"tolerance", r.tolerance},
                        {"worst_relative_diff", r.worst_relative_diff}, {"token_mismatches", r.token_mismatches},
                        {"prompt_tokens", r.prompt_tokens}, {"decode_steps", r.decode_steps},
                        {"cpu_seconds", r.cpu_seconds}, {"device_seconds", r.device_seconds}, {"rows", rows}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << r.Table();
  }
  if (!r.passed) return absl::FailedPreconditionError(absl::StrCat("the device check of ", r.device, " failed: ", r.reason));
  return absl::OkStatus();
}

}  // namespace dd::ddctl
