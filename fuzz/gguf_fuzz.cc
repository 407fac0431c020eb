// A GGUF file from an attacker: the whole loader (header, metadata, tokenizer, config, tensor
// table against the file size) must refuse it with an error or load it, never crash or hang.
#include "decode-worker/model/weights.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dd::fuzz::MemFile f(data, size);
  auto model = dd::model::LoadGguf(f.path());
  if (model.ok() && (*model)->tokenizer != nullptr) {
    (void)(*model)->tokenizer->Encode("hello world", true, true);
  }
  return 0;
}
