// Chat templates: the Jinja templates Hugging Face models ship in tokenizer_config.json
// (`chat_template`) or chat_template.jinja, rendered as transformers' apply_chat_template renders
// them: a sandboxed Jinja2 environment with trim_blocks and lstrip_blocks, the loopcontrols
// extension, a `tojson` filter that keeps non-ASCII text, and the globals `raise_exception` and
// `strftime_now`.
//
// The language is the subset real templates use (Qwen3, Qwen3-Coder, gpt-oss, Llama, Mistral):
// text, {{ }}, {% if/elif/else %}, {% for %} (tuple targets, `if` filter, else, loop.*),
// {% set %} (names, namespace attributes, blocks), {% macro %} with defaults, {% break %},
// {% continue %}, {% generation %}, {# #}, whitespace control, Python-like expressions (literals,
// lists, dicts, slices, calls, ternaries, `in`, `~`, arithmetic), filters and tests, and the
// string/dict methods templates call. Values follow Python and Jinja2: undefined names are
// falsy and render as "", dicts keep their key order, `x.attr` falls back to `x["attr"]`.
#pragma once

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace nibble {

namespace jinja {
struct Template;
}

class ChatTemplate {
 public:
  // Throws nibble::Error naming `source_name`, the line and what was expected.
  static ChatTemplate parse(const std::string& source, const std::string& source_name);

  // Renders with `context` (a JSON object: messages, tools, add_generation_prompt, bos_token,
  // eos_token, and any extra template kwargs) as the template's variables. `now` is what
  // strftime_now formats. Throws nibble::Error on a render error, or with the template's own
  // message when it calls raise_exception.
  std::string render(const nlohmann::ordered_json& context, std::time_t now = std::time(nullptr)) const;

 private:
  explicit ChatTemplate(std::shared_ptr<const jinja::Template> t) : t_(std::move(t)) {}
  std::shared_ptr<const jinja::Template> t_;
};

// The variables transformers' apply_chat_template gives a template: `messages`, `tools` (null
// when none), `documents` (null), `add_generation_prompt`, the tokenizer's special tokens
// (bos_token, eos_token, unk_token, pad_token from tokenizer_config.json, when set) and the
// caller's kwargs (e.g. enable_thinking, reasoning_effort), which win over the rest.
nlohmann::ordered_json chat_template_context(const std::string& model_dir, nlohmann::ordered_json messages,
                                             nlohmann::ordered_json tools, bool add_generation_prompt,
                                             const nlohmann::ordered_json& kwargs = nlohmann::ordered_json::object());

// The model's chat template: tokenizer_config.json's `chat_template` (a string, or the list form
// with a "default" entry), else chat_template.jinja. Throws nibble::Error when there is none.
std::string load_chat_template_source(const std::string& model_dir);

}  // namespace nibble
