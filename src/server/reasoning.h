// Splits a reasoning model's output into reasoning and answer as the text streams in: Qwen3 (and
// DeepSeek-R1 style) models write their reasoning between <think> and </think>, and the OpenAI
// API returns it as `reasoning_content` beside `content` (vLLM's reasoning parsers, SGLang's
// --reasoning-parser). Tags split across tokens are held back until they are complete, so the
// deltas concatenate to the same split whatever the chunking.
#pragma once

#include <string>
#include <string_view>

namespace nibble {

class ReasoningParser {
 public:
  // starts_in_reasoning: the prompt already opened the block (a template that ends its
  // generation prompt with "<think>\n", as Qwen3-Thinking-2507 does); otherwise reasoning starts
  // only when the output begins with the open tag.
  explicit ReasoningParser(bool starts_in_reasoning = false, std::string open = "<think>",
                           std::string close = "</think>");

  struct Delta {
    std::string reasoning, content;
  };
  Delta push(std::string_view text);
  // End of the output: what was held back. An unclosed block (the token limit hit mid-thought)
  // stays reasoning.
  Delta flush();

 private:
  enum State { kStart, kReasoning, kContent };
  State state_;
  std::string open_, close_, held_;
};

}  // namespace nibble
