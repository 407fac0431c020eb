// The sparse manager's transfer and prediction statistics: per sparse layer since the cache was
// built (metrics, benchmarks) and per request since its slot opened (Usage, ddctl --json).
#pragma once

#include <cstdint>
#include <vector>

namespace dd::engine {

// Per sparse layer, in chunks (one chunk = one KV head's block).
struct KvLayerStats {
  int64_t selected = 0;       // |S| summed over real decode rows and KV heads
  int64_t hits = 0;           // |P' ∩ S| where a prediction existed
  int64_t predicted_for = 0;  // |S| of the rows that had a prediction (hit-rate denominator)
  int64_t prefetched = 0;     // |P'| gathered in the background
  int64_t urgent = 0;         // fetched on the critical path
  int64_t wasted = 0;         // |P' \ S|
  // The part of hits / predicted_for from predictions seeded by pre-decoding (the first
  // decode step after prefill, where P' is exactly S by construction).
  int64_t seeded_hits = 0, seeded_for = 0;
  // Resident fetch: chunks of S already resident from earlier steps (not this step's
  // prefetch), and resident chunks evicted to make room.
  int64_t reused = 0;
  int64_t evictions = 0;
  // Key reconstruction (docs/decisions/0052-low-rank-key-reconstruction.md): of the urgent,
  // prefetched and wasted blocks, those whose V half alone moved; the chunks (one KV head each)
  // a real decode row attended with rebuilt keys; and the chunks whose keys were computed
  // (a resident slot keeps them across steps: fewer).
  int64_t urgent_values = 0, prefetched_values = 0, wasted_values = 0;
  int64_t reconstructed = 0, rebuilt = 0;
  // Decode steps of the layer with its keys rebuilt (the layer's choice, not per sequence).
  int64_t reconstructing_steps = 0;
  double hit_rate() const { return predicted_for ? static_cast<double>(hits) / predicted_for : 0.0; }
  double hit_rate_after_first() const {
    const int64_t d = predicted_for - seeded_for;
    return d ? static_cast<double>(hits - seeded_hits) / d : 0.0;
  }
  KvLayerStats& operator+=(const KvLayerStats& o);
};

// One request's counts: its prediction outcomes after its first decode step (the seeded step is
// excluded: there P' = S by construction) and the blocks it moved.
struct SeqKvCounts {
  int64_t hits = 0, predicted_for = 0;
  int64_t prefetched = 0, urgent = 0, wasted = 0;  // wasted: prefetched, never read
  // Of those, the blocks whose V half alone moved; chunks whose keys were rebuilt.
  int64_t prefetched_values = 0, urgent_values = 0, wasted_values = 0;
  int64_t reconstructed = 0, rebuilt = 0;
  double hit_rate() const { return predicted_for ? static_cast<double>(hits) / predicted_for : 0.0; }
};

// Each event counted for its layer and its request.
// Bytes of `blocks` blocks of block_bytes of which `values_only` moved their V half alone.
inline int64_t MovedBytes(int64_t blocks, int64_t values_only, int64_t block_bytes) {
  return blocks * block_bytes - values_only * (block_bytes / 2);
}

class SparseStats {
 public:
  explicit SparseStats(int64_t n_layer) : layers_(n_layer) {}
  // A prediction met by a real row's selection, per KV head: `hits` of its `selected` chunks
  // were predicted, `unused` predicted blocks were moved for nothing; a seeded prediction (the
  // pre-decoded first step) counts for the layer but not in the request's own rate.
  // `values_only`: the unused blocks moved their V half alone.
  void Prediction(SeqKvCounts& s, int64_t layer, int64_t hits, int64_t selected, int64_t unused, bool seeded,
                  bool values_only = false);
  void Prefetched(SeqKvCounts& s, int64_t layer, int64_t blocks, bool values_only = false) {
    layers_[layer].prefetched += blocks;
    s.prefetched += blocks;
    if (values_only) {
      layers_[layer].prefetched_values += blocks;
      s.prefetched_values += blocks;
    }
  }
  void Urgent(SeqKvCounts& s, int64_t layer, int64_t blocks, bool values_only = false) {
    layers_[layer].urgent += blocks;
    s.urgent += blocks;
    if (values_only) {
      layers_[layer].urgent_values += blocks;
      s.urgent_values += blocks;
    }
  }
  void Reconstructed(SeqKvCounts& s, int64_t layer, int64_t chunks) {
    layers_[layer].reconstructed += chunks;
    s.reconstructed += chunks;
  }
  void Rebuilt(SeqKvCounts& s, int64_t layer, int64_t chunks) {
    layers_[layer].rebuilt += chunks;
    s.rebuilt += chunks;
  }
  void ReconstructingStep(int64_t layer) { ++layers_[layer].reconstructing_steps; }
  void Selected(int64_t layer, int64_t chunks) { layers_[layer].selected += chunks; }
  void Reused(int64_t layer, int64_t chunks) { layers_[layer].reused += chunks; }
  void Evicted(int64_t layer, int64_t chunks) { layers_[layer].evictions += chunks; }
  const std::vector<KvLayerStats>& layers() const { return layers_; }
  KvLayerStats total() const;  // summed over layers

 private:
  std::vector<KvLayerStats> layers_;  // indexed by model layer
};

}  // namespace dd::engine
