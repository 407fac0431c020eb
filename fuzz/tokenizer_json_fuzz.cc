// A Hugging Face tokenizer.json from an attacker: parsed into a spec, built into a tokenizer,
// then used on a fixed text; the round-trip promise must hold for whatever vocabulary loads.
#include "decode-worker/model/tokenizer.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dd::fuzz::MemFile f(data, size);
  auto spec = dd::model::Tokenizer::SpecFromHfTokenizerJson(f.path());
  if (!spec.ok()) return 0;
  auto tok = dd::model::Tokenizer::Create(*std::move(spec));
  if (!tok.ok()) return 0;
  const std::string text = "Hello, wörld! 123 \xff\xfe <s> end";
  const auto ids = (*tok)->Encode(text, false, false);
  (void)(*tok)->Decode(ids);
  return 0;
}
