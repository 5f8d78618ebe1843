#include "server/openai_request.h"

#include <fmt/format.h>

#include <cmath>

namespace nibble {
namespace {

using json = nlohmann::ordered_json;

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw RequestError(400, param, message); }

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

// A field that is absent or null counts as not given (OpenAI clients send nulls for defaults).
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<bool> get_bool(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad(name, fmt::format("'{}' must be a boolean, not {}", name, type_name(*v)));
  return v->get<bool>();
}

std::optional<int64_t> get_int(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_integer())
    x = v->get<int64_t>();
  else if (v->is_number_unsigned())
    x = v->get<uint64_t>() > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(v->get<uint64_t>());
  else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
           std::fabs(v->get<double>()) < 9e18)
    x = int64_t(v->get<double>());
  else
    bad(name, fmt::format("'{}' must be an integer, not {}", name, type_name(*v)));
  if (x < lo || x > hi) bad(name, fmt::format("'{}' is {}; it must be between {} and {}", name, x, lo, hi));
  return x;
}

std::optional<float> get_float(const json& body, const char* name, double lo, double hi, bool lo_open = false) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(name, fmt::format("'{}' must be a number, not {}", name, type_name(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi || (lo_open && x == lo))
    bad(name, fmt::format("'{}' is {}; it must be {} {} and <= {}", name, x, lo_open ? ">" : ">=", lo, hi));
  return float(x);
}

void parse_common(const json& body, ApiRequest& r, const RequestLimits& limits) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad("model", fmt::format("'model' must be a string, not {}", type_name(*m)));
    r.model = m->get<std::string>();
  }
  r.stream = get_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!r.stream) bad("stream_options", "'stream_options' can only be given when 'stream' is true");
    if (!so->is_object())
      bad("stream_options", fmt::format("'stream_options' must be an object, not {}", type_name(*so)));
    r.include_usage = get_bool(*so, "include_usage").value_or(false);
  }
  r.n = get_int(body, "n", 1, limits.max_n).value_or(1);
  // OpenAI's newer name wins when both are given.
  auto mt = get_int(body, "max_completion_tokens", INT64_MIN, INT64_MAX);
  if (!mt) mt = get_int(body, "max_tokens", INT64_MIN, INT64_MAX);
  if (mt && *mt < 1)
    bad(field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
        fmt::format("the maximum number of tokens to generate must be at least 1, not {}", *mt));
  r.max_tokens = mt;
  r.temperature = get_float(body, "temperature", 0, 1e4);
  r.top_p = get_float(body, "top_p", 0, 1, true);
  r.min_p = get_float(body, "min_p", 0, 1);
  r.repetition_penalty = get_float(body, "repetition_penalty", 0, 1e4, true);
  if (auto k = get_int(body, "top_k", -1, INT32_MAX)) r.top_k = *k;
  r.sampling.presence_penalty = get_float(body, "presence_penalty", -2, 2).value_or(0.f);
  r.sampling.frequency_penalty = get_float(body, "frequency_penalty", -2, 2).value_or(0.f);
  if (auto seed = get_int(body, "seed", INT64_MIN, INT64_MAX)) {
    r.sampling.seed = uint64_t(*seed);
    r.has_seed = true;
  }
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      r.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& s : *stop) {
        if (!s.is_string())
          bad("stop", fmt::format("'stop' must be a string or a list of strings; found {}", type_name(s)));
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      bad("stop", fmt::format("'stop' must be a string or a list of strings, not {}", type_name(*stop)));
    }
    if (int64_t(r.stop.size()) > limits.max_stop)
      bad("stop", fmt::format("at most {} stop strings, not {}", limits.max_stop, r.stop.size()));
    std::erase_if(r.stop, [](const std::string& s) { return s.empty(); });
  }
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) bad("stop_token_ids", "'stop_token_ids' must be a list of token ids");
    for (const json& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        bad("stop_token_ids", "'stop_token_ids' must be a list of token ids");
      r.stop_token_ids.push_back(int32_t(id.get<int64_t>()));
    }
  }
  r.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  r.skip_special_tokens = get_bool(body, "skip_special_tokens").value_or(true);
}

// A message's content: a string, null, or a list of parts of which only text is supported.
json message_content(const json& content, size_t i) {
  const std::string param = fmt::format("messages[{}].content", i);
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array())
    bad(param, fmt::format("'{}' must be a string or a list of parts, not {}", param, type_name(content)));
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      bad(param, fmt::format("each part of '{}' must be an object with a 'type'", param));
    const std::string type = part["type"].get<std::string>();
    if (type != "text")
      bad(param, fmt::format("content parts of type '{}' are not supported (this model takes text only)", type));
    if (!part.contains("text") || !part["text"].is_string())
      bad(param, fmt::format("a text part of '{}' needs a string 'text'", param));
    if (!text.empty()) text += '\n';  // vLLM joins text parts with newlines
    text += part["text"].get<std::string>();
  }
  return text;
}

}  // namespace

nlohmann::json RequestError::body() const {
  return {{"error",
           {{"message", what()},
            {"type", type},
            {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
            {"code", status}}}};
}

nlohmann::ordered_json parse_request_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    // nlohmann rejects invalid UTF-8 in strings as a parse error; say which it was.
    const std::string what = e.what();
    if (what.find("UTF-8") != std::string::npos) bad("", "the request body is not valid UTF-8");
    const size_t bracket = what.find("] ");
    bad("", fmt::format("the request body is not valid JSON: {}",
                        bracket == std::string::npos ? what : what.substr(bracket + 2)));
  }
  if (!j.is_object()) bad("", fmt::format("the request body must be a JSON object, not {}", type_name(j)));
  return j;
}

ApiRequest parse_chat_request(const json& body, const RequestLimits& limits) {
  ApiRequest r;
  r.kind = ApiRequest::kChat;
  parse_common(body, r, limits);
  const json* messages = field(body, "messages");
  if (!messages) bad("messages", "'messages' is required");
  if (!messages->is_array()) bad("messages", fmt::format("'messages' must be a list, not {}", type_name(*messages)));
  if (messages->empty()) bad("messages", "'messages' must not be empty");
  r.messages = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    if (!m.is_object()) bad(fmt::format("messages[{}]", i), fmt::format("messages[{}] must be an object", i));
    if (!m.contains("role") || !m["role"].is_string())
      bad(fmt::format("messages[{}].role", i), fmt::format("messages[{}] needs a string 'role'", i));
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "developer")
      bad(fmt::format("messages[{}].role", i), fmt::format("messages[{}].role '{}' is not one of system, developer, "
                                                           "user, assistant, tool",
                                                           i, role));
    json out = m;  // other fields (tool_calls, tool_call_id, name, reasoning_content) go to the template
    out["content"] = message_content(m.contains("content") ? m["content"] : json(nullptr), i);
    if (role == "assistant") {
      // As vLLM: templates expect a tool call's arguments as an object, OpenAI clients send them
      // as a JSON string.
      if (out.contains("tool_calls") && out["tool_calls"].is_array()) {
        for (size_t j = 0; j < out["tool_calls"].size(); ++j) {
          json& call = out["tool_calls"][j];
          if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
          json& args = call["function"]["arguments"];
          if (!args.is_string()) continue;
          json parsed = json::parse(args.get<std::string>(), nullptr, false);
          if (parsed.is_discarded())
            bad(fmt::format("messages[{}].tool_calls[{}].function.arguments", i, j),
                fmt::format("messages[{}].tool_calls[{}].function.arguments is not valid JSON", i, j));
          args = std::move(parsed);
        }
      }
      // A null content (a turn that only called tools) is no content: gpt-oss's template tests
      // `"..." in message.content` whenever the key exists, which fails on null in Jinja too.
      if (out["content"].is_null()) out.erase("content");
      // The reasoning a client got back as reasoning_content, where gpt-oss's template reads it.
      if (out.contains("reasoning_content") && out["reasoning_content"].is_string() && !out.contains("thinking"))
        out["thinking"] = out["reasoning_content"];
    }
    if (role != "assistant" && out["content"].is_null())  // (operator[] would put back an erased key)
      bad(fmt::format("messages[{}].content", i), fmt::format("messages[{}] ({}) needs 'content'", i, role));
    r.messages.push_back(std::move(out));
  }
  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) bad("tools", fmt::format("'tools' must be a list, not {}", type_name(*tools)));
    for (const json& t : *tools)
      if (!t.is_object() || !t.contains("function") || !t["function"].is_object() || !t["function"].contains("name"))
        bad("tools", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}");
    if (!tools->empty()) r.tools = *tools;
  }
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    r.chat_template_kwargs = *kw;
  }
  // OpenAI's reasoning_effort reaches templates that read it (gpt-oss's "Reasoning: high").
  if (const json* effort = field(body, "reasoning_effort")) {
    if (!effort->is_string() || (*effort != "low" && *effort != "medium" && *effort != "high"))
      bad("reasoning_effort", "'reasoning_effort' must be one of low, medium, high");
    if (!r.chat_template_kwargs.is_object()) r.chat_template_kwargs = json::object();
    if (!r.chat_template_kwargs.contains("reasoning_effort")) r.chat_template_kwargs["reasoning_effort"] = *effort;
  }
  r.add_generation_prompt = get_bool(body, "add_generation_prompt").value_or(true);
  if (get_bool(body, "logprobs").value_or(false)) {
    r.logprobs = get_int(body, "top_logprobs", 0, limits.max_logprobs).value_or(0);
  } else if (field(body, "top_logprobs")) {
    get_int(body, "top_logprobs", 0, limits.max_logprobs);  // type and range first
    bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  return r;
}

ApiRequest parse_completion_request(const json& body, const RequestLimits& limits) {
  ApiRequest r;
  r.kind = ApiRequest::kCompletion;
  parse_common(body, r, limits);
  const json* prompt = field(body, "prompt");
  if (!prompt) bad("prompt", "'prompt' is required");
  if (prompt->is_string()) {
    r.prompt = prompt->get<std::string>();
  } else if (prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
    for (const json& id : *prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
        bad("prompt", "a token-id 'prompt' must be a list of non-negative integers");
      r.prompt_ids.push_back(int32_t(id.get<int64_t>()));
    }
  } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
    r.prompt = (*prompt)[0].get<std::string>();
  } else if (prompt->is_array() && prompt->size() > 1) {
    bad("prompt", "batched prompts (a list of several prompts) are not supported; send one request per prompt");
  } else {
    bad("prompt", fmt::format("'prompt' must be a string or a list of token ids, not {}", type_name(*prompt)));
  }
  if (r.prompt.empty() && r.prompt_ids.empty()) bad("prompt", "'prompt' must not be empty");
  r.logprobs = get_int(body, "logprobs", 0, limits.max_logprobs).value_or(-1);
  r.echo = get_bool(body, "echo").value_or(false);
  if (const json* suffix = field(body, "suffix")) {
    if (!suffix->is_string() || !suffix->get<std::string>().empty()) bad("suffix", "'suffix' is not supported");
  }
  return r;
}

}  // namespace nibble
