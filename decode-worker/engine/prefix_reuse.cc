#include "decode-worker/engine/prefix_reuse.h"

#include <cstring>
#include <vector>

#include "common/status_macros.h"

namespace dd::engine {
namespace {

void AddMatrix(const kernels::WeightView& w, std::vector<uint64_t>* words) {
  words->push_back(static_cast<uint64_t>(w.type));
  words->push_back(static_cast<uint64_t>(w.rows));
  words->push_back(static_cast<uint64_t>(w.cols));
  if (w.data == nullptr) return;
  const int64_t n = std::min<int64_t>(64, w.rows * w.row_bytes);
  for (int64_t i = 0; i < n; i += 8) {
    uint64_t x = 0;
    std::memcpy(&x, w.data + i, std::min<int64_t>(8, n - i));
    words->push_back(x);
  }
}

}  // namespace

uint64_t ModelFingerprint(const model::LoadedModel& model) {
  const model::ModelConfig& c = model.config;
  std::vector<uint64_t> words = {static_cast<uint64_t>(c.n_layer), static_cast<uint64_t>(c.n_embd),
                                 static_cast<uint64_t>(c.n_head),  static_cast<uint64_t>(c.n_head_kv),
                                 static_cast<uint64_t>(c.head_dim), static_cast<uint64_t>(c.n_vocab),
                                 static_cast<uint64_t>(c.n_ctx_train)};
  AddMatrix(model.weights.token_embd, &words);
  AddMatrix(model.weights.output, &words);
  for (const model::LayerWeights& l : model.weights.layers) {
    for (const kernels::WeightView* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) AddMatrix(*w, &words);
  }
  return kvpool::HashWords(0x6d6f64656cULL /* "model" */, words);
}

absl::Status GatherLayerChunks(kvpool::KvStore& store, kvpool::SequenceId handle, int32_t layer, int64_t c0,
                               int64_t c1, int32_t n_kv, int64_t block_bytes, std::vector<uint8_t>* blocks) {
  std::vector<kvpool::ChunkRef> refs;
  for (int64_t c = c0; c < c1; ++c) {
    for (int32_t g = 0; g < n_kv; ++g) refs.push_back({layer, g, c});
  }
  blocks->resize(refs.size() * block_bytes);
  ASSIGN_OR_RETURN(kvpool::TransferId tid, store.Gather(handle, refs, blocks->data(), kvpool::Priority::kUrgent));
  return store.Wait(tid);
}

}  // namespace dd::engine
