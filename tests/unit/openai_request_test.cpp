// OpenAI request parsing (every field's type and range, with the parameter named in the error, as
// the server will return it) and the streaming <think> splitter behind reasoning_content.
#include "server/openai_request.h"

#include <gtest/gtest.h>

#include "server/reasoning.h"
#include "tokenizer/chat_template.h"

#include <fstream>
#include <sstream>

namespace nibble {
namespace {

using json = nlohmann::ordered_json;

json chat_body() {
  return json::parse(R"({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})");
}

TEST(OpenAiRequest, ChatFieldsAndDefaults) {
  json b = chat_body();
  ApiRequest r = parse_chat_request(b);
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.messages[1]["content"], "a\nb");  // text parts joined
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.max_tokens);
  EXPECT_FALSE(r.temperature);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_TRUE(r.tools.is_null());

  b["stream"] = true;
  b["stream_options"] = {{"include_usage", true}};
  b["max_tokens"] = 10;
  b["max_completion_tokens"] = 20;  // the newer name wins
  b["temperature"] = 0;
  b["top_p"] = 0.5;
  b["top_k"] = -1;
  b["seed"] = -3;
  b["stop"] = "END";
  b["logprobs"] = true;
  b["top_logprobs"] = 5;
  b["presence_penalty"] = nullptr;  // null = not given
  b["chat_template_kwargs"] = {{"enable_thinking", false}};
  b["tools"] = json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {}}}])");
  b["unknown_extension"] = {1, 2};  // ignored, as vLLM does
  r = parse_chat_request(b);
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(*r.max_tokens, 20);
  EXPECT_EQ(*r.temperature, 0.f);
  EXPECT_EQ(*r.top_k, -1);
  EXPECT_TRUE(r.has_seed);
  EXPECT_EQ(int64_t(r.sampling.seed), -3);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_EQ(r.logprobs, 5);
  EXPECT_EQ(r.chat_template_kwargs["enable_thinking"], false);
  EXPECT_EQ(r.tools.size(), 1u);
  EXPECT_FALSE(r.chat_template_kwargs.contains("reasoning_effort"));

  // An assistant turn as OpenAI clients send it back: arguments as a JSON string, reasoning as
  // reasoning_content. Templates get the arguments as an object and the reasoning as `thinking`
  // too (gpt-oss's name for it).
  json turn = json::parse(R"({"messages": [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": null, "reasoning_content": "Need the tool.",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})");
  ApiRequest t = parse_chat_request(turn);
  EXPECT_EQ(t.messages[1]["tool_calls"][0]["function"]["arguments"]["city"], "Oslo");
  EXPECT_EQ(t.messages[1]["thinking"], "Need the tool.");
  // Rendered by gpt-oss's own template: the call as harmony writes it, arguments encoded once,
  // the reasoning before it on the analysis channel.
  std::ifstream file(std::string(NIBBLE_FIXTURES_DIR) + "/chat_templates/gpt-oss.jinja");
  std::stringstream source;
  source << file.rdbuf();
  const std::string text = ChatTemplate::parse(source.str(), "gpt-oss.jinja")
                               .render({{"messages", t.messages}, {"add_generation_prompt", true}});
  EXPECT_NE(text.find("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
                      "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                      "{\"city\": \"Oslo\"}<|call|>"),
            std::string::npos)
      << text;
  turn["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json";
  EXPECT_THROW(parse_chat_request(turn), RequestError);

  // reasoning_effort goes to the template as a kwarg; an explicit chat_template_kwargs entry wins.
  b["reasoning_effort"] = "high";
  EXPECT_EQ(parse_chat_request(b).chat_template_kwargs["reasoning_effort"], "high");
  b["chat_template_kwargs"]["reasoning_effort"] = "low";
  EXPECT_EQ(parse_chat_request(b).chat_template_kwargs["reasoning_effort"], "low");
}

TEST(OpenAiRequest, CompletionPrompts) {
  ApiRequest r = parse_completion_request(json::parse(R"({"prompt": "def f", "logprobs": 2, "echo": false})"));
  EXPECT_EQ(r.prompt, "def f");
  EXPECT_EQ(r.logprobs, 2);
  r = parse_completion_request(json::parse(R"({"prompt": [1, 2, 3]})"));
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  r = parse_completion_request(json::parse(R"({"prompt": ["only one"]})"));
  EXPECT_EQ(r.prompt, "only one");
}

// Each bad body: status 400 (404 is the server's, for unknown models), the parameter, and words
// of the message.
TEST(OpenAiRequest, BadRequestsNameTheParameter) {
  struct Case {
    const char* body;
    bool chat;
    const char* param;
    const char* says;
  };
  const Case cases[] = {
      {R"({})", true, "messages", "required"},
      {R"({"messages": "hi"})", true, "messages", "must be a list"},
      {R"({"messages": []})", true, "messages", "must not be empty"},
      {R"({"messages": [1]})", true, "messages[0]", "must be an object"},
      {R"({"messages": [{"content": "x"}]})", true, "messages[0].role", "role"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", true, "messages[0].role", "'wizard'"},
      {R"({"messages": [{"role": "user"}]})", true, "messages[0].content", "needs 'content'"},
      {R"({"messages": [{"role": "user", "content": 5}]})", true, "messages[0].content", "string or a list"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})", true,
       "messages[0].content", "'image_url' are not supported"},
      {R"({"messages": [{"role": "user", "content": "x"}], "model": 3})", true, "model", "must be a string"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", true, "max_tokens", "at least 1"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5})", true,
       "max_completion_tokens", "at least 1"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"})", true, "max_tokens", "integer"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5})", true, "max_tokens", "integer"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": -1})", true, "temperature", ">= 0"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})", true, "temperature", "number"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 0})", true, "top_p", "> 0"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5})", true, "top_p", "<= 1"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_k": -2})", true, "top_k", "between -1"},
      {R"({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3})", true, "presence_penalty", "<= 2"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 0})", true, "n", "between 1 and 16"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 1000})", true, "n", "between 1 and 16"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": 5})", true, "stop", "list of strings"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a", 1]})", true, "stop", "list of strings"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream": "yes"})", true, "stream", "boolean"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}})", true,
       "stream_options", "only be given when 'stream' is true"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})", true, "top_logprobs",
       "needs 'logprobs': true"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 50})", true,
       "top_logprobs", "between 0 and 20"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", true, "tools",
       "each tool"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]})", true, "chat_template_kwargs",
       "object"},
      {R"({"messages": [{"role": "user", "content": "x"}], "seed": "abc"})", true, "seed", "integer"},
      {R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"})", true, "reasoning_effort",
       "low, medium, high"},
      {R"({})", false, "prompt", "required"},
      {R"({"prompt": ""})", false, "prompt", "must not be empty"},
      {R"({"prompt": ["a", "b"]})", false, "prompt", "batched prompts"},
      {R"({"prompt": [1, -2]})", false, "prompt", "non-negative"},
      {R"({"prompt": {"x": 1}})", false, "prompt", "string or a list of token ids"},
      {R"({"prompt": "x", "logprobs": 21})", false, "logprobs", "between 0 and 20"},
      {R"({"prompt": "x", "suffix": "tail"})", false, "suffix", "not supported"},
  };
  for (const Case& c : cases) {
    try {
      const json body = json::parse(c.body);
      if (c.chat)
        parse_chat_request(body);
      else
        parse_completion_request(body);
      ADD_FAILURE() << c.body << ": accepted";
    } catch (const RequestError& e) {
      EXPECT_EQ(e.status, 400) << c.body;
      EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.what();
      EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << c.body << " -> " << e.what();
      const nlohmann::json err = e.body();
      EXPECT_EQ(err["error"]["param"], c.param);
      EXPECT_EQ(err["error"]["type"], "BadRequestError");
      EXPECT_EQ(err["error"]["code"], 400);
    }
  }
}

TEST(OpenAiRequest, BodiesThatAreNotJsonObjects) {
  const std::pair<std::string, const char*> cases[] = {
      {"{\"messages\": [", "not valid JSON"},  {"", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},     {"\"text\"", "must be a JSON object"},
      {"{\"prompt\": \"\xff\xfe\"}", "UTF-8"},
  };
  for (auto& [body, says] : cases) {
    try {
      parse_request_body(body);
      ADD_FAILURE() << body << ": accepted";
    } catch (const RequestError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << body << " -> " << e.what();
    }
  }
  EXPECT_EQ(parse_request_body("{\"a\": 1}")["a"], 1);
}

ReasoningParser::Delta run_chunks(const std::string& text, size_t chunk, bool starts_in_reasoning = false) {
  ReasoningParser p(starts_in_reasoning);
  ReasoningParser::Delta all;
  for (size_t i = 0; i < text.size(); i += chunk) {
    auto d = p.push(std::string_view(text).substr(i, chunk));
    all.reasoning += d.reasoning;
    all.content += d.content;
  }
  auto d = p.flush();
  all.reasoning += d.reasoning;
  all.content += d.content;
  return all;
}

TEST(ReasoningParser, SplitsThinkBlocksWhateverTheChunking) {
  struct Case {
    std::string text;
    bool starts_in_reasoning;
    std::string reasoning, content;
  };
  const Case cases[] = {
      {"<think>\nadd them\n</think>\n\nThe sum is 3.", false, "\nadd them\n", "\n\nThe sum is 3."},
      {"No reasoning here, <think> in the middle stays.", false, "", "No reasoning here, <think> in the middle stays."},
      {"\n<think>x</think>y", false, "x", "y"},
      {"<think>cut off by the token lim", false, "cut off by the token lim", ""},
      {"<thin", false, "", "<thin"},
      {"already thinking</think>answer", true, "already thinking", "answer"},
      {"</thinking> is not the tag</think>done", true, "</thinking> is not the tag", "done"},
      {"<think></think>", false, "", ""},
      {"Ünïcødé <think>", false, "", "Ünïcødé <think>"},
  };
  for (const Case& c : cases) {
    for (size_t chunk = 1; chunk <= c.text.size(); ++chunk) {
      auto d = run_chunks(c.text, chunk, c.starts_in_reasoning);
      EXPECT_EQ(d.reasoning, c.reasoning) << c.text << " in chunks of " << chunk;
      EXPECT_EQ(d.content, c.content) << c.text << " in chunks of " << chunk;
    }
  }
}

TEST(ReasoningParser, ReasoningIsNotHeldBackLongerThanATag) {
  ReasoningParser p;
  EXPECT_EQ(p.push("<think>").reasoning, "");
  EXPECT_EQ(p.push("long thought ").reasoning, "long thought ");
  EXPECT_EQ(p.push("then </th").reasoning, "then ");  // only a possible tag is held
  auto d = p.push("ink>ok");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "ok");
}

}  // namespace
}  // namespace nibble

namespace nibble {
namespace {

// Output as the harmony parser splits it, pushed in chunks of `chunk` bytes.
struct Split {
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
};
Split run_harmony(const std::string& text, size_t chunk) {
  HarmonyParser p;
  Split s;
  auto take = [&](const OutputSplitter::Delta& d) {
    s.reasoning += d.reasoning;
    s.content += d.content;
    for (auto& t : d.tool_calls) {
      if (!t.name.empty()) {
        EXPECT_EQ(size_t(t.index), s.calls.size());
        s.calls.push_back({t.name, ""});
      }
      s.calls.at(size_t(t.index)).second += t.arguments;
    }
  };
  for (size_t i = 0; i < text.size(); i += chunk) take(p.push(std::string_view(text).substr(i, chunk)));
  take(p.flush());
  return s;
}

TEST(HarmonyParser, SplitsChannelsWhateverTheChunking) {
  struct Case {
    std::string text, reasoning, content;
    std::vector<std::pair<std::string, std::string>> calls;
  };
  const Case cases[] = {
      // What gpt-oss writes after `<|start|>assistant` (<|return|> is a stop token: not in the text).
      {"<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|><|start|>assistant<|channel|>final<|message|>"
       "2 + 2 = 4.",
       "User asks 2+2. Answer 4.", "2 + 2 = 4.", {}},
      // A function call: the recipient in the channel part, a constrained format, arguments as the body.
      {"<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
       "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}",
       "Need weather.", "", {{"get_weather", "{\"city\": \"Oslo\"}"}}},
      // The recipient in the role part, a preamble on commentary first, then two calls.
      {"<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant to=functions.a<|channel|>commentary"
       "<|message|>{}<|end|><|start|>assistant to=functions.b<|channel|>commentary json<|message|>{\"x\":1}",
       "", "Checking both.", {{"a", "{}"}, {"b", "{\"x\":1}"}}},
      // A built-in tool (browser) is not a client function: its call is dropped.
      {"<|channel|>analysis<|message|>search<|end|><|start|>assistant<|channel|>analysis to=browser.search"
       "<|message|>{\"query\": \"x\"}<|end|><|start|>assistant<|channel|>final<|message|>done",
       "search", "done", {}},
      // Cut off by the token limit mid-thought: reasoning so far, no content.
      {"<|channel|>analysis<|message|>still thin", "still thin", "", {}},
      // A model that ignores the format: all content.
      {"Plain answer, no channels.", "", "Plain answer, no channels.", {}},
      // Text that looks like a marker inside a body is text.
      {"<|channel|>final<|message|>use <|channel|> tokens and <| carefully", "",
       "use <|channel|> tokens and <| carefully", {}},
      {"", "", "", {}},
  };
  for (const Case& c : cases) {
    for (size_t chunk = 1; chunk <= std::max<size_t>(1, c.text.size()); ++chunk) {
      Split s = run_harmony(c.text, chunk);
      ASSERT_EQ(s.reasoning, c.reasoning) << c.text << " in chunks of " << chunk;
      ASSERT_EQ(s.content, c.content) << c.text << " in chunks of " << chunk;
      ASSERT_EQ(s.calls, c.calls) << c.text << " in chunks of " << chunk;
    }
  }
}

TEST(HarmonyParser, StreamsBodiesWithoutWaitingForTheirEnd) {
  HarmonyParser p;
  EXPECT_EQ(p.push("<|channel|>").reasoning, "");
  EXPECT_EQ(p.push("analysis").reasoning, "");
  EXPECT_EQ(p.push("<|message|>").reasoning, "");
  EXPECT_EQ(p.push("Think").reasoning, "Think");
  EXPECT_EQ(p.push("ing <|e").reasoning, "ing ");  // only a possible marker is held
  auto d = p.push("nd|><|start|>assistant<|channel|>final<|message|>Hi");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "Hi");
}

}  // namespace
}  // namespace nibble
