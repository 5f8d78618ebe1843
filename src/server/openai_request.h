// OpenAI-compatible request bodies (POST /v1/chat/completions and /v1/completions) parsed into
// what the engine needs, with every field checked the way vLLM and the OpenAI API check it. A bad
// request becomes a RequestError carrying the HTTP status and the offending parameter, which the
// server returns in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "runtime/sampler.h"

namespace nibble {

class RequestError : public Error {
 public:
  RequestError(int http_status, std::string param, const std::string& message, std::string type = "")
      : Error(message),
        status(http_status),
        param(std::move(param)),
        type(type.empty() ? (http_status == 404 ? "NotFoundError" : "BadRequestError") : std::move(type)) {}
  int status;
  std::string param, type;
  // {"error": {"message", "type", "param", "code"}}, as OpenAI and vLLM return it.
  nlohmann::json body() const;
};

struct ApiRequest {
  enum Kind { kChat, kCompletion };
  Kind kind = kChat;
  std::string model;                // as given (empty: the served model)
  nlohmann::ordered_json messages;  // chat: [{role, content (string or null), ...}], parts joined
  nlohmann::ordered_json tools;     // chat: null or the list of tool definitions
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
  std::string prompt;               // completions: text prompt
  std::vector<int32_t> prompt_ids;  // completions: token-id prompt
  bool stream = false, include_usage = false;
  int64_t n = 1;
  std::optional<int64_t> max_tokens;  // max_tokens or max_completion_tokens
  SamplingParams sampling;            // seed: 0 when not given (see has_seed)
  bool has_seed = false;
  std::optional<float> temperature, top_p, min_p, repetition_penalty;  // unset: the model's default
  std::optional<int64_t> top_k;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false, skip_special_tokens = true;
  int64_t logprobs = -1;  // -1: none; chat: top_logprobs when logprobs is true; completions: the int
  bool echo = false;      // completions
};

// The limits a server applies on top of the schema.
struct RequestLimits {
  int64_t max_n = 16;
  int64_t max_stop = 16;
  int64_t max_logprobs = 20;
};

ApiRequest parse_chat_request(const nlohmann::ordered_json& body, const RequestLimits& limits = {});
ApiRequest parse_completion_request(const nlohmann::ordered_json& body, const RequestLimits& limits = {});

// A request body as JSON, or a 400 naming what is wrong (not JSON, not an object, invalid UTF-8).
nlohmann::ordered_json parse_request_body(const std::string& body);

}  // namespace nibble
