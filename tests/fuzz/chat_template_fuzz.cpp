// libFuzzer target: the chat template engine on arbitrary template text, rendered with a small
// conversation (messages, a tool, kwargs). It must render or throw nibble::Error: a crash, a
// sanitizer report, a hang or another exception is a bug (templates come with downloaded models).
#include <cstdint>
#include <string>

#include "core/status.h"
#include "tokenizer/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi <think>"},
                 {"role": "assistant", "content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                 {"role": "tool", "content": "r"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
               "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}],
    "documents": null, "add_generation_prompt": true, "eos_token": "<|im_end|>", "enable_thinking": false})");
  try {
    nibble::ChatTemplate::parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz").render(context, 0);
  } catch (const nibble::Error&) {
  }
  return 0;
}
