// A stated model of the chunks decode steps select, for benchmarks on synthetic weights.
//
// Random weights do not attend like a trained model: their landmark scores say nothing about
// which chunks the next step needs, so neither the step cache's reuse nor the speculative
// row's hit rate would be a trained model's. With the model on, SparseKvCache still scores
// every landmark and ranks the chunks (a step costs what it costs), but the chunks each real
// row attends (S) and each speculative row predicts (P') are drawn here, per request, layer and
// KV head, from two figures measured on the real models:
//   overlap   |S_t ∩ S_{t+1}| / k: the part of a step's selection the next step keeps;
//   hit_rate  |P'_t ∩ S_{t+1}| / k: the part of the next step's selection predicted;
//   resident_waste  the part of the mispredicted chunks (P'_t \ S_{t+1}) that the step cache
//            holds anyway (S_t \ S_{t+1}), so they cost no transfer; the rest are fetched for
//            nothing. 0 (the default) makes every misprediction a transfer.
// (k = budget / chunk.) The draws are deterministic in (seed, slot, layer, head, position), so
// `sparse`, `sparse-cached` and `dualdecoder` attend the same chunks and stay bit-identical.
//
// The prediction misses the chunks S_{t+1} adds first (those the step cache does not hold),
// so each miss costs a transfer, up to (1 - hit_rate) · k per step: the model never lets a
// miss fall on a chunk that is resident anyway, which would flatter dualdecoder.
// docs/decisions/0040-selection-model.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd::engine {

struct SelectionModel {
  bool enabled = false;
  double overlap = 0.0;
  double hit_rate = 0.0;
  double resident_waste = 0.0;
  uint64_t seed = 0;

  // "OVERLAP:HIT[:RESIDENT_WASTE[:SEED]]" (fractions in [0, 1], e.g. "0.7:0.95:0.4"); "" or
  // "off": disabled. InvalidArgument naming the bad part.
  static absl::StatusOr<SelectionModel> Parse(absl::string_view spec);
  std::string ToString() const;  // Parse's form; "off" when disabled

  // Where a draw belongs: the same key always gives the same chunks.
  struct Key {
    int64_t seq = 0, layer = 0, head = 0, pos = 0;
  };
  // A request's first selection (no earlier step planned it): min(k, end - begin) chunks of
  // [begin, end), uniform, ascending.
  std::vector<int64_t> First(const Key& key, int64_t begin, int64_t end, int64_t k) const;
  // The next step's selection, within [begin, end) (a range that holds every chunk of `now`):
  // round(overlap · |now|) chunks of `now` kept, uniform, the rest new chunks of the range,
  // uniform; ascending. The whole range when it holds k chunks or fewer.
  std::vector<int64_t> Next(const Key& key, const std::vector<int64_t>& now, int64_t begin, int64_t end,
                            int64_t k) const;
  // The prediction of `next` (drawn by Next from `now`): round(hit_rate · |next|) chunks of
  // `next`, those kept from `now` first, then new ones, uniform within each; filled up to
  // |next| with mispredicted chunks: round(resident_waste · their number) from those `now` has
  // and `next` dropped, the rest from [begin, end) outside both (fetched for nothing);
  // ascending.
  std::vector<int64_t> Predict(const Key& key, const std::vector<int64_t>& now, const std::vector<int64_t>& next,
                               int64_t begin, int64_t end) const;
};

}  // namespace dd::engine
