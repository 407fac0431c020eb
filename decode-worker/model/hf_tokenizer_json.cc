// Tokenizer::SpecFromHfTokenizerJson: Hugging Face tokenizer.json (+ tokenizer_config.json) ->
// TokenizerSpec.
//
// Supported: model.type "BPE" either with byte_fallback (SentencePiece-like: Llama-2, Gemma) or
// with a ByteLevel pre-tokenizer whose regex is GPT-2's, Llama-3's or Qwen2's. A SentencePiece-
// like file has merges but no scores, so scores are derived from merge ranks: a piece scores
// -(rank of the first merge producing it); multi-character pieces no merge produces are marked
// kUnused so the score-driven merging cannot produce them either (as HF's BPE cannot).
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "decode-worker/model/tokenizer.h"
#include "decode-worker/model/unicode_data.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"

namespace dd::model {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class HfParser {
 public:
  explicit HfParser(std::string path) : path_(std::move(path)) {}

  absl::StatusOr<TokenizerSpec> Parse();

 private:
  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": field '", field, "' ", what));
  }
  absl::StatusOr<Json> ReadJson(const std::string& path) const;
  absl::Status ReadVocab(const Json& model);
  absl::Status ReadMerges(const Json& model);
  absl::Status ReadAddedTokens(const Json& root);
  absl::Status ReadPreTokenizer(const Json& root);
  void ReadSpacePrefix(const Json& root);
  absl::Status ReadSpecialIds(const Json& root, const Json& model);
  void DeriveSpmScores();
  int32_t IdOf(const std::string& text) const {
    auto it = id_of_.find(text);
    return it == id_of_.end() ? -1 : it->second;
  }

  std::string path_;
  TokenizerSpec spec_;
  absl::flat_hash_map<std::string, int32_t> id_of_;
  std::vector<bool> present_;
};

// Nodes of a (possibly "Sequence"-nested) normalizer / pre_tokenizer / post_processor.
void Flatten(const Json& node, std::vector<const Json*>* out) {
  if (!node.is_object()) return;
  auto type = node.find("type");
  if (type != node.end() && *type == "Sequence") {
    for (const char* key : {"normalizers", "pretokenizers", "processors", "decoders"}) {
      auto it = node.find(key);
      if (it != node.end() && it->is_array()) {
        for (const Json& child : *it) Flatten(child, out);
      }
    }
    return;
  }
  out->push_back(&node);
}

std::string TypeOf(const Json& node) {
  auto it = node.find("type");
  return it != node.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// tokenizer_config.json token fields are a string or {"content": string}.
std::string TokenContent(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return {};
}

absl::StatusOr<Json> HfParser::ReadJson(const std::string& path) const {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open file"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  Json json = Json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  }
  if (!json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": top level is not a JSON object"));
  }
  return json;
}

absl::Status HfParser::ReadVocab(const Json& model) {
  auto vocab = model.find("vocab");
  if (vocab == model.end()) return Error("model.vocab", "is missing");
  if (!vocab->is_object()) return Error("model.vocab", "is not an object of token -> id");
  if (vocab->empty()) return Error("model.vocab", "is empty");
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() >= (int64_t{1} << 30)) {
      return Error(absl::StrCat("model.vocab[\"", it.key(), "\"]"),
                   "is not a non-negative integer id");
    }
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    if (static_cast<size_t>(id) >= spec_.tokens.size()) {
      spec_.tokens.resize(id + 1);
      present_.resize(id + 1, false);
    }
    if (present_[id]) {
      return Error(absl::StrCat("model.vocab[\"", it.key(), "\"]"),
                   absl::StrCat("reuses id ", id, " of '", spec_.tokens[id], "'"));
    }
    spec_.tokens[id] = it.key();
    present_[id] = true;
    id_of_.try_emplace(it.key(), id);
  }
  return absl::OkStatus();
}

absl::Status HfParser::ReadMerges(const Json& model) {
  auto merges = model.find("merges");
  if (merges == model.end() || merges->is_null()) return absl::OkStatus();
  if (!merges->is_array()) return Error("model.merges", "is not an array");
  spec_.merges.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    const Json& m = (*merges)[i];
    if (m.is_string()) {
      spec_.merges.push_back(m.get<std::string>());
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      spec_.merges.push_back(absl::StrCat(m[0].get<std::string>(), " ", m[1].get<std::string>()));
    } else {
      return Error(absl::StrCat("model.merges[", i, "]"),
                   "is neither \"left right\" nor [\"left\", \"right\"]");
    }
  }
  return absl::OkStatus();
}

absl::Status HfParser::ReadAddedTokens(const Json& root) {
  auto added = root.find("added_tokens");
  if (added == root.end() || added->is_null()) return absl::OkStatus();
  if (!added->is_array()) return Error("added_tokens", "is not an array");
  for (size_t i = 0; i < added->size(); ++i) {
    const Json& t = (*added)[i];
    const std::string field = absl::StrCat("added_tokens[", i, "]");
    if (!t.is_object()) return Error(field, "is not an object");
    auto id_it = t.find("id");
    auto content_it = t.find("content");
    if (id_it == t.end() || !id_it->is_number_integer() || id_it->get<int64_t>() < 0 ||
        id_it->get<int64_t>() >= (int64_t{1} << 30)) {
      return Error(field + ".id", "is missing or not a non-negative integer");
    }
    if (content_it == t.end() || !content_it->is_string()) {
      return Error(field + ".content", "is missing or not a string");
    }
    auto special_it = t.find("special");
    const bool special =
        special_it != t.end() && special_it->is_boolean() && special_it->get<bool>();
    const auto id = static_cast<int32_t>(id_it->get<int64_t>());
    const std::string content = content_it->get<std::string>();
    if (static_cast<size_t>(id) >= spec_.tokens.size()) {
      spec_.tokens.resize(id + 1);
      present_.resize(id + 1, false);
    }
    if (present_[id] && spec_.tokens[id] != content) {
      return Error(field, absl::StrCat("gives id ", id, " to '", content, "' but model.vocab has '",
                                       spec_.tokens[id], "' there"));
    }
    spec_.tokens[id] = content;
    present_[id] = true;
    id_of_.insert_or_assign(content, id);
    spec_.types.resize(spec_.tokens.size(), TokenType::kNormal);
    spec_.types[id] = special ? TokenType::kControl : TokenType::kUserDefined;
  }
  return absl::OkStatus();
}

absl::Status HfParser::ReadPreTokenizer(const Json& root) {
  std::vector<const Json*> nodes;
  if (auto it = root.find("pre_tokenizer"); it != root.end()) Flatten(*it, &nodes);
  std::string regex;
  bool byte_level = false, byte_level_regex = false;
  for (const Json* node : nodes) {
    const std::string type = TypeOf(*node);
    if (type == "ByteLevel") {
      byte_level = true;
      byte_level_regex = node->value("use_regex", true);
      if (node->value("add_prefix_space", false)) {
        return Error("pre_tokenizer.ByteLevel.add_prefix_space", "= true is not supported");
      }
    } else if (type == "Split") {
      auto pattern = node->find("pattern");
      if (pattern == node->end() || !pattern->is_object() || !pattern->contains("Regex") ||
          !(*pattern)["Regex"].is_string()) {
        return Error("pre_tokenizer.Split.pattern", "is not {\"Regex\": string}");
      }
      if (node->value("behavior", std::string()) != "Isolated" || node->value("invert", false)) {
        return Error("pre_tokenizer.Split", "must have behavior Isolated and invert false");
      }
      if (!regex.empty()) return Error("pre_tokenizer", "has more than one Split");
      regex = (*pattern)["Regex"].get<std::string>();
    } else {
      return Error("pre_tokenizer", absl::StrCat("type '", type, "' is not supported"));
    }
  }
  if (!byte_level) {
    return Error("pre_tokenizer",
                 "has no ByteLevel step and model.byte_fallback is not set: "
                 "not a supported BPE tokenizer");
  }
  if (!regex.empty() && byte_level_regex) {
    return Error("pre_tokenizer", "has both a Split regex and ByteLevel.use_regex");
  }
  if (regex.empty()) {
    if (!byte_level_regex) {
      return Error("pre_tokenizer", "ByteLevel has use_regex false and no Split");
    }
    spec_.pre = "gpt2";
  } else if (regex == kLlama3Regex) {
    spec_.pre = "llama3";
  } else if (regex == kQwen2Regex) {
    spec_.pre = "qwen2";
  } else if (regex == kGpt2Regex) {
    spec_.pre = "gpt2";
  } else {
    return Error("pre_tokenizer.Split.pattern.Regex",
                 absl::StrCat("'", regex, "' is not a supported pre-tokenizer regex"));
  }
  return absl::OkStatus();
}

void HfParser::ReadSpacePrefix(const Json& root) {
  std::vector<const Json*> nodes;
  if (auto it = root.find("normalizer"); it != root.end()) Flatten(*it, &nodes);
  if (auto it = root.find("pre_tokenizer"); it != root.end()) Flatten(*it, &nodes);
  for (const Json* node : nodes) {
    const std::string type = TypeOf(*node);
    if (type == "Prepend" && node->value("prepend", std::string()) == "\xE2\x96\x81") {
      spec_.add_space_prefix = true;
    } else if (type == "Metaspace") {
      const std::string scheme = node->value("prepend_scheme", std::string());
      spec_.add_space_prefix = scheme == "always" || scheme == "first" ||
                               (scheme.empty() && node->value("add_prefix_space", false));
    }
  }
}

absl::Status HfParser::ReadSpecialIds(const Json& root, const Json& model) {
  // BOS: the first element of the post-processor's single-sequence template.
  std::vector<const Json*> nodes;
  if (auto it = root.find("post_processor"); it != root.end()) Flatten(*it, &nodes);
  for (const Json* node : nodes) {
    if (TypeOf(*node) != "TemplateProcessing") continue;
    auto single = node->find("single");
    if (single == node->end() || !single->is_array() || single->empty()) continue;
    const Json& first = (*single)[0];
    if (first.is_object() && first.contains("SpecialToken") && first["SpecialToken"].is_object() &&
        first["SpecialToken"].contains("id") && first["SpecialToken"]["id"].is_string()) {
      const std::string name = first["SpecialToken"]["id"].get<std::string>();
      spec_.bos_id = IdOf(name);
      if (spec_.bos_id < 0) {
        return Error("post_processor.single[0].SpecialToken.id",
                     absl::StrCat("names '", name, "', which is not a token"));
      }
      spec_.add_bos = true;
    }
  }
  if (auto it = model.find("unk_token"); it != model.end() && it->is_string()) {
    spec_.unk_id = IdOf(it->get<std::string>());
  }
  // tokenizer_config.json next to tokenizer.json, when there is one, names bos/eos/pad.
  const std::filesystem::path config_path =
      std::filesystem::path(path_).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(config_path, ec)) {
    absl::StatusOr<Json> config = ReadJson(config_path.string());
    if (!config.ok()) return config.status();
    auto lookup = [&](const char* key, int32_t* id) -> absl::Status {
      const std::string name = TokenContent(*config, key);
      if (name.empty()) return absl::OkStatus();
      *id = IdOf(name);
      if (*id >= 0) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": field '", key,
                                                     "' names '", name, "', which is not a token"));
    };
    RETURN_IF_ERROR(lookup("bos_token", &spec_.bos_id));
    RETURN_IF_ERROR(lookup("eos_token", &spec_.eos_id));
    RETURN_IF_ERROR(lookup("pad_token", &spec_.pad_id));
    RETURN_IF_ERROR(lookup("unk_token", &spec_.unk_id));
    if (auto it = config->find("add_bos_token"); it != config->end() && it->is_boolean()) {
      spec_.add_bos = it->get<bool>() && spec_.bos_id >= 0;
    }
  }
  // No eos named anywhere: take the first well-known end-of-text/turn token. Only added
  // (control/user-defined) tokens count: "</s>" may be plain text in a byte-level vocab.
  // Create() marks all of them as end-of-generation.
  for (std::string_view name : internal::kEndOfGenerationNames) {
    if (spec_.eos_id >= 0) break;
    const int32_t id = IdOf(std::string(name));
    if (id >= 0 && spec_.types[id] != TokenType::kNormal) spec_.eos_id = id;
  }
  return absl::OkStatus();
}

void HfParser::DeriveSpmScores() {
  const size_t n = spec_.tokens.size();
  spec_.scores.assign(n, 0.0f);
  std::vector<bool> produced(n, false);
  for (size_t rank = 0; rank < spec_.merges.size(); ++rank) {
    const std::string& merge = spec_.merges[rank];
    // SentencePiece pieces hold '▁', never ' ', so the first space separates the halves.
    const size_t space = merge.find(' ');
    if (space == std::string::npos) continue;
    const int32_t id = IdOf(merge.substr(0, space) + merge.substr(space + 1));
    if (id < 0 || produced[id]) continue;
    produced[id] = true;
    spec_.scores[id] = -static_cast<float>(rank);
  }
  for (size_t id = 0; id < n; ++id) {
    const std::string& text = spec_.tokens[id];
    if (spec_.types[id] == TokenType::kNormal && !produced[id] && !text.empty() &&
        unicode::DecodeUtf8(text, 0).len < text.size()) {
      spec_.types[id] = TokenType::kUnused;  // more than one character, no merge makes it
    }
  }
  spec_.merges.clear();  // the SPM algorithm works from scores
}

absl::StatusOr<TokenizerSpec> HfParser::Parse() {
  absl::StatusOr<Json> root_or = ReadJson(path_);
  if (!root_or.ok()) return root_or.status();
  const Json& root = *root_or;
  auto model_it = root.find("model");
  if (model_it == root.end()) return Error("model", "is missing");
  const Json& model = *model_it;
  if (!model.is_object()) return Error("model", "is not an object");
  const std::string type = TypeOf(model);
  if (!type.empty() && type != "BPE") {
    return Error("model.type", absl::StrCat("'", type, "' is not supported (only BPE)"));
  }
  RETURN_IF_ERROR(ReadVocab(model));
  RETURN_IF_ERROR(ReadMerges(model));
  spec_.types.assign(spec_.tokens.size(), TokenType::kNormal);
  RETURN_IF_ERROR(ReadAddedTokens(root));
  spec_.types.resize(spec_.tokens.size(), TokenType::kNormal);
  size_t missing = 0;
  for (size_t id = 0; id < spec_.tokens.size(); ++id) {
    if (!present_[id]) {
      spec_.types[id] = TokenType::kUnused;  // an id nobody names: keep ids dense
      ++missing;
    }
  }
  if (missing > 0) LOG(WARNING) << path_ << ": " << missing << " ids in [0, vocab) have no token";
  auto fallback_it = model.find("byte_fallback");
  if (fallback_it != model.end() && !fallback_it->is_boolean() && !fallback_it->is_null()) {
    return Error("model.byte_fallback", "is not a boolean");
  }
  const bool byte_fallback =
      fallback_it != model.end() && fallback_it->is_boolean() && fallback_it->get<bool>();
  RETURN_IF_ERROR(ReadSpecialIds(root, model));
  if (byte_fallback) {
    spec_.kind = TokenizerSpec::Kind::kSentencePieceBpe;
    for (size_t id = 0; id < spec_.tokens.size(); ++id) {
      const std::string& t = spec_.tokens[id];
      if (spec_.types[id] == TokenType::kNormal && t.size() == 6 && t.rfind("<0x", 0) == 0 &&
          t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
          std::isxdigit(static_cast<unsigned char>(t[4]))) {
        spec_.types[id] = TokenType::kByte;
      }
    }
    if (spec_.unk_id >= 0 && spec_.types[spec_.unk_id] == TokenType::kNormal) {
      spec_.types[spec_.unk_id] = TokenType::kUnknown;
    }
    ReadSpacePrefix(root);
    DeriveSpmScores();
  } else {
    spec_.kind = TokenizerSpec::Kind::kByteLevelBpe;
    RETURN_IF_ERROR(ReadPreTokenizer(root));
    std::vector<const Json*> normalizers;
    if (auto it = root.find("normalizer"); it != root.end()) Flatten(*it, &normalizers);
    for (const Json* node : normalizers) {
      LOG(WARNING) << path_ << ": normalizer '" << TypeOf(*node)
                   << "' is not applied (input is tokenized as given)";
    }
  }
  return std::move(spec_);
}

}  // namespace

absl::StatusOr<TokenizerSpec> Tokenizer::SpecFromHfTokenizerJson(const std::string& path) {
  try {
    return HfParser(path).Parse();
  } catch (const std::exception& e) {  // nlohmann type errors we did not anticipate
    return absl::InvalidArgumentError(absl::StrCat(path, ": malformed tokenizer.json: ", e.what()));
  }
}

}  // namespace dd::model
