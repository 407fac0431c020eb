#include "decode-worker/engine/prefix_reuse.h"

#include <cstring>
#include <vector>

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

}  // namespace dd::engine
