// Hugging Face compatible byte-level BPE tokenizer, loaded from a `tokenizer.json`.
// Encoding reproduces `tokenizers` (Rust/Python) `encode(text, add_special_tokens=False)` and
// decoding reproduces `decode(ids, skip_special_tokens)`, so that prompts and outputs agree token
// for token with the reference stack the models were trained and evaluated with.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace nibble {

namespace tok {
struct TokenizerImpl;
}

class Tokenizer {
 public:
  // Both throw nibble::Error naming the file and the JSON field when the file is missing,
  // malformed or uses a feature this implementation does not support.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(std::string_view json_text, const std::string& source_name);

  // Same ids as HF `encode(text, add_special_tokens=False)`. Bytes that are not valid UTF-8 are
  // kept and encoded as their byte tokens (HF cannot be given such input at all).
  std::vector<int32_t> encode(std::string_view text) const;
  // Same text as HF `decode`; unknown ids are skipped and invalid UTF-8 becomes U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The raw bytes this token stands for in decode() ("" if unknown id); may be part of a
  // multi-byte character.
  std::string token_bytes(int32_t id) const;
  // HF `token_to_id`: an added token by its content, else a vocab entry by its byte-level
  // spelling (e.g. "Ġthe" for " the").
  std::optional<int32_t> token_id(std::string_view content) const;
  bool is_special(int32_t id) const;
  // 1 + the largest id of the vocab and the added tokens.
  int32_t vocab_size() const;

 private:
  friend class StreamDecoder;
  explicit Tokenizer(std::shared_ptr<const tok::TokenizerImpl> impl) : impl_(std::move(impl)) {}
  // Immutable after loading, so copies share it and concurrent const calls need no locking.
  std::shared_ptr<const tok::TokenizerImpl> impl_;
};

// Turns generated ids into text as they arrive without ever emitting half a UTF-8 character; the
// concatenation of all push() results and flush() equals Tokenizer::decode() of the same ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special_tokens = false);
  std::string push(int32_t id);
  // Emits what is still buffered (an incomplete character becomes U+FFFD) and resets.
  std::string flush();

 private:
  std::shared_ptr<const tok::TokenizerImpl> impl_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace nibble
