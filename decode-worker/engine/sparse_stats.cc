#include "decode-worker/engine/sparse_stats.h"

namespace dd::engine {

KvLayerStats& KvLayerStats::operator+=(const KvLayerStats& o) {
  selected += o.selected;
  hits += o.hits;
  predicted_for += o.predicted_for;
  prefetched += o.prefetched;
  urgent += o.urgent;
  wasted += o.wasted;
  seeded_hits += o.seeded_hits;
  seeded_for += o.seeded_for;
  reused += o.reused;
  evictions += o.evictions;
  urgent_values += o.urgent_values;
  prefetched_values += o.prefetched_values;
  wasted_values += o.wasted_values;
  reconstructed += o.reconstructed;
  rebuilt += o.rebuilt;
  reconstructing_steps += o.reconstructing_steps;
  return *this;
}

void SparseStats::Prediction(SeqKvCounts& s, int64_t layer, int64_t hits, int64_t selected, int64_t unused,
                             bool seeded, bool values_only) {
  KvLayerStats& t = layers_[layer];
  t.hits += hits;
  t.predicted_for += selected;
  if (seeded) {  // the request's own rate leaves the seeded step out
    t.seeded_hits += hits;
    t.seeded_for += selected;
  } else {
    s.hits += hits;
    s.predicted_for += selected;
  }
  t.wasted += unused;
  s.wasted += unused;
  if (values_only) {
    t.wasted_values += unused;
    s.wasted_values += unused;
  }
}

KvLayerStats SparseStats::total() const {
  KvLayerStats t;
  for (const KvLayerStats& s : layers_) t += s;
  return t;
}

}  // namespace dd::engine
