// Checks shared by the real-model engine tests (engine_test.cc, smollm2_engine_test.cc), and the
// small model shape of the tests that drive the KV side without a model.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "decode-worker/engine/engine.h"
#include "glog/logging.h"
#include "gtest/gtest.h"

namespace dd::engine::testing_util {

// 4 query heads and 2 KV heads of `head_dim`, a 4096-token context, a 64-token sliding window;
// layer l is a sliding-window layer where swa[l].
// One layer's attention call (softmax scale 0.2) over rows whose q, k, v and out are row-major in
// host vectors.
inline model::AttentionCall AttentionCallOf(int64_t layer, const std::vector<model::BatchRow>& rows,
                                            std::vector<float>& q, std::vector<float>& k, std::vector<float>& v,
                                            std::vector<float>& out) {
  model::AttentionCall call;
  call.layer = layer;
  call.scale = 0.2f;
  call.rows = rows;
  call.q = q.data();
  call.k = k.data();
  call.v = v.data();
  call.out = out.data();
  return call;
}

inline model::ModelConfig SmallConfig(std::vector<bool> swa, int64_t head_dim = 32) {
  model::ModelConfig c;
  c.n_layer = static_cast<int64_t>(swa.size());
  c.n_head = 4;
  c.n_head_kv = 2;
  c.head_dim = head_dim;
  c.n_ctx_train = 4096;
  c.sliding_window = 64;
  c.layer_is_swa = std::move(swa);
  return c;
}

// Host rows of f32 as the KV store's bytes (an f32 layout's blocks).
inline std::vector<uint8_t> BytesOf(const std::vector<float>& x) {
  std::vector<uint8_t> b(x.size() * sizeof(float));
  std::memcpy(b.data(), x.data(), b.size());
  return b;
}

// The engine for options a test expects to work (Engine::Create); a test binary that cannot
// have it stops there with the reason.
inline std::unique_ptr<Engine> NewEngine(const model::LoadedModel& model, const EngineOptions& options) {
  auto engine = Engine::Create(model, options);
  CHECK(engine.ok()) << "Engine::Create: " << engine.status();
  return std::move(*engine);
}

// Batch invariance (docs/decisions/0001-batch-invariant-cpu-kernels.md): a request alone and the
// same request in a batch give identical logits. Prefills
// `prompts` into one engine and greedy-decodes them together for 3 steps, then replays prompt
// `replay` alone on an engine with a different thread count and compares the last step's
// logits bit for bit.
inline void ExpectDecodeBatchInvariant(const model::LoadedModel& model,
                                       const std::vector<std::vector<int32_t>>& prompts, size_t replay,
                                       EngineOptions options = {}) {
  const int64_t V = model.config.n_vocab;
  auto batched_owner = NewEngine(model, options);
  Engine& batched = *batched_owner;
  std::vector<int32_t> seqs, tokens;
  for (size_t s = 0; s < prompts.size(); ++s) {
    auto l = batched.Prefill(static_cast<int32_t>(s), prompts[s]);
    ASSERT_TRUE(l.ok()) << l.status();
    seqs.push_back(static_cast<int32_t>(s));
    tokens.push_back(Argmax(l->data(), V));
  }
  std::vector<float> batch_logits;
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(batched.DecodeStep(seqs, tokens, &batch_logits).ok());
    for (size_t s = 0; s < prompts.size(); ++s) tokens[s] = Argmax(&batch_logits[s * V], V);
  }
  options.threads = 1;
  auto alone_owner = NewEngine(model, options);
  Engine& alone = *alone_owner;
  auto l = alone.Prefill(0, prompts[replay]);
  ASSERT_TRUE(l.ok()) << l.status();
  int32_t t = Argmax(l->data(), V);
  std::vector<float> one;
  for (int step = 0; step < 3; ++step) {
    const int32_t seq0 = 0;
    ASSERT_TRUE(alone.DecodeStep({&seq0, 1}, {&t, 1}, &one).ok());
    t = Argmax(one.data(), V);
  }
  EXPECT_EQ(0, std::memcmp(one.data(), &batch_logits[replay * V], one.size() * 4));
}

}  // namespace dd::engine::testing_util
