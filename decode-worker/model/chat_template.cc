#include "decode-worker/model/chat_template.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "decode-worker/model/tokenizer.h"

namespace dd::model {
namespace {

// ChatML templates that add a system message when the first one is not: the text they add.
std::string DefaultSystem(const std::string& t) {
  if (!absl::StrContains(t, "messages[0]['role'] != 'system'")) return "";
  const std::string open = "<|im_start|>system\n", close = "<|im_end|>";
  const size_t a = t.find(open);
  if (a == std::string::npos) return "";
  const size_t b = t.find(close, a + open.size());
  return b == std::string::npos ? "" : t.substr(a + open.size(), b - a - open.size());
}

bool InVocab(const Tokenizer& tok, const char* piece) {
  const std::vector<int32_t> ids = tok.Encode(piece, /*add_bos=*/false, /*parse_special=*/true);
  return ids.size() == 1;
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplateFor(const LoadedModel& model) {
  const std::string& t = model.chat_template;
  if (absl::StrContains(t, "<|im_start|>")) return ChatTemplate{ChatFormat::kChatMl, DefaultSystem(t)};
  if (absl::StrContains(t, "<start_of_turn>")) return ChatTemplate{ChatFormat::kGemma, ""};
  if (!t.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model ", model.config.name, ": its chat template is not one this server renders (Gemma, ChatML)"));
  }
  if (model.config.arch == Arch::kGemma3 && model.tokenizer != nullptr && InVocab(*model.tokenizer, "<start_of_turn>") &&
      InVocab(*model.tokenizer, "<end_of_turn>")) {
    return ChatTemplate{ChatFormat::kGemma, ""};  // no template in the file; Gemma 3's markers are
  }
  return absl::FailedPreconditionError(
      absl::StrCat("model ", model.config.name, " has no chat template: send a text prompt instead"));
}

absl::StatusOr<std::vector<int32_t>> RenderChat(const ChatTemplate& chat, const Tokenizer& tokenizer,
                                                const std::vector<ChatMessage>& messages) {
  if (messages.empty()) return absl::InvalidArgumentError("messages: empty");
  if (messages.size() > kMaxChatMessages) {
    return absl::InvalidArgumentError(absl::StrCat("messages: ", messages.size(), " (at most ", kMaxChatMessages, ")"));
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].role: '", r, "' (expected system, user or assistant)"));
    }
    if (r == "system" && i != 0) return absl::InvalidArgumentError(absl::StrCat("messages[", i, "]: system must be first"));
  }
  std::vector<int32_t> ids;
  auto markup = [&](const std::string& s) {  // the format's own text: special tokens parsed
    const std::vector<int32_t> t = tokenizer.Encode(s, false, /*parse_special=*/true);
    ids.insert(ids.end(), t.begin(), t.end());
  };
  auto content = [&](const std::string& s) {  // the user's text: never parsed for special tokens
    const std::vector<int32_t> t = tokenizer.Encode(s, false, /*parse_special=*/false);
    ids.insert(ids.end(), t.begin(), t.end());
  };
  if (tokenizer.add_bos() && tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
  if (chat.format == ChatFormat::kChatMl) {
    if (messages[0].role != "system" && !chat.default_system.empty()) {
      markup("<|im_start|>system\n");
      content(chat.default_system);
      markup("<|im_end|>\n");
    }
    for (const ChatMessage& m : messages) {
      markup(absl::StrCat("<|im_start|>", m.role, "\n"));
      content(m.content);
      markup("<|im_end|>\n");
    }
    markup("<|im_start|>assistant\n");
    return ids;
  }
  // Gemma: a system message becomes the start of the first user turn.
  size_t first = 0;
  std::string system;
  if (messages[0].role == "system") {
    system = messages[0].content;
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    markup(absl::StrCat("<start_of_turn>", m.role == "assistant" ? "model" : "user", "\n"));
    if (!system.empty() && m.role == "user") {
      content(absl::StrCat(system, "\n\n"));
      system.clear();
    }
    content(m.content);
    markup("<end_of_turn>\n");
  }
  markup("<start_of_turn>model\n");
  return ids;
}

}  // namespace dd::model
