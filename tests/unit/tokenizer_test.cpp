// Tokenizer tests: the HF `tokenizers` reference outputs for the real Qwen3 and gpt-oss
// tokenizer.json files (tests/fixtures/tokenizer/*.json), streaming decode, the added-token
// rules on a small synthetic tokenizer, and the errors bad files must produce.
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/status.h"
#include "tokenizer/pretokenize.h"

namespace nibble {
namespace {

using nlohmann::json;

std::string tokenizer_path(const std::string& name) {
  return std::string(NIBBLE_TEST_DATA_DIR) + "/tokenizers/" + name + "/tokenizer.json";
}

// Loading parses tens of MB of JSON; every test shares one instance per file.
const Tokenizer& load(const std::string& name) {
  static std::map<std::string, Tokenizer> loaded;
  auto it = loaded.find(name);
  if (it == loaded.end()) it = loaded.emplace(name, Tokenizer::from_file(tokenizer_path(name))).first;
  return it->second;
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
};

std::vector<Case> load_cases(const std::string& name) {
  std::ifstream in(std::string(NIBBLE_FIXTURES_DIR) + "/tokenizer/" + name + ".json");
  EXPECT_TRUE(in.good()) << "missing fixture for " << name;
  std::vector<Case> cases;
  if (!in.good()) return cases;
  for (const json& c : json::parse(in))
    cases.push_back({c["text"].get<std::string>(), c["ids"].get<std::vector<int32_t>>(),
                     c["decoded"].get<std::string>()});
  return cases;
}

std::string ids_to_string(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t n = tok::utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, EncodeMatchesHuggingFace) {
  const Tokenizer& tok = load(GetParam());
  std::vector<Case> cases = load_cases(GetParam());
  ASSERT_GT(cases.size(), 0u) << "no fixture cases loaded";
  size_t passed = 0;
  int reported = 0;
  for (const Case& c : cases) {
    std::vector<int32_t> ids = tok.encode(c.text);
    if (ids == c.ids) {
      ++passed;
    } else if (reported++ < 5) {
      ADD_FAILURE() << "text: " << json(c.text).dump() << "\n  expected: " << ids_to_string(c.ids)
                    << "\n  actual:   " << ids_to_string(ids);
    }
  }
  EXPECT_EQ(passed, cases.size()) << GetParam() << ": " << passed << "/" << cases.size()
                                  << " fixture cases encode like HF";
}

TEST_P(ReferenceTest, DecodeMatchesHuggingFace) {
  const Tokenizer& tok = load(GetParam());
  std::vector<Case> cases = load_cases(GetParam());
  ASSERT_GT(cases.size(), 0u);
  for (const Case& c : cases) {
    EXPECT_EQ(tok.decode(c.ids), c.decoded) << "ids: " << ids_to_string(c.ids);
    // Round trip through our own encoder too.
    EXPECT_EQ(tok.decode(tok.encode(c.text)), c.decoded) << "text: " << json(c.text).dump();
  }
}

TEST_P(ReferenceTest, StreamingDecodeNeverSplitsCharacters) {
  const Tokenizer& tok = load(GetParam());
  std::vector<Case> cases = load_cases(GetParam());
  ASSERT_GT(cases.size(), 0u);
  for (const Case& c : cases) {
    StreamDecoder stream(tok);
    std::string joined;
    for (int32_t id : c.ids) {
      std::string piece = stream.push(id);
      EXPECT_TRUE(is_valid_utf8(piece)) << "partial character after id " << id;
      joined += piece;
    }
    joined += stream.flush();
    EXPECT_EQ(joined, tok.decode(c.ids)) << "text: " << json(c.text).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, ReferenceTest, ::testing::Values("qwen3", "gpt-oss"),
                         [](const auto& info) {
                           return info.param == "gpt-oss" ? std::string("GptOss") : info.param;
                         });

TEST(Tokenizer, EmojiBytesStreamWholeCharacters) {
  const Tokenizer& tok = load("qwen3");
  const std::string text = "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9 family \xF0\x9F\x9A\x80";
  std::vector<int32_t> ids = tok.encode(text);
  // The test only means something if some token is a fragment of a character.
  bool has_fragment = false;
  for (int32_t id : ids) has_fragment |= !is_valid_utf8(tok.token_bytes(id));
  ASSERT_TRUE(has_fragment);
  StreamDecoder stream(tok);
  std::string joined;
  for (int32_t id : ids) {
    std::string piece = stream.push(id);
    EXPECT_TRUE(is_valid_utf8(piece));
    joined += piece;
  }
  joined += stream.flush();
  EXPECT_EQ(joined, text);
  EXPECT_EQ(tok.decode(ids), text);
}

TEST(Tokenizer, StreamFlushReplacesUnfinishedCharacter) {
  const Tokenizer& tok = load("qwen3");
  std::vector<int32_t> ids = tok.encode("\xF0\x9F\xAA\xBF");  // U+1FABF: rare, so byte tokens
  ASSERT_GT(ids.size(), 1u);
  StreamDecoder stream(tok);
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{ids[0]}), "\xEF\xBF\xBD");
}

TEST(Tokenizer, Qwen3SpecialTokens) {
  const Tokenizer& tok = load("qwen3");
  EXPECT_EQ(tok.token_id("<|im_end|>"), 151645);
  EXPECT_TRUE(tok.is_special(151645));
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.encode("<|im_start|>user\nhi<|im_end|>"),
            (std::vector<int32_t>{151644, 872, 198, 6023, 151645}));
  // <think> is an added token but not a special one: matched in encode, kept by skip_special.
  auto think = tok.token_id("<think>");
  ASSERT_TRUE(think.has_value());
  EXPECT_FALSE(tok.is_special(*think));
  std::vector<int32_t> ids = tok.encode("<think>x</think><|im_end|>");
  EXPECT_EQ(ids.front(), *think);
  EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), "<think>x</think>");
  EXPECT_EQ(tok.decode(ids), "<think>x</think><|im_end|>");
  StreamDecoder skipping(tok, /*skip_special_tokens=*/true);
  EXPECT_EQ(skipping.push(151645), "");
  EXPECT_EQ(tok.token_bytes(*tok.token_id("\xC4\xA0the")), " the");  // "Ġthe"
  EXPECT_EQ(tok.token_bytes(-1), "");
  EXPECT_EQ(tok.token_bytes(tok.vocab_size()), "");
}

TEST(Tokenizer, GptOssSpecialTokens) {
  const Tokenizer& tok = load("gpt-oss");
  EXPECT_EQ(tok.token_id("<|return|>"), 200002);
  EXPECT_TRUE(tok.is_special(200002));
  EXPECT_FALSE(tok.is_special(13));
  EXPECT_EQ(tok.vocab_size(), 200019);
  EXPECT_EQ(tok.encode("hi<|return|>"), (std::vector<int32_t>{3686, 200002}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{3686, 200002}, true), "hi");
}

TEST(Tokenizer, ConcurrentEncodeAgreesWithSerial) {
  const Tokenizer copy = load("gpt-oss");  // copies share the loaded state
  std::vector<Case> cases = load_cases("gpt-oss");
  ASSERT_GT(cases.size(), 0u);
  std::vector<std::vector<int32_t>> serial;
  for (const Case& c : cases) serial.push_back(copy.encode(c.text));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round)
        for (size_t i = 0; i < cases.size(); ++i)
          if (copy.encode(cases[i].text) != serial[i] ||
              copy.decode(serial[i]) != cases[i].decoded)
            ++mismatches[static_cast<size_t>(t)];
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(Tokenizer, InvalidUtf8IsEncodedAsBytes) {
  const Tokenizer& tok = load("qwen3");
  const std::string text = "ab\xFF\xFE c\xC3 \xE2\x82 d\xED\xA0\x80";
  std::vector<int32_t> ids = tok.encode(text);
  std::string bytes;
  for (int32_t id : ids) bytes += tok.token_bytes(id);
  EXPECT_EQ(bytes, text);  // lossless at the byte level
  EXPECT_EQ(tok.decode(ids), tok::utf8_lossy(text));
  EXPECT_TRUE(tok.encode("").empty());
}

// ---- A small synthetic byte-level tokenizer for rules the real files do not exercise ----

json tiny_tokenizer(json merges, json added_tokens) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    tok::utf8_append(s, tok::byte_to_char(static_cast<uint8_t>(b)));
    vocab[s] = b;
  }
  for (const char* t : {"ab", "abc", "ca", "cat"}) vocab[t] = static_cast<int>(vocab.size());
  return json{{"version", "1.0"},
              {"added_tokens", std::move(added_tokens)},
              {"normalizer", nullptr},
              {"pre_tokenizer",
               {{"type", "ByteLevel"},
                {"add_prefix_space", false},
                {"trim_offsets", false},
                {"use_regex", true}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model",
               {{"type", "BPE"}, {"vocab", vocab}, {"merges", std::move(merges)}}}};
}

json added(int id, const std::string& content, bool lstrip, bool rstrip, bool single_word) {
  return json{{"id", id},          {"content", content}, {"single_word", single_word},
              {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", false},
              {"special", true}};
}

TEST(Tokenizer, MergesInBothJsonForms) {
  json pairs = json::array({json::array({"a", "b"}), json::array({"ab", "c"}),
                            json::array({"c", "a"}), json::array({"ca", "t"})});
  json strings = json::array({"a b", "ab c", "c a", "ca t"});
  Tokenizer a = Tokenizer::from_json(tiny_tokenizer(pairs, json::array()).dump(), "pairs");
  Tokenizer b = Tokenizer::from_json(tiny_tokenizer(strings, json::array()).dump(), "strings");
  std::vector<int32_t> expected{257, 'x', 259};  // "abc", "x", "cat"
  EXPECT_EQ(a.encode("abcxcat"), expected);
  EXPECT_EQ(b.encode("abcxcat"), expected);
  EXPECT_EQ(a.decode(expected), "abcxcat");
}

TEST(Tokenizer, ByteLevelPrefixSpaceInNestedSequence) {
  json pairs = json::array({json::array({"a", "b"}), json::array({"ab", "c"})});
  json j = tiny_tokenizer(pairs, json::array());
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Sequence"},
         {"pretokenizers",
          {{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}}}}}}};
  Tokenizer tok = Tokenizer::from_json(j.dump(), "nested");
  // GPT-2 style: a space is prepended, the GPT-2 regex splits " abc" and " x".
  EXPECT_EQ(tok.encode("abc x"), (std::vector<int32_t>{' ', 257, ' ', 'x'}));
  EXPECT_EQ(tok.decode(tok.encode("abc x")), " abc x");
}

TEST(Tokenizer, AddedTokenStripAndSingleWordRules) {
  json tokens = json::array({added(300, "<m>", true, false, false),
                             added(301, "<r>", false, true, false),
                             added(302, "dog", false, false, true)});
  Tokenizer tok = Tokenizer::from_json(tiny_tokenizer(json::array(), tokens).dump(), "tiny");
  // lstrip swallows the spaces before the token, rstrip those after it.
  EXPECT_EQ(tok.encode("x  <m>y"), (std::vector<int32_t>{'x', 300, 'y'}));
  EXPECT_EQ(tok.encode("x<r>  y"), (std::vector<int32_t>{'x', 301, 'y'}));
  // single_word: only where no word character touches the match.
  EXPECT_EQ(tok.encode("dog"), (std::vector<int32_t>{302}));
  EXPECT_EQ(tok.encode("hotdog").back(), 'g');
  EXPECT_EQ(tok.encode("dog!").front(), 302);
  EXPECT_TRUE(tok.is_special(300));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{'x', 300, 'y'}, true), "xy");
}

// ---- Errors ----

void expect_error(const std::function<void()>& load_it, const std::vector<std::string>& parts) {
  try {
    load_it();
    ADD_FAILURE() << "expected nibble::Error";
  } catch (const Error& e) {
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << e.what() << "' does not mention '" << part << "'";
  }
}

TEST(TokenizerErrors, MissingFile) {
  expect_error([] { Tokenizer::from_file("/nonexistent/dir/tokenizer.json"); },
               {"/nonexistent/dir/tokenizer.json"});
}

TEST(TokenizerErrors, MalformedJson) {
  std::string path = ::testing::TempDir() + "nibble_malformed_tokenizer.json";
  std::ofstream(path) << "{\"model\": {\"type\": \"BPE\", \"vocab\": {";
  expect_error([&] { Tokenizer::from_file(path); }, {path, "malformed"});
  expect_error([] { Tokenizer::from_json("", "empty.json"); }, {"empty.json"});
  expect_error([] { Tokenizer::from_json("[1, 2]", "array.json"); }, {"array.json"});
}

TEST(TokenizerErrors, UnsupportedParts) {
  json base = tiny_tokenizer(json::array(), json::array());
  json wordpiece = base;
  wordpiece["model"]["type"] = "WordPiece";
  expect_error([&] { Tokenizer::from_json(wordpiece.dump(), "wp.json"); },
               {"wp.json", "model.type", "WordPiece"});
  json unigram = base;
  unigram["model"] = {{"type", "Unigram"}, {"vocab", json::array()}};
  expect_error([&] { Tokenizer::from_json(unigram.dump(), "uni.json"); },
               {"uni.json", "model.type"});
  json pre = base;
  pre["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_error([&] { Tokenizer::from_json(pre.dump(), "pre.json"); },
               {"pre.json", "pre_tokenizer.type", "Whitespace"});
  json norm = base;
  norm["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}};
  expect_error([&] { Tokenizer::from_json(norm.dump(), "norm.json"); },
               {"norm.json", "normalizer.normalizers[0].type"});
  json regex = base;
  regex["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"},
         {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  expect_error([&] { Tokenizer::from_json(regex.dump(), "re.json"); },
               {"re.json", "pre_tokenizer.pretokenizers[0].pattern.Regex"});
  json merge = tiny_tokenizer(json::array({json::array({"a", "zz"})}), json::array());
  expect_error([&] { Tokenizer::from_json(merge.dump(), "merge.json"); },
               {"merge.json", "model.merges[0]"});
  json vocab = base;
  vocab["model"]["vocab"] = json::array();
  expect_error([&] { Tokenizer::from_json(vocab.dump(), "vocab.json"); },
               {"vocab.json", "model.vocab"});
}

TEST(TokenizerInternals, OnigClassesTranslate) {
  EXPECT_EQ(tok::onig_to_pcre2(R"(\s+(?!\S))"), R"([\t-\r\x{85}\p{Z}]+(?![^\t-\r\x{85}\p{Z}]))");
  EXPECT_EQ(tok::onig_to_pcre2(R"([^\s\p{L}])"), R"([^\t-\r\x{85}\p{Z}\p{L}])");
  EXPECT_EQ(tok::onig_to_pcre2(R"(\\s)"), R"(\\s)");
}

TEST(TokenizerInternals, LossyMatchesRust) {
  // Maximal subparts: E2 82 is one unfinished sequence, F0 80 is two bad bytes, ED A0 three.
  EXPECT_EQ(tok::utf8_lossy("\xE2\x82" "A"), "\xEF\xBF\xBD" "A");
  EXPECT_EQ(tok::utf8_lossy("\xF0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok::utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok::utf8_stable_prefix("a\xF0\x9F\x9A"), 1u);
  EXPECT_EQ(tok::utf8_stable_prefix("a\xF0\x9F\x9A\x80"), 5u);
  EXPECT_EQ(tok::utf8_stable_prefix("a\xC3\x28"), 3u);
}

}  // namespace
}  // namespace nibble
