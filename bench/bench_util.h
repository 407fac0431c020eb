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

// The decode timing loop both benchmark drivers share. Start() forks slot 0 (a prefilled
// prompt whose next token is `first`) into slots 1..batch and runs one untimed warm-up step;
// Steps(n) runs n timed greedy steps, continuing where the last call stopped (milliseconds each
// appended to step_ms()); the destructor releases the forks. Several runs on different engines
// can be alive at once and take turns (modes_bench interleaves modes in rounds, so a slow spell
// of a shared machine falls on every mode alike). A failed fork or step is returned; after one,
// the run refuses further steps.
class DecodeRun {
 public:
  DecodeRun(engine::Engine& e, int64_t batch, int32_t first) : e_(e), batch_(batch), first_(first) {}
  ~DecodeRun() {
    for (int32_t q : seqs_) e_.Release(q);
  }
  DecodeRun(const DecodeRun&) = delete;
  DecodeRun& operator=(const DecodeRun&) = delete;

  absl::Status Start() {
    for (int64_t s = 0; s < batch_; ++s) {
      if (absl::Status st = e_.Fork(0, static_cast<int32_t>(s + 1)); !st.ok()) {
        return status_ = absl::Status(st.code(), absl::StrCat("fork ", s + 1, " of ", batch_, ": ", st.message()));
      }
      seqs_.push_back(static_cast<int32_t>(s + 1));
      tokens_.push_back(first_);
    }
    return status_ = e_.DecodeStep(seqs_, tokens_, &logits_);  // warm-up
  }

  absl::Status Steps(int n) {
    const int64_t V = e_.config().n_vocab;
    for (int i = 0; i < n && status_.ok(); ++i) {
      for (int64_t s = 0; s < batch_; ++s) tokens_[s] = engine::Argmax(&logits_[s * V], V);
      const auto a = std::chrono::steady_clock::now();
      status_ = e_.DecodeStep(seqs_, tokens_, &logits_);
      step_ms_.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    return status_;
  }

  const std::vector<double>& step_ms() const { return step_ms_; }

 private:
  engine::Engine& e_;
  const int64_t batch_;
  const int32_t first_;
  std::vector<int32_t> seqs_, tokens_;
  std::vector<float> logits_;
  std::vector<double> step_ms_;
  absl::Status status_;
};

}  // namespace dd::bench
