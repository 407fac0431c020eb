#include "proto/request_check.h"

#include <cmath>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int64_t, max_new_tokens_limit, 8192, "the largest max_new_tokens a request may ask for (router and worker)");

namespace dd {
namespace {
constexpr int kMaxStopStrings = 16, kMaxStopIds = 256, kMaxChatMessages = 1024;
constexpr size_t kMaxStopBytes = 256;
}  // namespace

absl::Status ValidateGenerateRequest(const dd::v1::GenerateRequest& req, int64_t max_new_tokens_limit) {
  switch (req.prompt_case()) {
    case dd::v1::GenerateRequest::kText:
      if (req.text().empty()) return absl::InvalidArgumentError("prompt: text is empty");
      break;
    case dd::v1::GenerateRequest::kTokenIds:
      if (req.token_ids().ids_size() == 0) return absl::InvalidArgumentError("prompt: token_ids is empty");
      for (int32_t t : req.token_ids().ids()) {
        if (t < 0) return absl::InvalidArgumentError(absl::StrCat("prompt: token id ", t, " is negative"));
      }
      break;
    case dd::v1::GenerateRequest::kMessages: {
      const auto& ms = req.messages().messages();
      if (ms.empty()) return absl::InvalidArgumentError("prompt: messages is empty");
      if (ms.size() > kMaxChatMessages) {
        return absl::InvalidArgumentError(absl::StrCat("prompt: ", ms.size(), " messages (at most ", kMaxChatMessages, ")"));
      }
      for (int i = 0; i < ms.size(); ++i) {
        const std::string& r = ms[i].role();
        if (r != "system" && r != "user" && r != "assistant") {
          return absl::InvalidArgumentError(
              absl::StrCat("messages[", i, "].role: '", r.substr(0, 32), "' (expected system, user or assistant)"));
        }
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("prompt: empty (give text, token_ids or messages)");
  }
  if (req.has_max_new_tokens() &&
      (req.max_new_tokens() <= 0 || req.max_new_tokens() > max_new_tokens_limit)) {
    return absl::InvalidArgumentError(absl::StrCat("max_new_tokens must be in [1, ", max_new_tokens_limit,
                                                   "], got ", req.max_new_tokens()));
  }
  const dd::v1::Sampling& s = req.sampling();
  if (!(s.temperature() >= 0) || !std::isfinite(s.temperature())) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.temperature must be >= 0, got ", s.temperature()));
  }
  if (s.top_k() < 0) return absl::InvalidArgumentError(absl::StrCat("sampling.top_k must be >= 0, got ", s.top_k()));
  if (!(s.top_p() >= 0 && s.top_p() <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.top_p must be in (0, 1], got ", s.top_p()));
  }
  if (!(s.min_p() >= 0 && s.min_p() <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.min_p must be in [0, 1], got ", s.min_p()));
  }
  if (!(s.repetition_penalty() >= 0 && s.repetition_penalty() <= 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.repetition_penalty must be in (0, 10] (0: unset), got ", s.repetition_penalty()));
  }
  for (auto [name, v] : {std::pair{"frequency_penalty", s.frequency_penalty()},
                         std::pair{"presence_penalty", s.presence_penalty()}}) {
    if (!(v >= -2 && v <= 2)) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.", name, " must be in [-2, 2], got ", v));
    }
  }
  // Stop strings are matched against every text delta: their number and size are bounded.
  if (req.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat("stop: ", req.stop_size(), " strings (at most ", kMaxStopStrings, ")"));
  }
  for (const std::string& stop : req.stop()) {
    if (stop.empty()) return absl::InvalidArgumentError("stop: empty stop string");
    if (stop.size() > kMaxStopBytes) {
      return absl::InvalidArgumentError(absl::StrCat("stop: a stop string of ", stop.size(), " bytes (at most ",
                                                     kMaxStopBytes, ")"));
    }
  }
  if (req.stop_token_ids_size() > kMaxStopIds) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_token_ids: ", req.stop_token_ids_size(), " ids (at most ", kMaxStopIds, ")"));
  }
  if (req.model().size() > 256) return absl::InvalidArgumentError("model is longer than 256 bytes");
  return ValidateRequestId(req.request_id());
}

absl::Status ValidateRequestId(const std::string& id) {
  if (id.size() > 128) return absl::InvalidArgumentError("request_id is longer than 128 bytes");
  for (const unsigned char ch : id) {
    if (ch < 0x20 || ch > 0x7e) return absl::InvalidArgumentError("request_id has a byte outside printable ASCII");
  }
  return absl::OkStatus();
}

}  // namespace dd
