// Internal to the tokenizer: everything that runs on the text before the BPE model sees it
// (added-token splitting, normalization, regex pre-tokenization) plus the UTF-8 and GPT-2
// byte-level helpers that encode and decode share. Each piece mirrors the corresponding part of
// HF `tokenizers` closely enough to give identical splits.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace nibble::tok {

// ---- UTF-8 ----

// Length of the well-formed UTF-8 sequence at s[i] (RFC 3629: no overlongs, no surrogates,
// nothing above U+10FFFF), or 0 if there is none.
size_t utf8_sequence_length(std::string_view s, size_t i);
// Decodes the well-formed sequence at s[i] (caller checked utf8_sequence_length > 0).
char32_t utf8_decode_at(std::string_view s, size_t i, size_t length);
void utf8_append(std::string& out, char32_t cp);
// Rust `String::from_utf8_lossy`: each maximal invalid subpart becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);
// How many leading bytes can be converted now without cutting a character that later bytes could
// still complete.
size_t utf8_stable_prefix(std::string_view bytes);

// ---- GPT-2 byte-level alphabet ----

// The character that stands for byte b in byte-level vocabularies (GPT-2 `bytes_to_unicode`).
char32_t byte_to_char(uint8_t b);
// The byte a byte-level character stands for, or -1 if the character is outside the alphabet.
int char_to_byte(char32_t cp);
// A byte-level token spelling as raw bytes; nullopt if some character is outside the alphabet
// (the ByteLevel decoder then keeps the spelling's own UTF-8 bytes).
std::optional<std::string> byte_level_to_bytes(std::string_view spelling);
std::string bytes_to_byte_level(std::string_view bytes);

// ---- Normalizer ----

class Normalizer {
 public:
  // `j` is the value of JSON field `field` (null or an object) of file `source`; both are named
  // in errors.
  static Normalizer from_json(const nlohmann::json& j, const std::string& source,
                              const std::string& field);
  bool active() const { return !utf8proc_options_.empty(); }
  // Invalid UTF-8 bytes pass through unchanged; the valid runs between them are normalized.
  std::string apply(std::string_view text) const;

 private:
  std::vector<int> utf8proc_options_;  // one utf8proc_map pass per entry
};

// ---- Added tokens ----

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// A slice [begin, end) of some text; id >= 0 when it is an added token, -1 when it still has to go
// through the normal pipeline.
struct Piece {
  size_t begin;
  size_t end;
  int32_t id;
};

// Finds added tokens in text the way HF's AddedVocabulary does: leftmost-longest,
// non-overlapping, then the single_word / lstrip / rstrip rules.
class AddedTokenMatcher {
 public:
  void add(std::string pattern, const AddedToken& token);
  bool empty() const { return entries_.empty(); }
  // Appends non-empty pieces covering all of text.
  void split(std::string_view text, std::vector<Piece>& out) const;

 private:
  struct Entry {
    std::string pattern;
    int32_t id;
    bool single_word, lstrip, rstrip;
  };
  std::vector<Entry> entries_;
  // Indices into entries_ by first byte, longest pattern first, so the first hit at a position is
  // the leftmost-longest one.
  std::array<std::vector<uint32_t>, 256> by_first_byte_;
};

// ---- Pre-tokenizer ----

class PreTokenizer {
 public:
  // `j` is the "pre_tokenizer" value. Supports Split, ByteLevel and Sequence of those, and
  // requires a ByteLevel step (the model is assumed byte-level).
  static PreTokenizer from_json(const nlohmann::json& j, const std::string& source,
                                const std::string& field);
  // Appends the non-empty pre-tokens of text, as raw bytes (the byte-level mapping is implicit:
  // the model is keyed by raw bytes).
  void split(std::string_view text, std::vector<std::string>& out) const;

  struct Step;

 private:
  std::vector<std::shared_ptr<const Step>> steps_;
};

// Rewrites Oniguruma-flavoured \s, \S, \w, \W, \d, \D into explicit Unicode classes so PCRE2
// matches exactly the characters Oniguruma does (PCRE2's \s also matches U+180E, for one).
std::string onig_to_pcre2(std::string_view pattern);

}  // namespace nibble::tok
