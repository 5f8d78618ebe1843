// Tokenizer front end: reads tokenizer.json, wires the stages together in HF's order (added tokens
// on the raw text, normalizer, added tokens on the normalized text, pre-tokenizer, BPE) and
// implements decoding, including the streaming decoder used while generating.
#include "tokenizer/tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_set>

#include "core/status.h"
#include "tokenizer/bpe.h"

namespace nibble {

namespace {

using nlohmann::json;
using tok::TokenizerImpl;

bool flag(const json& entry, const char* key, bool fallback, const std::string& source,
          size_t index) {
  if (!entry.contains(key) || entry[key].is_null()) return fallback;
  NIBBLE_CHECK(entry[key].is_boolean(), "{}: expected a boolean (field added_tokens[{}].{})",
               source, index, key);
  return entry[key].get<bool>();
}

std::vector<tok::AddedToken> parse_added_tokens(const json& root, const std::string& source) {
  std::vector<tok::AddedToken> tokens;
  if (!root.contains("added_tokens") || root["added_tokens"].is_null()) return tokens;
  const json& list = root["added_tokens"];
  NIBBLE_CHECK(list.is_array(), "{}: expected an array (field added_tokens)", source);
  for (size_t i = 0; i < list.size(); ++i) {
    const json& e = list[i];
    NIBBLE_CHECK(e.is_object() && e.contains("content") && e["content"].is_string(),
                 "{}: expected an object with a string \"content\" (field added_tokens[{}])",
                 source, i);
    NIBBLE_CHECK(e.contains("id") && e["id"].is_number_integer() && e["id"].get<int64_t>() >= 0 &&
                     e["id"].get<int64_t>() < (int64_t{1} << 26),
                 "{}: expected a non-negative integer (field added_tokens[{}].id)", source, i);
    tok::AddedToken t;
    t.id = e["id"].get<int32_t>();
    t.content = e["content"].get<std::string>();
    t.special = flag(e, "special", false, source, i);
    t.single_word = flag(e, "single_word", false, source, i);
    t.lstrip = flag(e, "lstrip", false, source, i);
    t.rstrip = flag(e, "rstrip", false, source, i);
    t.normalized = flag(e, "normalized", !t.special, source, i);
    tokens.push_back(std::move(t));
  }
  return tokens;
}

std::shared_ptr<const TokenizerImpl> build(const json& root, const std::string& source) {
  NIBBLE_CHECK(root.is_object(), "{}: expected a JSON object at the top level", source);
  if (root.contains("version") && !root["version"].is_null()) {
    NIBBLE_CHECK(root["version"].is_string() && root["version"].get<std::string>() == "1.0",
                 "{}: unknown tokenizer.json version {} (field version)", source,
                 root["version"].dump());
  }
  NIBBLE_CHECK(root.contains("model"), "{}: missing field model", source);
  auto impl = std::make_shared<TokenizerImpl>();
  impl->source = source;
  impl->model = tok::BpeModel::from_json(root["model"], source);
  impl->normalizer = tok::Normalizer::from_json(
      root.contains("normalizer") ? root["normalizer"] : json(), source, "normalizer");
  impl->pre_tokenizer = tok::PreTokenizer::from_json(
      root.contains("pre_tokenizer") ? root["pre_tokenizer"] : json(), source, "pre_tokenizer");
  const json decoder = root.contains("decoder") ? root["decoder"] : json();
  std::string decoder_type = decoder.is_object() && decoder.contains("type") &&
                                     decoder["type"].is_string()
                                 ? decoder["type"].get<std::string>()
                                 : decoder.dump();
  NIBBLE_CHECK(decoder_type == "ByteLevel",
               "{}: unsupported decoder '{}', only ByteLevel is (field decoder.type)", source,
               decoder_type);

  std::vector<tok::AddedToken> added = parse_added_tokens(root, source);
  int32_t max_id = impl->model.max_id();
  // What the decoder is given for each added token: HF feeds it the normalized form of
  // normalized tokens.
  std::unordered_map<int32_t, std::string> added_spelling;
  std::unordered_set<std::string> special_contents;
  std::unordered_set<int32_t> special_ids;
  for (tok::AddedToken& t : added) {
    if (t.content.empty()) continue;  // HF ignores these
    // HF keeps the model's id for content that is already a vocab entry.
    if (auto existing = impl->model.id_of_spelling(t.content)) t.id = *existing;
    impl->added_by_content[t.content] = t.id;
    std::string spelling = t.content;
    if (t.normalized) {
      if (impl->normalizer.active()) spelling = impl->normalizer.apply(t.content);
      impl->normalized_matcher.add(spelling, t);
    } else {
      impl->raw_matcher.add(t.content, t);
    }
    added_spelling[t.id] = spelling;
    if (t.special) {
      special_contents.insert(t.content);
      special_ids.insert(t.id);
    }
    max_id = std::max(max_id, t.id);
  }

  auto size = static_cast<size_t>(max_id + 1);
  impl->id_bytes.resize(size);
  impl->id_flags.assign(size, 0);
  for (size_t i = 0; i < size; ++i) {
    auto id = static_cast<int32_t>(i);
    const std::string* spelling = nullptr;
    if (auto it = added_spelling.find(id); it != added_spelling.end()) {
      spelling = &it->second;
    } else {
      spelling = impl->model.spelling(id);
    }
    if (spelling == nullptr) continue;
    // The ByteLevel decoder maps a token through the byte alphabet when it can, and otherwise
    // passes its UTF-8 through unchanged.
    auto bytes = tok::byte_level_to_bytes(*spelling);
    impl->id_bytes[i] = bytes ? std::move(*bytes) : *spelling;
    uint8_t f = TokenizerImpl::kKnown;
    if (special_ids.count(id) != 0) f |= TokenizerImpl::kSpecial;
    // HF's skip_special_tokens tests the token string, not the id.
    if (special_contents.count(*spelling) != 0) f |= TokenizerImpl::kSkippedAsSpecial;
    impl->id_flags[i] = f;
  }
  return impl;
}

}  // namespace

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source_name) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail("{}: malformed tokenizer.json: {}", source_name, e.what());
  }
  try {
    return Tokenizer(build(root, source_name));
  } catch (const json::exception& e) {
    // Checks above name the field; this only catches shapes they did not anticipate.
    fail("{}: malformed tokenizer.json: {}", source_name, e.what());
  }
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  NIBBLE_CHECK(in.good(), "{}: cannot open tokenizer file", path);
  std::ostringstream text;
  text << in.rdbuf();
  NIBBLE_CHECK(!in.bad(), "{}: cannot read tokenizer file", path);
  return from_json(text.str(), path);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const TokenizerImpl& t = *impl_;
  std::vector<int32_t> ids;
  std::vector<tok::Piece> raw_pieces;
  std::vector<tok::Piece> normalized_pieces;
  std::vector<std::string> words;
  // Per call, so concurrent encodes share nothing mutable; text repeats words a lot.
  std::unordered_map<std::string, std::pair<size_t, size_t>> cache;
  std::vector<int32_t> cached_ids;
  constexpr size_t kMaxCachedWord = 256;

  t.raw_matcher.split(text, raw_pieces);
  for (const tok::Piece& raw : raw_pieces) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    std::string normalized = t.normalizer.apply(text.substr(raw.begin, raw.end - raw.begin));
    normalized_pieces.clear();
    t.normalized_matcher.split(normalized, normalized_pieces);
    for (const tok::Piece& piece : normalized_pieces) {
      if (piece.id >= 0) {
        ids.push_back(piece.id);
        continue;
      }
      words.clear();
      t.pre_tokenizer.split(
          std::string_view(normalized).substr(piece.begin, piece.end - piece.begin), words);
      for (const std::string& word : words) {
        if (word.size() > kMaxCachedWord) {
          t.model.encode_word(word, ids);
          continue;
        }
        auto [it, inserted] = cache.try_emplace(word);
        if (inserted) {
          size_t begin = cached_ids.size();
          t.model.encode_word(word, cached_ids);
          it->second = {begin, cached_ids.size()};
        }
        ids.insert(ids.end(), cached_ids.begin() + static_cast<ptrdiff_t>(it->second.first),
                   cached_ids.begin() + static_cast<ptrdiff_t>(it->second.second));
      }
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids)
    if (impl_->emits(id, skip_special_tokens)) bytes += impl_->id_bytes[static_cast<size_t>(id)];
  return tok::utf8_lossy(bytes);
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (!impl_->emits(id, false)) return "";
  return impl_->id_bytes[static_cast<size_t>(id)];
}

std::optional<int32_t> Tokenizer::token_id(std::string_view content) const {
  if (auto it = impl_->added_by_content.find(std::string(content));
      it != impl_->added_by_content.end())
    return it->second;
  return impl_->model.id_of_spelling(content);
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_flags.size() &&
         (impl_->id_flags[static_cast<size_t>(id)] & TokenizerImpl::kSpecial) != 0;
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_flags.size()); }

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special_tokens)
    : impl_(tok.impl_), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(int32_t id) {
  if (!impl_->emits(id, skip_special_tokens_)) return "";
  pending_ += impl_->id_bytes[static_cast<size_t>(id)];
  // Cutting before an unfinished character gives the same text as converting everything at once:
  // an unfinished character starts with a lead byte, which no earlier invalid run can absorb.
  size_t ready = tok::utf8_stable_prefix(pending_);
  std::string out = tok::utf8_lossy(std::string_view(pending_).substr(0, ready));
  pending_.erase(0, ready);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = tok::utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace nibble
