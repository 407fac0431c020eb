// A GenerateRequest from a client (any bytes that parse as one): the validator shared by the
// router and the worker must answer OK or INVALID_ARGUMENT, and what it accepts must be within
// the documented bounds.
#include "fuzz/fuzz_util.h"
#include "proto/generate.pb.h"
#include "proto/request_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dd::v1::GenerateRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  const absl::Status st = dd::ValidateGenerateRequest(req, 8192);
  if (st.ok()) {
    dd::fuzz::Require(!req.has_max_new_tokens() || (req.max_new_tokens() >= 1 && req.max_new_tokens() <= 8192),
                      "max_new_tokens bounded");
    dd::fuzz::Require(req.stop_size() <= 16 && req.stop_token_ids_size() <= 256, "stops bounded");
    dd::fuzz::Require(req.request_id().size() <= 128, "request_id bounded");
    for (const unsigned char ch : req.request_id()) {
      dd::fuzz::Require(ch >= 0x20 && ch <= 0x7e, "request_id printable (it is written to logs)");
    }
  } else {
    dd::fuzz::Require(st.code() == absl::StatusCode::kInvalidArgument, "refusals are INVALID_ARGUMENT");
  }
  return 0;
}
