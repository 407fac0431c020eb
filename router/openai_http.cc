#include "router/openai_http.h"

#include <arpa/inet.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/http_server.h"
#include "common/json_bounds.h"
#include "common/random.h"
#include "nlohmann/json.hpp"
#include "proto/generate.grpc.pb.h"
#include "proto/request_check.h"

namespace dd::router {
namespace {

using json = nlohmann::json;
// An Authorization value longer than this is no key of ours (keys are at most 256 characters).
constexpr size_t kMaxAuthorizationBytes = 1024;

struct HttpError {
  int status = 500;
  std::string type, message, code;
};

HttpError BadRequest(std::string message, std::string code = "invalid_request") {
  return {400, "invalid_request_error", std::move(message), std::move(code)};
}

HttpError FromGrpc(const grpc::Status& st) {
  switch (st.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      return BadRequest(st.error_message(), "invalid_request");
    case grpc::StatusCode::UNAUTHENTICATED:
      return {401, "authentication_error", st.error_message(), "invalid_api_key"};
    case grpc::StatusCode::PERMISSION_DENIED:
      return {403, "permission_error", st.error_message(), "permission_denied"};
    case grpc::StatusCode::NOT_FOUND:
      return {404, "invalid_request_error", st.error_message(), "not_found"};
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return {429, "rate_limit_error", st.error_message(), "overloaded"};
    case grpc::StatusCode::UNAVAILABLE:
      return {503, "server_error", st.error_message(), "unavailable"};
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return {504, "server_error", st.error_message(), "timeout"};
    default:
      return {500, "server_error", st.error_message(), "internal"};
  }
}

json ErrorBody(const HttpError& e) {
  return {{"error", {{"message", e.message}, {"type", e.type}, {"param", nullptr}, {"code", e.code}}}};
}

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// CORS headers for a request whose Origin header was allowed: every request with one that gets
// past Handler::Refuse (which matches it exactly against the allow-list) gets its origin back.
std::string CorsHeaders(http::Connection& c) {
  const std::string* origin = c.request().Header("Origin");
  return origin != nullptr ? absl::StrCat("Access-Control-Allow-Origin: ", *origin, "\r\nVary: Origin\r\n") : "";
}

// `cors` false: a refusal, which must not name the origin it refused.
void SendJson(http::Connection& c, int status, const json& body, bool cors = true) {
  const std::string text = Dump(body);
  c.Write(absl::StrCat("HTTP/1.1 ", status, " ", http::StatusText(status),
                       "\r\nContent-Type: application/json\r\nContent-Length: ", text.size(), "\r\n",
                       cors ? CorsHeaders(c) : "", "Connection: close\r\n\r\n", text));
}

void SendError(http::Connection& c, const HttpError& e, bool cors = true) { SendJson(c, e.status, ErrorBody(e), cors); }

// The host name of a Host header ("name:port", "[v6]:port", "1.2.3.4"), without the port.
std::string HostName(absl::string_view host) {
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    return std::string(host.substr(1, close == absl::string_view::npos ? absl::string_view::npos : close - 1));
  }
  return std::string(host.substr(0, host.find(':')));
}

bool IsIpOrLocalhost(const std::string& name) {
  if (absl::EqualsIgnoreCase(name, "localhost")) return true;
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, name.c_str(), buf) == 1 || inet_pton(AF_INET6, name.c_str(), buf) == 1;
}

// Why an Authorization value cannot be passed on as gRPC metadata (which carries printable
// ASCII only, and asserts on anything else), or nullopt when it can.
std::optional<HttpError> BadAuthorization(const std::string& value) {
  if (value.size() > kMaxAuthorizationBytes) {
    return BadRequest(absl::StrCat("the Authorization header is longer than ", kMaxAuthorizationBytes, " bytes"),
                      "invalid_authorization");
  }
  for (const unsigned char ch : value) {
    if (ch < 0x20 || ch > 0x7e) {
      return BadRequest("the Authorization header has a byte outside printable ASCII", "invalid_authorization");
    }
  }
  return std::nullopt;
}

// The request body as a JSON object (the server bounded its size before reading it; its shape
// is bounded here before a document is built).
std::optional<json> ParseBody(const http::Connection& c, HttpError* err) {
  if (absl::Status bounds = CheckJsonBounds(c.request().body); !bounds.ok()) {
    *err = BadRequest(absl::StrCat("the request body is refused: ", bounds.message()), "invalid_json");
    return std::nullopt;
  }
  json j = json::parse(c.request().body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    *err = BadRequest("the request body must be a JSON object", "invalid_json");
    return std::nullopt;
  }
  return j;
}

// Fields of the OpenAI API this server does not implement: refused by name unless absent, null
// or at their default (docs/api.md, "Request fields").
std::optional<HttpError> Unsupported(const json& j) {
  auto set = [&j](const char* f) { return j.contains(f) && !j[f].is_null(); };
  auto bad = [](const char* f, const std::string& only) {
    return BadRequest(absl::StrCat(f, ": is not supported", only.empty() ? "" : absl::StrCat(" (only ", only, ")")));
  };
  // logprobs: a boolean on chat, a count on completions.
  for (const char* f : {"logprobs", "echo", "store"}) {
    if (set(f) && !((j[f].is_boolean() && !j[f].get<bool>()) || (j[f].is_number_integer() && j[f].get<int64_t>() == 0))) {
      return bad(f, "false");
    }
  }
  if (set("top_logprobs") && !(j["top_logprobs"].is_number_integer() && j["top_logprobs"].get<int64_t>() == 0)) {
    return bad("top_logprobs", "0");
  }
  for (const char* f : {"n", "best_of"}) {
    if (set(f) && !(j[f].is_number_integer() && j[f].get<int64_t>() == 1)) return bad(f, "1");
  }
  if (set("logit_bias") && !(j["logit_bias"].is_object() && j["logit_bias"].empty())) return bad("logit_bias", "{}");
  if (set("suffix") && !(j["suffix"].is_string() && j["suffix"].get<std::string>().empty())) return bad("suffix", "\"\"");
  for (const char* f : {"tools", "functions"}) {
    if (set(f) && !(j[f].is_array() && j[f].empty())) return bad(f, "[]");
  }
  for (const char* f : {"tool_choice", "function_call"}) {
    if (set(f) && !(j[f].is_string() && j[f].get<std::string>() == "none")) return bad(f, "\"none\"");
  }
  if (set("response_format") &&
      !(j["response_format"].is_object() && j["response_format"].value("type", json()) == json("text"))) {
    return bad("response_format", "{\"type\": \"text\"}");
  }
  if (set("modalities") && j["modalities"] != json::array({"text"})) return bad("modalities", "[\"text\"]");
  for (const char* f : {"audio", "prediction", "web_search_options", "reasoning_effort"}) {
    if (set(f)) return bad(f, "");
  }
  return std::nullopt;
}

// The fields both endpoints share, into `req`; an error names the field.
std::optional<HttpError> CommonFields(const json& j, const char* max_field, v1::GenerateRequest* req, bool* stream,
                                      bool* include_usage) {
  auto bad = [](const std::string& field, const std::string& why) { return BadRequest(field + ": " + why); };
  if (auto e = Unsupported(j)) return e;
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) return bad("model", "must be a string");
    req->set_model(j["model"].get<std::string>());
  }
  // Completions default to 16 tokens, as the API does. Chat has no default length in the API (the
  // turn ends the reply): without one, the gRPC default applies (128), or the end of the turn.
  const bool chat = absl::string_view(max_field) == "max_completion_tokens";
  std::optional<int64_t> max_tokens;
  if (!chat) max_tokens = 16;
  for (const char* f : {"max_tokens", max_field}) {
    if (j.contains(f) && !j[f].is_null()) {
      if (!j[f].is_number_integer()) return bad(f, "must be an integer");
      max_tokens = j[f].get<int64_t>();
    }
  }
  if (max_tokens) req->set_max_new_tokens(*max_tokens);  // bounds are the router's (INVALID_ARGUMENT names them)
  double temperature = 1.0, top_p = 1.0;
  if (j.contains("temperature") && !j["temperature"].is_null()) {
    if (!j["temperature"].is_number() || j["temperature"].get<double>() < 0 || j["temperature"].get<double>() > 2) {
      return bad("temperature", "must be a number in [0, 2]");
    }
    temperature = j["temperature"].get<double>();
  }
  if (j.contains("top_p") && !j["top_p"].is_null()) {
    if (!j["top_p"].is_number() || !(j["top_p"].get<double>() > 0) || j["top_p"].get<double>() > 1) {
      return bad("top_p", "must be a number in (0, 1]");
    }
    top_p = j["top_p"].get<double>();
  }
  req->mutable_sampling()->set_temperature(static_cast<float>(temperature));
  req->mutable_sampling()->set_top_p(static_cast<float>(top_p));
  // Penalties (OpenAI's frequency and presence; vLLM's repetition) and min_p.
  struct Bounded {
    const char* field;
    double lo, hi;
    void (v1::Sampling::*set)(float);
  };
  for (const Bounded& b : {Bounded{"frequency_penalty", -2, 2, &v1::Sampling::set_frequency_penalty},
                           Bounded{"presence_penalty", -2, 2, &v1::Sampling::set_presence_penalty},
                           Bounded{"repetition_penalty", 0, 10, &v1::Sampling::set_repetition_penalty},
                           Bounded{"min_p", 0, 1, &v1::Sampling::set_min_p}}) {
    if (!j.contains(b.field) || j[b.field].is_null()) continue;
    const json& v = j[b.field];
    const bool open_low = absl::string_view(b.field) == "repetition_penalty";
    if (!v.is_number() || v.get<double>() > b.hi || v.get<double>() < b.lo || (open_low && v.get<double>() == b.lo)) {
      return bad(b.field, absl::StrCat("must be a number in ", open_low ? "(" : "[", b.lo, ", ", b.hi, "]"));
    }
    (req->mutable_sampling()->*b.set)(static_cast<float>(v.get<double>()));
  }
  // ignore_eos (vLLM's): generate to max_tokens, past end-of-generation tokens.
  if (j.contains("ignore_eos") && !j["ignore_eos"].is_null()) {
    if (!j["ignore_eos"].is_boolean()) return bad("ignore_eos", "must be true or false");
    req->set_ignore_eos(j["ignore_eos"].get<bool>());
  }
  // top_k: not in OpenAI's API, but vLLM and llama-server take it and clients send it.
  if (j.contains("top_k") && !j["top_k"].is_null()) {
    if (!j["top_k"].is_number_integer() || j["top_k"].get<int64_t>() < -1 || j["top_k"].get<int64_t>() > (1 << 20)) {
      return bad("top_k", "must be an integer in [-1, 1048576] (0 or -1: off)");
    }
    req->mutable_sampling()->set_top_k(static_cast<int32_t>(std::max<int64_t>(0, j["top_k"].get<int64_t>())));
  }
  if (j.contains("seed") && !j["seed"].is_null()) {
    if (!j["seed"].is_number_integer() || j["seed"].get<int64_t>() < 0) return bad("seed", "must be an integer >= 0");
    req->mutable_sampling()->set_seed(j["seed"].get<uint64_t>());
  }
  if (j.contains("stop") && !j["stop"].is_null()) {
    const json& s = j["stop"];
    if (s.is_string()) {
      req->add_stop(s.get<std::string>());
    } else if (s.is_array() && s.size() <= 4) {
      for (const json& x : s) {
        if (!x.is_string()) return bad("stop", "must be a string or up to 4 strings");
        req->add_stop(x.get<std::string>());
      }
    } else {
      return bad("stop", "must be a string or up to 4 strings");
    }
  }
  *stream = false;
  if (j.contains("stream") && !j["stream"].is_null()) {
    if (!j["stream"].is_boolean()) return bad("stream", "must be true or false");
    *stream = j["stream"].get<bool>();
  }
  *include_usage = false;
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& so = j["stream_options"];
    if (!*stream) return bad("stream_options", "only allowed with \"stream\": true");
    if (!so.is_object()) return bad("stream_options", "must be an object");
    if (so.contains("include_usage") && !so["include_usage"].is_null()) {
      if (!so["include_usage"].is_boolean()) return bad("stream_options.include_usage", "must be true or false");
      *include_usage = so["include_usage"].get<bool>();
    }
  }
  return std::nullopt;
}

std::string FinishReason(const std::string& stop_reason) {
  return stop_reason == "max_tokens" || stop_reason == "context_full" ? "length" : "stop";
}

int64_t Now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct OpenAiHttp::Handler {
  Handler(const HttpOptions& o, std::shared_ptr<grpc::Channel> channel)
      : options(o), stub(v1::DualDecoder::NewStub(channel)) {}

  // 403 for a browser origin not on the allow-list, or a Host name the endpoint does not
  // answer (a DNS-rebinding page uses its own name); checked before anything else.
  std::optional<HttpError> Refuse(const http::Connection& c) const {
    if (const std::string* host = c.request().Header("Host"); host != nullptr) {
      const std::string name = HostName(*host);
      const bool listed = std::find(options.allowed_hosts.begin(), options.allowed_hosts.end(), name) !=
                          options.allowed_hosts.end();
      if (!options.allowed_hosts.empty() ? !listed : options.open_api && !IsIpOrLocalhost(name)) {
        return HttpError{403, "invalid_request_error",
                         absl::StrCat("Host '", name, "' is not served here: ",
                                      options.allowed_hosts.empty()
                                          ? "without API keys only IP addresses and localhost are (against DNS "
                                            "rebinding); list names with --http_allowed_hosts"
                                          : "it is not in --http_allowed_hosts"),
                         "host_not_allowed"};
      }
    }
    if (const std::string* origin = c.request().Header("Origin"); origin != nullptr) {
      if (std::find(options.cors_origins.begin(), options.cors_origins.end(), *origin) == options.cors_origins.end()) {
        return HttpError{403, "invalid_request_error",
                         "browser requests from this origin are not allowed (the server's --http_cors_origins)",
                         "origin_not_allowed"};
      }
    }
    return std::nullopt;
  }

  void Handle(http::Connection& c) {
    const std::string& method = c.request().method;
    if (auto e = Refuse(c)) return SendError(c, *e, /*cors=*/false);
    if (method == "OPTIONS") return Options(c);
    if (method == "GET") return Get(c);
    if (method == "POST") return Post(c);
    SendError(c, {405, "invalid_request_error", "method " + method + " is not served here", "method_not_allowed"});
  }

  // CORS preflight: allowed origins may send GET and POST with Authorization and Content-Type.
  void Options(http::Connection& c) {
    c.Write(absl::StrCat("HTTP/1.1 204 No Content\r\n", CorsHeaders(c),
                         "Access-Control-Allow-Methods: GET, POST, OPTIONS\r\n"
                         "Access-Control-Allow-Headers: Authorization, Content-Type, X-Stream-Id, Last-Event-ID\r\nAccess-Control-Max-Age: 600\r\n"
                         "Content-Length: 0\r\nConnection: close\r\n\r\n"));
  }

  // Passes the caller's Authorization on as gRPC metadata, or says why it cannot be. CheckHead
  // refused such a value already; this keeps every gRPC call safe on its own.
  static std::optional<HttpError> AddAuthorization(const http::Request& r, grpc::ClientContext* ctx) {
    if (const std::string* auth = r.Header("Authorization"); auth != nullptr) {
      if (std::optional<HttpError> e = BadAuthorization(*auth)) return e;
      ctx->AddMetadata("authorization", *auth);
    }
    return std::nullopt;
  }

  // AddAuthorization, answering the client when it fails; false then.
  static bool Authorize(http::Connection& c, grpc::ClientContext* ctx) {
    if (std::optional<HttpError> e = AddAuthorization(c.request(), ctx)) {
      SendError(c, *e);
      return false;
    }
    return true;
  }

  // On the server's loop thread, before any body byte is kept: a value gRPC cannot carry, and
  // with API keys a missing or unknown key, are answered here.
  std::optional<http::Refusal> CheckHead(const http::Request& head) const {
    if (head.method == "OPTIONS") return std::nullopt;  // a CORS preflight carries no key
    const std::string* auth = head.Header("Authorization");
    std::optional<HttpError> e;
    if (auth != nullptr) e = BadAuthorization(*auth);
    if (!e && options.auth.enabled() && !IsHealth(head)) {
      std::string tenant;
      const grpc::Status st =
          options.auth.TenantOf(auth != nullptr ? std::optional<absl::string_view>(*auth) : std::nullopt, &tenant);
      if (!st.ok()) e = FromGrpc(st);
    }
    if (!e) return std::nullopt;
    return http::Refusal{e->status, "application/json", Dump(ErrorBody(*e))};
  }

  // GET /health (also /v1/health), as vLLM and llama-server answer it: 200 {"status": "ok"} while
  // a decode worker is up, else 503. It needs no key (the router's Health needs none).
  void Health(http::Connection& c) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::HealthResponse resp;
    if (grpc::Status st = stub->Health(&ctx, {}, &resp); !st.ok()) return SendError(c, FromGrpc(st));
    if (!resp.serving()) {
      return SendJson(c, 503, {{"status", "unavailable"}, {"message", resp.message()}, {"workers_up", 0}});
    }
    SendJson(c, 200, {{"status", "ok"}, {"workers_up", resp.workers_up()}});
  }

  static bool IsHealth(const http::Request& r) {
    return r.method == "GET" && (r.path == "/health" || r.path == "/v1/health");
  }

  void Get(http::Connection& c) {
    const std::string& uri = c.request().path;
    if (IsHealth(c.request())) return Health(c);
    if (uri != "/v1/models") return SendError(c, {404, "invalid_request_error", "no such endpoint: GET " + uri, "not_found"});
    grpc::ClientContext ctx;
    if (!Authorize(c, &ctx)) return;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListModelsResponse resp;
    if (grpc::Status st = stub->ListModels(&ctx, {}, &resp); !st.ok()) return SendError(c, FromGrpc(st));
    json data = json::array();
    for (const v1::ModelInfo& m : resp.models()) {
      data.push_back({{"id", m.name()}, {"object", "model"}, {"created", 0}, {"owned_by", "dualdecoder"},
                      {"context_length", m.context_tokens()}});
    }
    SendJson(c, 200, {{"object", "list"}, {"data", data}});
  }

  void Post(http::Connection& c) {
    const std::string& uri = c.request().path;
    const bool chat = uri == "/v1/chat/completions";
    if (!chat && uri != "/v1/completions") {
      return SendError(c, {404, "invalid_request_error", "no such endpoint: POST " + uri, "not_found"});
    }
    HttpError err;
    std::optional<json> j = ParseBody(c, &err);
    if (!j) return SendError(c, err);
    v1::GenerateRequest req;
    bool stream = false, include_usage = false;
    if (auto e = CommonFields(*j, chat ? "max_completion_tokens" : "max_tokens", &req, &stream, &include_usage)) {
      return SendError(c, *e);
    }
    if (auto e = chat ? Messages(*j, &req) : Prompt(*j, &req)) return SendError(c, *e);
    if (auto e = Resumable(c.request(), stream, &req)) return SendError(c, *e);
    Generate(c, req, chat, stream, include_usage);
  }

  // A streamed request the client names with `X-Stream-Id` is kept by its worker when the
  // connection drops (docs/decisions/0050-resumable-streams.md): its events carry SSE ids
  // "ID.TOKENS", and the same request sent again with `Last-Event-ID: ID.TOKENS` goes on from
  // there. Unnamed requests are cancelled when their client hangs up. (Not X-Request-Id:
  // proxies add that one to every request, which would keep every stream a client drops.)
  static std::optional<HttpError> Resumable(const http::Request& r, bool stream, v1::GenerateRequest* req) {
    const std::string* named = stream ? r.Header("X-Stream-Id") : nullptr;
    const std::string* last = r.Header("Last-Event-ID");
    if (last != nullptr) {
      if (!stream) return BadRequest("Last-Event-ID resumes a streamed request: set \"stream\": true");
      const size_t dot = last->rfind('.');
      int64_t index = 0;
      if (dot == std::string::npos || !absl::SimpleAtoi(last->substr(dot + 1), &index) || index < 0) {
        return BadRequest("Last-Event-ID: not an event id of this server (ID.TOKENS)", "invalid_last_event_id");
      }
      req->set_request_id(last->substr(0, dot));
      req->set_resume_from_index(index);
    } else if (named != nullptr) {
      req->set_request_id(*named);
    }
    if (req->request_id().empty() && (named != nullptr || last != nullptr)) {
      return BadRequest("X-Stream-Id / Last-Event-ID: the stream id is empty", "invalid_request_id");
    }
    if (absl::Status st = ValidateRequestId(req->request_id()); !st.ok()) {
      return BadRequest(std::string(st.message()), "invalid_request_id");
    }
    return std::nullopt;
  }

  static std::optional<HttpError> Prompt(const json& j, v1::GenerateRequest* req) {
    if (!j.contains("prompt")) return BadRequest("prompt: missing");
    const json& p = j["prompt"];
    if (p.is_string()) {
      req->set_text(p.get<std::string>());
    } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
      req->set_text(p[0].get<std::string>());
    } else {
      return BadRequest("prompt: must be a string (one prompt per request)");
    }
    return std::nullopt;
  }

  static std::optional<HttpError> Messages(const json& j, v1::GenerateRequest* req) {
    if (!j.contains("messages") || !j["messages"].is_array()) return BadRequest("messages: must be an array");
    auto* out = req->mutable_messages();
    for (size_t i = 0; i < j["messages"].size(); ++i) {
      const json& m = j["messages"][i];
      const std::string at = absl::StrCat("messages[", i, "]");
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) return BadRequest(at + ".role: missing");
      std::string content;
      if (auto e = Content(m, at, &content)) return e;
      auto* msg = out->add_messages();
      msg->set_role(m["role"].get<std::string>());
      msg->set_content(std::move(content));
    }
    return std::nullopt;
  }

  // A message's content: a string, or a list of text parts ({"type": "text", "text": ...}) joined
  // by newlines, as vLLM joins them; any other part type is refused by name.
  static std::optional<HttpError> Content(const json& m, const std::string& at, std::string* out) {
    if (!m.contains("content")) return BadRequest(at + ".content: missing");
    const json& content = m["content"];
    if (content.is_string()) {
      *out = content.get<std::string>();
      return std::nullopt;
    }
    if (!content.is_array()) return BadRequest(at + ".content: must be a string or a list of text parts");
    for (size_t k = 0; k < content.size(); ++k) {
      const json& part = content[k];
      const std::string pat = absl::StrCat(at, ".content[", k, "]");
      if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
        return BadRequest(pat + ".type: missing (a part is {\"type\": \"text\", \"text\": ...})");
      }
      const std::string type = part["type"].get<std::string>();
      if (type != "text") {
        std::string shown = type.substr(0, 64);
        for (char& ch : shown) {
          if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) > 0x7e) ch = '?';
        }
        return BadRequest(absl::StrCat(pat, ".type: '", shown, "' is not supported (only text parts)"));
      }
      if (!part.contains("text") || !part["text"].is_string()) return BadRequest(pat + ".text: must be a string");
      if (k > 0) out->push_back('\n');
      *out += part["text"].get<std::string>();
    }
    return std::nullopt;
  }

  json Chunk(const std::string& id, const std::string& model, bool chat, const std::string& delta, bool first,
             const std::optional<std::string>& finish) const {
    json choice = {{"index", 0}, {"finish_reason", finish ? json(*finish) : json(nullptr)}};
    if (chat) {
      json d = json::object();
      if (first) d["role"] = "assistant";
      if (!delta.empty() || !finish) d["content"] = delta;
      choice["delta"] = d;
    } else {
      choice["text"] = delta;
      choice["logprobs"] = nullptr;
    }
    return {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", Now()},
            {"model", model}, {"choices", json::array({choice})}};
  }

  static json Usage(const v1::Usage& usage) {
    return {{"prompt_tokens", usage.prompt_tokens()}, {"completion_tokens", usage.completion_tokens()},
            {"total_tokens", usage.prompt_tokens() + usage.completion_tokens()}};
  }

  // Streamed with include_usage: every chunk carries "usage": null, and one more chunk with no
  // choices carries the usage before [DONE] (OpenAI's stream_options).
  void Generate(http::Connection& c, const v1::GenerateRequest& req, bool chat, bool stream, bool include_usage) {
    const bool named = stream && !req.request_id().empty();
    const std::string id = named ? req.request_id() : absl::StrCat(chat ? "chatcmpl-" : "cmpl-", RandomHex(2));
    const std::string model = req.model().empty() ? ServedModel(c) : req.model();
    auto chunk = [&](const std::string& delta, bool first, const std::optional<std::string>& finish) {
      json j = Chunk(id, model, chat, delta, first, finish);
      if (include_usage) j["usage"] = nullptr;
      return j;
    };
    grpc::ClientContext ctx;
    if (!Authorize(c, &ctx)) return;
    // A client that hangs up cancels its request, streamed or not, in prefill or in decode.
    c.OnHangup([&ctx] { ctx.TryCancel(); });
    struct ClearHangup {
      http::Connection& c;
      ~ClearHangup() { c.OnHangup(nullptr); }  // before ctx goes
    } clear{c};
    auto reader = stub->Generate(&ctx, req);
    v1::GenerateResponse resp;
    std::string text;
    v1::Usage usage;
    bool started = false;
    while (reader->Read(&resp)) {
      if (resp.has_usage()) usage = resp.usage();
      text += resp.text();
      if (!stream) continue;
      if (!started) {
        c.Write(absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n",
                             CorsHeaders(c), "Connection: close\r\n\r\n"));
      }
      if (!resp.text().empty() || !started) {
        // A named stream's events carry how many tokens the client has after each: where a
        // reconnect (Last-Event-ID) resumes.
        const std::string event_id =
            named ? absl::StrCat(id, ".", resp.first_token_index() + resp.token_ids_size()) : "";
        if (!Event(c, chunk(resp.text(), !started, std::nullopt), event_id)) {
          ctx.TryCancel();  // the client went away
          break;
        }
      }
      started = true;
    }
    const grpc::Status st = reader->Finish();
    if (!st.ok() && !started) return SendError(c, FromGrpc(st));
    if (stream) {
      if (!st.ok()) {
        Event(c, ErrorBody(FromGrpc(st)));
      } else {
        Event(c, chunk("", false, FinishReason(usage.stop_reason())));
        if (include_usage) {
          Event(c, {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", Now()},
                    {"model", model}, {"choices", json::array()}, {"usage", Usage(usage)}});
        }
      }
      c.Write("data: [DONE]\n\n");
      return;
    }
    json choice = {{"index", 0}, {"finish_reason", FinishReason(usage.stop_reason())}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["text"] = text;
      choice["logprobs"] = nullptr;
    }
    SendJson(c, 200, {{"id", id}, {"object", chat ? "chat.completion" : "text_completion"}, {"created", Now()},
                      {"model", model}, {"choices", json::array({choice})}, {"usage", Usage(usage)}});
  }

  static bool Event(http::Connection& c, const json& j, const std::string& event_id = "") {
    return c.Write(absl::StrCat(event_id.empty() ? "" : absl::StrCat("id: ", event_id, "\n"), "data: ", Dump(j), "\n\n"));
  }

  // The one model served, for responses to requests that named none.
  std::string ServedModel(const http::Connection& c) const {
    grpc::ClientContext ctx;
    if (AddAuthorization(c.request(), &ctx)) return "";
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListModelsResponse resp;
    if (!stub->ListModels(&ctx, {}, &resp).ok() || resp.models().empty()) return "";
    return resp.models(0).name();
  }

  HttpOptions options;
  std::unique_ptr<v1::DualDecoder::Stub> stub;
};

absl::StatusOr<std::unique_ptr<OpenAiHttp>> OpenAiHttp::Start(const HttpOptions& http,
                                                              std::shared_ptr<grpc::Channel> channel) {
  std::unique_ptr<OpenAiHttp> h(new OpenAiHttp());
  h->handler_ = std::make_unique<Handler>(http, std::move(channel));
  http::ServerOptions o;
  o.listen = http.listen;
  o.threads = http.threads;
  o.queue = 4 * http.threads;
  o.max_per_client = http.max_connections_per_client;
  o.request_timeout_ms = 10000;
  o.write_timeout_ms = 30000;
  o.max_body_bytes = http.max_body_bytes;
  o.max_buffered_body_bytes = std::max<int64_t>(o.max_body_bytes, o.max_buffered_body_bytes);
  o.name = "http";
  Handler* handler = h->handler_.get();
  auto server = http::Server::Start(
      o, [handler](http::Connection& c) { handler->Handle(c); },
      [handler](const http::Request& head) { return handler->CheckHead(head); });
  if (!server.ok()) return server.status();
  h->server_ = std::move(*server);
  h->port_ = h->server_->port();
  return h;
}

OpenAiHttp::~OpenAiHttp() { server_.reset(); }  // running handlers finish before the handler goes

}  // namespace dd::router
