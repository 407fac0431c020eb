// Which sparse layers rebuild their keys from the low-rank key cache at a decode step
// (KeyReconstructionOptions, docs/decisions/0052-low-rank-key-reconstruction.md). Decided once
// per layer per step, before its reads start, for the whole batch, so that every sequence of a
// step sees the same choice. `auto` follows each layer's next-step hit rate as the sparse
// statistics count it (hits / predicted-for since the last step), smoothed with weight
// kSmoothing per step: on below on_below, off at off_at or above, each switch at least
// min_steps of the layer's steps after the last. Not thread-safe (the compute thread).
#pragma once

#include <cstdint>
#include <vector>

#include "decode-worker/engine/sparse_options.h"
#include "decode-worker/engine/sparse_stats.h"

namespace dd::engine {

class KeyReconstructionPolicy {
 public:
  static constexpr double kSmoothing = 0.25;  // the newest step's weight in the smoothed rate
  KeyReconstructionPolicy(const KeyReconstructionOptions& options, int64_t n_layer)
      : options_(options), layers_(n_layer) {}
  bool enabled() const { return options_.enabled(); }
  // Layer `layer`'s choice for its step about to run, given its statistics so far. A call
  // without a real decode row (pre-decoding after prefill) keeps the last choice and counts
  // no step.
  bool Step(int64_t layer, const KvLayerStats& stats, bool real = true);
  // The choice of its last step.
  bool on(int64_t layer) const { return layers_[layer].on; }
  // The smoothed hit rate (-1 before any prediction was measured) and the switches so far.
  double smoothed_hit_rate(int64_t layer) const { return layers_[layer].rate; }
  int64_t switches(int64_t layer) const { return layers_[layer].switches; }

 private:
  struct Layer {
    bool on = false;
    double rate = -1;
    int64_t hits = 0, predicted_for = 0;  // the statistics at the last step
    int64_t since_switch = 0;             // the layer's steps since its last switch
    int64_t switches = 0;
    int64_t steps = 0;  // with a test schedule: the layer's steps so far
  };
  const KeyReconstructionOptions options_;
  std::vector<Layer> layers_;
};

}  // namespace dd::engine
