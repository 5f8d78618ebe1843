// libFuzzer target for the tokenizer: arbitrary bytes must encode and decode without crashing or
// hanging, valid UTF-8 must round-trip to its NFC form, and streaming decode must agree with
// decode(). Uses the real Qwen3 tokenizer (NFC normalizer, added tokens, Split regex).
// NIBBLE_FUZZ_TOKENIZER overrides the default path, which assumes the cpu preset's test data.
#include <utf8proc.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"

namespace {

struct Target {
  nibble::Tokenizer tokenizer;
  std::vector<std::string> added_contents;  // text that encode() turns into added tokens
  enum class Form { kNone, kNfc, kOther } normalizer = Form::kOther;  // what round trips give
};

const Target& target() {
  static const Target* instance = [] {
    const char* env = std::getenv("NIBBLE_FUZZ_TOKENIZER");
    std::string path = env != nullptr ? env : "build/cpu/test-data/tokenizers/qwen3/tokenizer.json";
    try {
      auto* t = new Target{nibble::Tokenizer::from_file(path), {}};
      std::ifstream in(path);
      nlohmann::json root = nlohmann::json::parse(in);
      for (const auto& added : root.value("added_tokens", nlohmann::json::array()))
        t->added_contents.push_back(added.at("content").get<std::string>());
      const nlohmann::json normalizer = root.value("normalizer", nlohmann::json());
      if (normalizer.is_null()) t->normalizer = Target::Form::kNone;
      else if (normalizer.value("type", "") == "NFC") t->normalizer = Target::Form::kNfc;
      return t;
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "tokenizer_fuzz: cannot load the tokenizer: %s\n"
                   "Build the test data (cmake --build build/cpu --target nibble_test_data) or "
                   "set NIBBLE_FUZZ_TOKENIZER to a tokenizer.json.\n",
                   e.what());
      std::abort();
    }
  }();
  return *instance;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t n = nibble::tok::utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string nfc(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &out,
                                    static_cast<utf8proc_option_t>(UTF8PROC_STABLE |
                                                                   UTF8PROC_COMPOSE));
  if (n < 0) __builtin_trap();  // only called on valid UTF-8
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

bool mentions_added_token(const Target& t, std::string_view a, std::string_view b) {
  for (const std::string& content : t.added_contents)
    if (a.find(content) != std::string_view::npos || b.find(content) != std::string_view::npos)
      return true;
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Target& t = target();
  std::string_view text(reinterpret_cast<const char*>(data), size);

  std::vector<int32_t> ids = t.tokenizer.encode(text);
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= t.tokenizer.vocab_size()) __builtin_trap();
    bytes += t.tokenizer.token_bytes(id);
  }
  std::string decoded = t.tokenizer.decode(ids);
  if (!valid_utf8(decoded)) __builtin_trap();

  if (t.normalizer == Target::Form::kNone && !mentions_added_token(t, text, text)) {
    // Byte-level BPE keeps every byte, valid UTF-8 or not.
    if (bytes != text) __builtin_trap();
  }
  if (valid_utf8(text) && t.normalizer != Target::Form::kOther) {
    std::string normalized = t.normalizer == Target::Form::kNfc ? nfc(text) : std::string(text);
    // Added tokens are cut out before normalization, so text around them is normalized
    // piecewise; away from them the round trip must be exact.
    if (!mentions_added_token(t, text, normalized)) {
      if (decoded != normalized) __builtin_trap();
      if (bytes != normalized) __builtin_trap();
    }
  }

  // Streaming must agree with decode() and never emit half a character.
  nibble::StreamDecoder stream(t.tokenizer);
  std::string joined;
  for (int32_t id : ids) {
    std::string piece = stream.push(id);
    if (!valid_utf8(piece)) __builtin_trap();
    joined += piece;
  }
  joined += stream.flush();
  if (joined != decoded) __builtin_trap();

  // The same bytes read as arbitrary ids: decoding must tolerate unknown ids and fragments.
  std::vector<int32_t> raw_ids(size / 4);
  for (size_t i = 0; i < raw_ids.size(); ++i) {
    uint32_t v = uint32_t{data[4 * i]} | uint32_t{data[4 * i + 1]} << 8 |
                 uint32_t{data[4 * i + 2]} << 16 | uint32_t{data[4 * i + 3]} << 24;
    // Mostly in range, sometimes not.
    raw_ids[i] = (v & 0x80000000u) != 0 ? static_cast<int32_t>(v)
                                         : static_cast<int32_t>(v % (t.tokenizer.vocab_size() + 8));
  }
  for (bool skip : {false, true}) {
    std::string whole = t.tokenizer.decode(raw_ids, skip);
    nibble::StreamDecoder s(t.tokenizer, skip);
    std::string parts;
    for (int32_t id : raw_ids) {
      std::string piece = s.push(id);
      if (!valid_utf8(piece)) __builtin_trap();
      parts += piece;
    }
    parts += s.flush();
    if (parts != whole) __builtin_trap();
  }
  return 0;
}
