// Prompt text from a client through both real tokenizers (Gemma's SentencePiece BPE and
// SmolLM2's byte-level BPE): never a crash, and Decode(Encode(s)) == s whenever the vocabulary
// can represent every byte of s. (SmolLM2's vocabulary has no token for 21 byte values — 0xC0,
// 0xC1, 0xF1, 0xF2, 0xF5-0xFF and some control bytes — so those bytes cannot survive; the fuzzer
// found that the tokenizer drops them silently.)
#include <array>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "decode-worker/model/weights.h"
#include "fuzz/fuzz_util.h"

namespace {
std::vector<std::unique_ptr<dd::model::LoadedModel>>* models = nullptr;
std::vector<std::array<bool, 256>>* representable = nullptr;  // per model: byte b round-trips alone
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  models = new std::vector<std::unique_ptr<dd::model::LoadedModel>>();
  const char* env = std::getenv("DD_MODEL_DIR");
  const std::string dir = env != nullptr ? env : std::string(std::getenv("HOME") ? std::getenv("HOME") : "") +
                                                     "/.cache/dualdecoder/models";
  for (const char* name : {"gemma-3-270m-q4_k_m.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"}) {
    auto m = dd::model::LoadGguf(dir + "/" + name);
    if (m.ok()) {
      models->push_back(*std::move(m));
    } else if (const char* req = std::getenv("DD_REQUIRE_MODEL"); req != nullptr && std::string(req) == "1") {
      fprintf(stderr, "prompt_fuzz: %s missing in %s (scripts/fetch-model)\n", name, dir.c_str());
      std::abort();
    }
  }
  if (models->empty()) fprintf(stderr, "prompt_fuzz: no model tokenizer found; inputs are not exercised\n");
  representable = new std::vector<std::array<bool, 256>>();
  for (const auto& m : *models) {
    std::array<bool, 256> ok{};
    for (int b = 0; b < 256; ++b) {
      const std::string one(1, static_cast<char>(b));
      ok[b] = m->tokenizer->Decode(m->tokenizer->Encode(one, false, false)) == one;
    }
    representable->push_back(ok);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (size_t k = 0; k < models->size(); ++k) {
    const auto& tok = *(*models)[k]->tokenizer;
    const auto ids = tok.Encode(text, false, false);
    bool all = true;
    for (unsigned char c : text) all &= (*representable)[k][c];
    if (all) dd::fuzz::Require(tok.Decode(ids) == text, "Decode(Encode(s)) == s");
    (void)tok.Encode(text, true, true);  // special tokens parsed, as for chat prompts
  }
  return 0;
}
