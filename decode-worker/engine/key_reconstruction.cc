#include "decode-worker/engine/key_reconstruction.h"

namespace dd::engine {

bool KeyReconstructionPolicy::Step(int64_t layer, const KvLayerStats& stats, bool real) {
  Layer& l = layers_[layer];
  if (!real && options_.mode == KeyReconstructionMode::kAuto) return l.on;
  if (options_.schedule_for_testing && options_.enabled()) {
    return l.on = options_.schedule_for_testing(layer, real ? l.steps++ : l.steps);
  }
  switch (options_.mode) {
    case KeyReconstructionMode::kOff: return l.on = false;
    case KeyReconstructionMode::kAll: return l.on = true;
    case KeyReconstructionMode::kLayers:
      return l.on = layer < KeyReconstructionOptions::kMaxLayers && options_.layers.test(layer);
    case KeyReconstructionMode::kAuto: break;
  }
  const int64_t hits = stats.hits - l.hits, predicted_for = stats.predicted_for - l.predicted_for;
  l.hits = stats.hits;
  l.predicted_for = stats.predicted_for;
  if (predicted_for > 0) {
    const double rate = static_cast<double>(hits) / static_cast<double>(predicted_for);
    l.rate = l.rate < 0 ? rate : (1 - kSmoothing) * l.rate + kSmoothing * rate;
  }
  ++l.since_switch;
  if (l.rate < 0 || l.since_switch < options_.min_steps) return l.on;
  const bool next = l.on ? l.rate < options_.off_at : l.rate < options_.on_below;
  if (next != l.on) {
    l.on = next;
    l.since_switch = 0;
    ++l.switches;
  }
  return l.on;
}

}  // namespace dd::engine
