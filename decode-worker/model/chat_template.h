// Chat prompts (docs/decisions/0005-model-runtime-conventions.md): a list of {role, content}
// messages rendered in the model's own chat format, as token ids. The format comes from the file's
// `tokenizer.chat_template` (Jinja, which we do not execute: we recognize the two families below),
// or, for a file without one whose vocabulary has Gemma's turn markers, Gemma's format. Anything
// else is refused with an error naming the problem.
//   Gemma:  <bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n...
//           (assistant turns are "model"; a system message joins the first user turn)
//   ChatML: <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n (a default system
//           message when the template has one, as SmolLM2's does)
// Only the format's own markers are parsed as special tokens; message contents never are, so a
// user cannot forge a turn by writing "<|im_start|>" in a message.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "decode-worker/model/weights.h"

namespace dd::model {

struct ChatMessage {
  std::string role;     // system, user or assistant
  std::string content;
};

enum class ChatFormat { kGemma, kChatMl };

struct ChatTemplate {
  ChatFormat format = ChatFormat::kChatMl;
  std::string default_system;  // ChatML: used when the first message is not a system message
};

// The model's chat format, or FAILED_PRECONDITION when it has none we can render.
absl::StatusOr<ChatTemplate> ChatTemplateFor(const LoadedModel& model);

// Token ids of `messages` followed by the assistant's turn header (the generation prompt).
// INVALID_ARGUMENT names the message: no messages, an unknown role, a system message that is
// not first, more than kMaxChatMessages.
inline constexpr size_t kMaxChatMessages = 1024;
absl::StatusOr<std::vector<int32_t>> RenderChat(const ChatTemplate& chat, const Tokenizer& tokenizer,
                                                const std::vector<ChatMessage>& messages);

}  // namespace dd::model
