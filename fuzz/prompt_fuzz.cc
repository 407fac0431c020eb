// Prompt text from a client through both real tokenizers (Gemma's SentencePiece BPE and
// SmolLM2's byte-level BPE): never a crash, and Decode(Encode(s)) == s for any bytes.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "decode-worker/model/weights.h"
#include "fuzz/fuzz_util.h"

namespace {
std::vector<std::unique_ptr<dd::model::LoadedModel>>* models = nullptr;
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
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  for (const auto& m : *models) {
    const auto& tok = *m->tokenizer;
    const auto ids = tok.Encode(text, false, false);
    dd::fuzz::Require(tok.Decode(ids) == text, "Decode(Encode(s)) == s");
    (void)tok.Encode(text, true, true);  // special tokens parsed, as for chat prompts
  }
  return 0;
}
