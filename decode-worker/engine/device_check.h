// The start-up device check: before a binary serves on a device other than cpu, it runs a short
// fixed greedy decode in its configured mode on that device and on the cpu, and compares them
// (docs/decisions/0044-device-check.md).
//
// Two sequences of fixed text (192 and 160 tokens) are prefilled together in chunks of 64, then
// decoded 16 steps in one batch. The cpu decodes greedily; the device is fed the cpu's tokens
// (teacher forcing), so every one of the 34 logit rows compares the same context. Sparse modes
// run with a budget of 64 tokens, so chunk selection, gathers and (dualdecoder) prefetch all
// run. The store is in-process and prefix reuse off: the check touches no pool.
//
// A row passes when its largest logit difference is within `tolerance` × the cpu row's standard
// deviation, and the device's argmax is the cpu's token unless the cpu's best two logits are
// within twice that difference of each other (a near tie the allowed error may flip). Any
// non-finite device logit fails.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode-worker/engine/engine.h"

namespace dd::engine {

struct DeviceCheckOptions {
  // Largest logit difference per row, in units of the cpu row's standard deviation. A kernel
  // that sums in another order, fuses differently or rounds an int8 activation block the other
  // way moves logits by far less (the cpu and sim differ by 0); a wrong op moves them by about
  // one deviation or more (the sim's decode_attention_off_by_one fault: tests).
  double tolerance = 0.05;
  int64_t decode_steps = 16;
};

struct DeviceCheckRow {
  int seq = 0;
  int step = 0;             // 0: the prompt's last row; k: decode step k
  int32_t cpu_token = 0;    // the cpu's argmax (the token both are fed next)
  int32_t device_token = 0;
  double max_abs_diff = 0;  // largest |device − cpu| logit
  double cpu_std = 0;       // the cpu row's standard deviation over the vocabulary
  bool near_tie = false;    // the tokens differ but the cpu's best two are within 2 × max_abs_diff
  bool ok = true;
};

struct DeviceCheckReport {
  std::string device, mode;
  std::vector<int64_t> prompt_tokens;  // per sequence
  int64_t decode_steps = 0;
  double tolerance = 0;
  std::vector<DeviceCheckRow> rows;
  double worst_relative_diff = 0;  // max over rows of max_abs_diff / cpu_std
  int64_t token_mismatches = 0;    // rows whose tokens differ (near ties included)
  bool passed = false;
  std::string reason;              // the first failing row, or "" when passed
  double cpu_seconds = 0, device_seconds = 0;  // each run, engine creation included

  // One line: the verdict, worst difference, tokens and cost.
  std::string Summary() const;
  // The per-row comparison, then the summary.
  std::string Table() const;
};

// Runs the check of `options.device` against the cpu with the rest of `options` (mode, matmul,
// spec head, threads...). An error (not a failed report) when either engine cannot be built or
// run: the device's own error is returned as it is.
absl::StatusOr<DeviceCheckReport> CheckDevice(const model::LoadedModel& model, const EngineOptions& options,
                                              const DeviceCheckOptions& check = {});

}  // namespace dd::engine
