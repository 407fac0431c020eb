// Helpers shared by the C++ benchmark drivers.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "bench/flag_ints.h"
#include "common/status_macros.h"
#include "decode-worker/engine/engine.h"
#include "decode-worker/model/weights.h"

namespace dd::bench {

// The process's resident set now (VmRSS), MiB; 0 if /proc is unreadable.
inline double ResidentMiB() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

// Makes prompts of any length from natural text: BOS (when the tokenizer adds one), then the
// file's tokens, repeated.
class TextPrompts {
 public:
  static absl::StatusOr<TextPrompts> Load(const model::LoadedModel& model, const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    TextPrompts p;
    p.bos_ = model.tokenizer->add_bos() ? model.tokenizer->bos_id() : -1;
    p.text_ = model.tokenizer->Encode(ss.str(), false, false);
    if (p.text_.empty()) return absl::NotFoundError(absl::StrCat("no text in ", path));
    return p;
  }
  std::vector<int32_t> Of(int64_t n) const {
    std::vector<int32_t> p;
    if (bos_ >= 0) p.push_back(bos_);
    const size_t skip = p.size();
    while (static_cast<int64_t>(p.size()) < n) p.push_back(text_[(p.size() - skip) % text_.size()]);
    return p;
  }

 private:
  int32_t bos_ = 0;
  std::vector<int32_t> text_;
};

// The decode timing loop both benchmark drivers share: forks slot 0 (a prefilled prompt whose
// next token is `first`) into slots 1..batch, runs one warm-up step, then `steps` timed greedy
// steps (milliseconds each into *step_ms), and releases the forks. `after_warmup` and
// `before_release` let a caller read counters around the timed steps. A failed fork or step
// is returned (forks released).
inline absl::Status TimedDecode(engine::Engine& e, int64_t batch, int32_t first, int steps,
                                std::vector<double>* step_ms, const std::function<void()>& after_warmup = {},
                                const std::function<void()>& before_release = {}) {
  const int64_t V = e.config().n_vocab;
  std::vector<int32_t> seqs, tokens;
  auto release = [&] {
    for (int32_t q : seqs) e.Release(q);
  };
  for (int64_t s = 0; s < batch; ++s) {
    if (absl::Status st = e.Fork(0, static_cast<int32_t>(s + 1)); !st.ok()) {
      release();
      return absl::Status(st.code(), absl::StrCat("fork ", s + 1, " of ", batch, ": ", st.message()));
    }
    seqs.push_back(static_cast<int32_t>(s + 1));
    tokens.push_back(first);
  }
  std::vector<float> logits;
  absl::Status st = e.DecodeStep(seqs, tokens, &logits);  // warm-up
  if (st.ok() && after_warmup) after_warmup();
  step_ms->clear();
  for (int i = 0; i < steps && st.ok(); ++i) {
    for (int64_t s = 0; s < batch; ++s) tokens[s] = engine::Argmax(&logits[s * V], V);
    const auto a = std::chrono::steady_clock::now();
    st = e.DecodeStep(seqs, tokens, &logits);
    step_ms->push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  if (st.ok() && before_release) before_release();
  release();
  return st;
}

}  // namespace dd::bench
