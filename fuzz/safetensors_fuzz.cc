// A safetensors file from an attacker: the header (JSON length, dtypes, shapes, offsets) must
// be validated before anything is read through it.
#include "decode-worker/model/safetensors.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dd::fuzz::MemFile f(data, size);
  auto st = dd::model::SafetensorsFile::Open(f.path());
  if (st.ok()) {
    for (const auto& [name, t] : (*st)->tensors()) {
      volatile uint8_t sink = 0;
      if (t.n_bytes > 0) sink = t.data[t.n_bytes - 1];  // in bounds by contract: ASan checks it
      (void)sink;
      (void)t.KernelDType();
    }
  }
  return 0;
}
