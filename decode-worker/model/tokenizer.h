// Text <-> token ids for the supported models.
//
// Two algorithms, picked by TokenizerSpec::kind:
//  - SentencePiece-style BPE with byte fallback (Gemma; GGUF tokenizer.ggml.model "llama"):
//    spaces become U+2581 '▁', the text is split into UTF-8 characters and the adjacent pair
//    whose concatenation is the highest-scoring vocabulary piece is merged until none is left;
//    characters outside the vocabulary become <0xXX> byte tokens.
//  - GPT-2 byte-level BPE (Llama-3, Qwen2): a hand-written matcher for the model's
//    pre-tokenizer regex splits the text, each piece's bytes are mapped to printable code points
//    and merged by merge rank.
// Control and user-defined tokens are split out of the text before either algorithm runs.
//
// Decode(Encode(s)) == s for any byte string s, valid UTF-8 or not, whose bytes the vocabulary
// can all represent (SPM with byte fallback: every byte; byte-level BPE: the bytes that have a
// token — SmolLM2's vocabulary lacks 21, e.g. 0xC0, 0xF5-0xFF, which are dropped; fuzz/prompt
// checks this). To keep that promise a
// literal U+2581 in SPM input is encoded with byte tokens rather than with a '▁' piece (which
// decodes as a space), and the add_space_prefix space goes only before text at the very start
// of the input (as SentencePiece does; llama.cpp also adds one after every special token).
//
// A Tokenizer is immutable after Create(): all const methods are thread-safe. It owns its spec.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace dd::model {

// GGUF tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

struct TokenizerSpec {
  enum class Kind { kSentencePieceBpe, kByteLevelBpe };
  Kind kind = Kind::kSentencePieceBpe;
  // id -> piece. SPM: '▁' for space, "<0xAB>" byte tokens; byte-level: GPT-2 bytes->unicode
  // mapped text. Control and user-defined tokens hold their literal text.
  std::vector<std::string> tokens;
  // SPM merge priority (higher merges first), one per token; may be empty for byte-level.
  std::vector<float> scores;
  std::vector<TokenType> types;     // same length as tokens; empty means all kNormal
  std::vector<std::string> merges;  // byte-level BPE merges "left right", rank = index
  std::string pre = "default";      // byte-level pre-tokenizer (GGUF tokenizer.ggml.pre)
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  // End-of-generation ids. Create adds eos_id and every control/user-defined token named in
  // internal::kEndOfGenerationNames (<end_of_turn>, <|eot_id|>, <|im_end|>, ...), as llama.cpp
  // does, so a spec read from a file that lists only eos still stops at the end of a turn.
  std::vector<int32_t> eog_ids;
  bool add_bos = false;
  bool add_space_prefix = false;  // SPM only
};

class Tokenizer {
 public:
  // Validates the spec (sizes consistent, ids in range, byte tokens present, merges referencing
  // known tokens, known pre-tokenizer) and builds the lookup tables. InvalidArgument names the
  // offending field.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(TokenizerSpec spec);

  // Parses a Hugging Face tokenizer.json (BPE model: byte-level, or SentencePiece-like with
  // byte_fallback) into a spec. added_tokens become kControl ("special": true) or kUserDefined.
  // BOS/EOS come from the post-processor template and, when present, tokenizer_config.json
  // next to the file. Errors name the file and the field. Implemented in hf_tokenizer_json.cc.
  static absl::StatusOr<TokenizerSpec> SpecFromHfTokenizerJson(const std::string& path);

  // Not copyable or movable: the lookup tables hold views into the owned spec.
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Tokenizes `text`; prepends bos_id when `add_bos` and the vocabulary has one.
  // User-defined tokens are always matched in the text (as llama.cpp does); control tokens only
  // when `parse_special`, otherwise their text is tokenized like any other. Matching is
  // leftmost-longest.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, bool parse_special) const;

  // Concatenated token bytes. Control (and unknown) tokens render as nothing unless
  // `render_special`, then as their text. With add_space_prefix, one leading space is removed
  // from the first token after an optional BOS if it is a BPE piece (normal or byte token),
  // undoing Encode's prefix.
  // Out-of-range ids render as nothing.
  std::string Decode(absl::Span<const int32_t> ids, bool render_special = false) const;

  // The raw bytes one token contributes (possibly a partial UTF-8 sequence, e.g. a byte-fallback
  // token). For streaming, together with Utf8StreamBuffer. No space-prefix stripping.
  std::string TokenBytes(int32_t id, bool render_special = false) const;

  int32_t vocab_size() const { return static_cast<int32_t>(spec_.tokens.size()); }
  int32_t bos_id() const { return spec_.bos_id; }
  int32_t eos_id() const { return spec_.eos_id; }
  bool add_bos() const { return spec_.add_bos; }
  bool IsEndOfGeneration(int32_t id) const;
  const TokenizerSpec& spec() const { return spec_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };

  explicit Tokenizer(TokenizerSpec spec) : spec_(std::move(spec)) {}
  absl::Status Init();           // tokenizer.cc: validation and tables shared by both kinds
  absl::Status InitSpm();        // tokenizer_spm.cc
  absl::Status InitByteLevel();  // tokenizer_bpe.cc
  void BuildSpecialTrie();
  // Token id of the longest control/user-defined token starting at text[pos] (control ones only
  // when parse_special), or -1; sets *len to its length.
  int32_t MatchSpecial(std::string_view text, size_t pos, bool parse_special, size_t* len) const;
  void EncodeSpm(std::string_view text, bool space_prefix, std::vector<int32_t>* out) const;
  void EncodeByteLevel(std::string_view text, std::vector<int32_t>* out) const;
  void EncodeByteLevelWord(std::string_view word, std::vector<int32_t>* out) const;
  bool IsMergeable(int32_t id) const;  // may be produced by the BPE of plain text

  TokenizerSpec spec_;
  std::vector<std::string> rendered_;  // TokenBytes(id, false) for every id
  // Pieces the BPE may produce (normal/undefined types), piece text -> id. Views into spec_.
  absl::flat_hash_map<std::string_view, int32_t> piece_to_id_;
  // SPM: id of <0xXX> (-1 if absent). Byte-level: id of the byte's mapped code point.
  std::array<int32_t, 256> byte_token_{};
  absl::flat_hash_map<uint64_t, Merge> merges_;  // byte-level: (left << 32 | right) -> merge
  int pre_ = 0;                                  // internal::PreTokenizer, byte-level only
  bool ignore_merges_ = false;  // byte-level: a whole pre-token in the vocab is emitted as is
  // Trie over control/user-defined/unknown token texts.
  std::vector<int32_t> trie_token_;                   // node -> token id or -1
  absl::flat_hash_map<uint64_t, int32_t> trie_edge_;  // (node << 8 | byte) -> child node
  std::array<bool, 256> trie_first_byte_{};
  std::vector<bool> is_eog_;
};

// Streaming helper: feed token bytes, get back the longest prefix that does not end inside a
// UTF-8 sequence that may still complete. Bytes that can never become valid UTF-8 are passed
// through as they are (the caller decides whether to replace them). Not thread-safe.
class Utf8StreamBuffer {
 public:
  std::string Push(std::string_view bytes);
  // Returns whatever is pending (possibly an incomplete sequence) and resets.
  std::string Flush();

 private:
  std::string pending_;
};

namespace internal {
// Tokens that end a text or a turn in the supported model families, end-of-text first (a
// tokenizer.json without an eos takes the first one present).
inline constexpr std::string_view kEndOfGenerationNames[] = {
    "<|end_of_text|>", "<|endoftext|>", "<eos>",      "</s>",
    "<|eot_id|>",      "<|eom_id|>",    "<|im_end|>", "<end_of_turn>",
};

// Exposed for tests and for tokenizer_bpe.cc.
// kSmollm: SmolLM/SmolLM2 (HF Digits(individual_digits) then GPT-2 ByteLevel).
enum class PreTokenizer { kGpt2 = 0, kLlama3 = 1, kQwen2 = 2, kSmollm = 3 };
// GGUF tokenizer.ggml.pre name -> pre-tokenizer; nullopt when unknown.
std::optional<PreTokenizer> PreTokenizerFromName(std::string_view name);
// Splits text the way the pre-tokenizer regex's find-all would; the pieces (views into text)
// concatenate back to text. Invalid UTF-8 bytes count as "other" characters.
std::vector<std::string_view> SplitPreTokens(std::string_view text, PreTokenizer kind);
// The GPT-2 byte -> printable code point mapping.
uint32_t ByteToUnicode(uint8_t byte);
}  // namespace internal

}  // namespace dd::model
