// The chat template engine against transformers: tests/fixtures/chat_templates/cases.json holds
// what apply_chat_template rendered for the real Qwen3, Qwen3-Coder, gpt-oss and bundled-model
// templates over a set of conversations, and what Jinja2 (in transformers' environment) rendered
// for snippets that exercise one language feature each (tools/make_template_fixtures.py). Every
// string must match byte for byte; a template's raise_exception must surface as nibble::Error
// with the template's message. Then errors in templates themselves: clear messages, no crash.
#include "tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/status.h"

namespace nibble {
namespace {

const std::string kDir = std::string(NIBBLE_FIXTURES_DIR) + "/chat_templates";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const nlohmann::ordered_json& fixture() {
  static const nlohmann::ordered_json j = nlohmann::ordered_json::parse(read_file(kDir + "/cases.json"));
  return j;
}

std::string template_path(const std::string& name) {
  const std::string rel = fixture()["templates"][name].get<std::string>();
  return std::string(NIBBLE_FIXTURES_DIR) + "/../../" + rel;
}

TEST(ChatTemplate, RealTemplatesMatchTransformers) {
  const auto& f = fixture();
  const std::time_t now = f["now"].get<int64_t>();
  int rendered = 0, raised = 0;
  for (const auto& c : f["cases"]) {
    const std::string name = c["template"].get<std::string>() + "/" + c["name"].get<std::string>();
    const std::string path = template_path(c["template"].get<std::string>());
    ChatTemplate t = ChatTemplate::parse(read_file(path), path);
    if (c.contains("error")) {
      try {
        t.render(c["context"], now);
        ADD_FAILURE() << name << ": expected the template to raise \"" << c["error"].get<std::string>() << "\"";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(c["error"].get<std::string>()), std::string::npos)
            << name << ": " << e.what();
        ++raised;
      }
      continue;
    }
    std::string got;
    try {
      got = t.render(c["context"], now);
    } catch (const Error& e) {
      ADD_FAILURE() << name << ": " << e.what();
      continue;
    }
    EXPECT_EQ(got, c["expected"].get<std::string>()) << name;
    ++rendered;
  }
  std::cout << rendered << " conversations rendered, " << raised << " raised, reference: " << f["renderer"] << "\n";
  EXPECT_GE(rendered, 30);
  EXPECT_GE(raised, 1);
}

TEST(ChatTemplate, LanguageFeaturesMatchJinja2) {
  int n = 0;
  for (const auto& s : fixture()["snippets"]) {
    const std::string src = s["source"].get<std::string>();
    try {
      EXPECT_EQ(ChatTemplate::parse(src, "snippet").render(s["context"]), s["expected"].get<std::string>()) << src;
    } catch (const Error& e) {
      ADD_FAILURE() << src << ": " << e.what();
    }
    ++n;
  }
  EXPECT_GE(n, 20);
}

TEST(ChatTemplate, BundledModelTemplateLoads) {
  const std::string src =
      load_chat_template_source(std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder");
  nlohmann::ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"add_generation_prompt", true}};
  EXPECT_EQ(ChatTemplate::parse(src, "tiny").render(ctx),
            "<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_THROW(load_chat_template_source(std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-qwen3"), Error);
}

// Broken templates and bad values: an Error that says what and where, never a crash.
TEST(ChatTemplate, ErrorsNameTheProblem) {
  struct Bad {
    const char* src;
    const char* says;
  };
  const Bad cases[] = {
      {"{{ x ", "unterminated tag"},
      {"{% if x %}never closed", "missing {% endif %}"},
      {"{% for x in %}{% endfor %}", "unexpected"},
      {"{% frobnicate %}", "unknown or unsupported tag 'frobnicate'"},
      {"{{ 'a' | nosuchfilter }}", "unknown filter 'nosuchfilter'"},
      {"{{ 1 is nosuchtest }}", "unknown test 'nosuchtest'"},
      {"{{ undefined_thing.attr }}", "'undefined_thing' is undefined"},
      {"{{ 1 + 'a' }}", "unsupported operand types"},
      {"{{ 1 // 0 }}", "division by zero"},
      {"{{ raise_exception('custom failure') }}", "custom failure"},
      {"{{ 'unterminated }}", "unterminated string"},
      {"{% set x.y = 1 %}", "is not a namespace"},
      {"{{ nothing() }}", "is not callable"},
      {"line one\n{{ 1 +  }}", "snippet:2"},
      {"{{ '\\uZZZZ' }}", "bad \\u escape"},
      // Hostile templates fail instead of exhausting the stack, the clock or memory.
      {"{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed more than 100 deep"},
      {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "runs too long"},
      {"{% set s = 'x' * 10000000 %}{% for i in range(100) %}{{ s }}{% endfor %}", "over 64 MiB"},
      // A namespace that holds itself (found by the fuzzer: it also leaked) prints and serialises
      // to an error, not to a stack overflow.
      {"{% set ns = namespace(n=1) %}{% set ns.self = ns %}{{ ns }}", "printing: a value nested more than 256"},
      {"{% set ns = namespace(n=1) %}{% set ns.l = [ns] %}{{ ns | tojson }}", "tojson: a value nested more than 256"},
  };
  for (const Bad& b : cases) {
    try {
      ChatTemplate::parse(b.src, "snippet").render(nlohmann::ordered_json::object());
      ADD_FAILURE() << b.src << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << b.src << " -> " << e.what();
    }
  }
  // The same namespace is fine where nothing walks into it; it compares by identity, as in Jinja.
  EXPECT_EQ(ChatTemplate::parse("{% set ns = namespace(n=1) %}{% set ns.self = ns %}{% set o = namespace(n=1) %}"
                                "{{ ns.self.self.n }} {{ ns == ns.self }} {{ ns == o }}",
                                "snippet")
                .render(nlohmann::ordered_json::object()),
            "1 True False");
  const std::string deep = "{{ " + std::string(500, '(') + "1" + std::string(500, ')') + " }}";
  EXPECT_THROW(ChatTemplate::parse(deep, "snippet"), Error);
}

}  // namespace
}  // namespace nibble
