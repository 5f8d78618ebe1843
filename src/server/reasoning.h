// Splits a reasoning model's output into reasoning and answer as the text streams in: Qwen3 (and
// DeepSeek-R1 style) models write their reasoning between <think> and </think>, gpt-oss on the
// harmony `analysis` channel, and the OpenAI API returns it as `reasoning_content` beside `content`
// (vLLM's reasoning parsers, SGLang's --reasoning-parser). Tags split across tokens are held back
// until they are complete, so the deltas concatenate to the same split whatever the chunking.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace nibble {

// A model's output text, split as it streams in into what the OpenAI API returns apart.
class OutputSplitter {
 public:
  // A call of a tool (harmony's messages addressed to=functions.NAME): `name` is set on the delta
  // that opens call `index`, later deltas of the same call carry more of its arguments.
  struct ToolCallDelta {
    int index = 0;
    std::string name, arguments;
  };
  struct Delta {
    std::string reasoning, content;
    std::vector<ToolCallDelta> tool_calls;
  };
  virtual ~OutputSplitter() = default;
  virtual Delta push(std::string_view text) = 0;
  // End of the output: what was held back.
  virtual Delta flush() = 0;
};

class ReasoningParser final : public OutputSplitter {
 public:
  // starts_in_reasoning: the prompt already opened the block (a template that ends its
  // generation prompt with "<think>\n", as Qwen3-Thinking-2507 does); otherwise reasoning starts
  // only when the output begins with the open tag.
  explicit ReasoningParser(bool starts_in_reasoning = false, std::string open = "<think>",
                           std::string close = "</think>");

  Delta push(std::string_view text) override;
  // An unclosed block (the token limit hit mid-thought) stays reasoning.
  Delta flush() override;

 private:
  enum State { kStart, kReasoning, kContent };
  State state_;
  std::string open_, close_, held_;
};

// gpt-oss's harmony format (the text must keep its special tokens: decode without skipping them).
// The prompt ends with `<|start|>assistant`; the model then writes messages
//   [ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>FORMAT]<|message|>BODY<|end|>
// each later one opened by `<|start|>assistant`, the last ended by <|return|> or <|call|> (stop
// tokens: the engine does not pass them on). Bodies on the `analysis` channel are reasoning;
// `final` and `commentary` bodies without a recipient are content; a body addressed to
// `functions.NAME` is a call of tool NAME with the body as its arguments. Markers split across
// chunks are held back; text outside any message (a model that ignores the format) is content.
class HarmonyParser final : public OutputSplitter {
 public:
  Delta push(std::string_view text) override;
  Delta flush() override;

 private:
  enum State { kHeader, kBody };
  enum Target { kReasoning, kContent, kToolCall, kDropped };
  void open_message(Delta& d);
  void emit(Delta& d, std::string_view text);
  State state_ = kHeader;
  Target target_ = kContent;
  std::string held_, header_;
  int tool_calls_ = 0;
};

}  // namespace nibble
