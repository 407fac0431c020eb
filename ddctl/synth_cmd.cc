// ddctl synth-model: a random-weight model of a real model's shape, for benchmarks where the
// real file cannot be (decode-worker/model/synthetic_model.h).
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "ddctl/commands.h"
#include "decode-worker/model/synthetic_model.h"

namespace dd::ddctl {

absl::Status RunSynthModel(const CliConfig& cfg) {
  if (cfg.shape.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("synth-model needs --shape (",
                                                   absl::StrJoin(model::SyntheticShapeNames(), ", "), ")"));
  }
  if (cfg.out.empty()) return absl::InvalidArgumentError("synth-model needs --out, the .gguf file to write");
  ASSIGN_OR_RETURN(const model::SyntheticShape shape, model::SyntheticShapeNamed(cfg.shape));
  model::SyntheticOptions o;
  o.seed = cfg.generate.sampling.seed == 0 ? 1 : cfg.generate.sampling.seed;
  ASSIGN_OR_RETURN(const int64_t total, model::SyntheticGgufBytes(shape, o));
  std::fprintf(stderr, "[ddctl] writing %s: synthetic %s, random weights (%.2f GB)\n", cfg.out.c_str(),
               shape.name.c_str(), static_cast<double>(total) / 1e9);
  int last_tenth = 0;
  o.progress = [&](int64_t written, int64_t all) {
    const int tenth = static_cast<int>(10 * written / all);
    if (tenth > last_tenth) {
      last_tenth = tenth;
      std::fprintf(stderr, "[ddctl] %d%%\n", 10 * tenth);
    }
  };
  RETURN_IF_ERROR(model::WriteSyntheticGguf(shape, o, cfg.out));
  std::printf("%s\n", cfg.out.c_str());
  return absl::OkStatus();
}

}  // namespace dd::ddctl
