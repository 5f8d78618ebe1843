// The text-side stages of the tokenizer: added-token matching, Unicode normalization (utf8proc)
// and regex pre-tokenization (PCRE2). HF `tokenizers` uses Oniguruma and its own added-vocabulary
// rules; the code below follows those rules step by step so that the split points, and therefore
// the ids, are identical.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pretokenize.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/status.h"

namespace nibble::tok {

namespace {

using nlohmann::json;

std::string type_of(const json& j, const std::string& source, const std::string& field) {
  NIBBLE_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(),
               "{}: expected an object with a string \"type\" (field {})", source, field);
  return j["type"].get<std::string>();
}

bool bool_field(const json& j, const char* key, bool fallback, const std::string& source,
                const std::string& field) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  NIBBLE_CHECK(j[key].is_boolean(), "{}: expected a boolean (field {}.{})", source, field, key);
  return j[key].get<bool>();
}

// ---- Unicode character classes used by the added-token rules (Rust regex `\s`, `\w`) ----

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

bool is_word_char(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                       c == '_';
  if (c == 0x200C || c == 0x200D) return true;  // Join_Control
  // Other_Alphabetic symbols: circled and squared Latin letters.
  if ((c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
      (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189))
    return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// The character starting at i, or -1 for an invalid byte.
int64_t char_at(std::string_view s, size_t i, size_t* length) {
  size_t n = utf8_sequence_length(s, i);
  *length = n == 0 ? 1 : n;
  return n == 0 ? -1 : static_cast<int64_t>(utf8_decode_at(s, i, n));
}

// The character ending at `end` (exclusive), or -1 for an invalid byte; sets *start.
int64_t char_before(std::string_view s, size_t end, size_t* start) {
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    auto b = static_cast<uint8_t>(s[end - back]);
    if ((b & 0xC0) == 0x80 && back < 4) continue;
    size_t length = utf8_sequence_length(s, end - back);
    if (length == back) {
      *start = end - back;
      return utf8_decode_at(s, end - back, length);
    }
    break;
  }
  *start = end - 1;
  return -1;
}

// ---- PCRE2 ----

struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  MatchScratch() {
    NIBBLE_ASSERT(data != nullptr && context != nullptr);
    if (stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchScratch(const MatchScratch&) = delete;
  MatchScratch& operator=(const MatchScratch&) = delete;
};

// Match data and the JIT stack cannot be shared between threads; the compiled pattern can.
MatchScratch& scratch() {
  thread_local MatchScratch instance;
  return instance;
}

class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& source,
        const std::string& field) {
    std::string translated = literal ? pattern : onig_to_pcre2(pattern);
    // MATCH_INVALID_UTF: invalid bytes never match and end up in the gaps, which keeps encode
    // total on arbitrary input. MULTILINE: Oniguruma's default (Ruby) syntax anchors ^ and $ at
    // line boundaries.
    uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF |
                       (literal ? PCRE2_LITERAL : PCRE2_MULTILINE);
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                          options, &error, &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof message);
      fail("{}: cannot compile regex /{}/: {} at offset {} (field {})", source, pattern,
           reinterpret_cast<const char*>(message), offset, field);
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // HF `Pattern::find_matches` over Oniguruma's find_iter: slices covering all of text, each
  // flagged as match or gap.
  void find_matches(std::string_view text, std::vector<std::pair<Piece, bool>>& out) const {
    out.clear();
    if (text.empty()) {
      out.push_back({{0, 0, -1}, false});
      return;
    }
    MatchScratch& s = scratch();
    size_t prev = 0;
    size_t search_from = 0;
    size_t last_match_end = SIZE_MAX;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    while (search_from <= text.size()) {
      int rc = pcre2_match(code_, subject, text.size(), search_from, 0, s.data, s.context);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      NIBBLE_CHECK(rc >= 0, "tokenizer: regex match failed with PCRE2 error {} on {}-byte text", rc,
                   text.size());
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(s.data);
      size_t start = ovector[0];
      size_t end = ovector[1];
      if (start == end) {
        // Like onig's FindMatches: step over one character after an empty match, and drop an
        // empty match right where the previous match ended.
        size_t length = 1;
        if (end < text.size()) char_at(text, end, &length);
        search_from = end + length;
        if (last_match_end == end) continue;
      } else {
        search_from = end;
      }
      last_match_end = end;
      if (prev != start) out.push_back({{prev, start, -1}, false});
      out.push_back({{start, end, -1}, true});
      prev = end;
    }
    if (prev != text.size()) out.push_back({{prev, text.size(), -1}, false});
  }

 private:
  pcre2_code* code_ = nullptr;
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

// ---- Normalizer ----

Normalizer Normalizer::from_json(const json& j, const std::string& source,
                                 const std::string& field) {
  Normalizer result;
  if (j.is_null()) return result;
  std::string type = type_of(j, source, field);
  constexpr int kStable = UTF8PROC_STABLE;
  if (type == "NFC") {
    result.utf8proc_options_.push_back(kStable | UTF8PROC_COMPOSE);
  } else if (type == "NFD") {
    result.utf8proc_options_.push_back(kStable | UTF8PROC_DECOMPOSE);
  } else if (type == "NFKC") {
    result.utf8proc_options_.push_back(kStable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  } else if (type == "NFKD") {
    result.utf8proc_options_.push_back(kStable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  } else if (type == "Sequence") {
    const std::string list_field = field + ".normalizers";
    NIBBLE_CHECK(j.contains("normalizers") && j["normalizers"].is_array(),
                 "{}: expected an array (field {})", source, list_field);
    for (size_t i = 0; i < j["normalizers"].size(); ++i) {
      Normalizer inner = from_json(j["normalizers"][i], source, fmt::format("{}[{}]", list_field, i));
      result.utf8proc_options_.insert(result.utf8proc_options_.end(),
                                      inner.utf8proc_options_.begin(),
                                      inner.utf8proc_options_.end());
    }
  } else {
    fail("{}: unsupported normalizer type '{}' (field {}.type)", source, type, field);
  }
  return result;
}

std::string Normalizer::apply(std::string_view text) const {
  // ASCII is invariant under every supported normalization form.
  if (!active() || std::all_of(text.begin(), text.end(), [](char c) { return (c & 0x80) == 0; }))
    return std::string(text);
  std::string current(text);
  for (int options : utf8proc_options_) {
    std::string next;
    next.reserve(current.size());
    size_t i = 0;
    while (i < current.size()) {
      size_t run_end = i;
      while (run_end < current.size()) {
        size_t length = utf8_sequence_length(current, run_end);
        if (length == 0) break;
        run_end += length;
      }
      if (run_end > i) {
        utf8proc_uint8_t* mapped = nullptr;
        utf8proc_ssize_t n =
            utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data() + i),
                         static_cast<utf8proc_ssize_t>(run_end - i), &mapped,
                         static_cast<utf8proc_option_t>(options));
        if (n >= 0) {
          next.append(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
        } else {
          next.append(current, i, run_end - i);
        }
        std::free(mapped);
        i = run_end;
      }
      // Invalid bytes are not text; keep them for the byte-level model.
      while (i < current.size() && utf8_sequence_length(current, i) == 0) next += current[i++];
    }
    current = std::move(next);
  }
  return current;
}

// ---- Added tokens ----

void AddedTokenMatcher::add(std::string pattern, const AddedToken& token) {
  if (pattern.empty()) return;
  auto first = static_cast<uint8_t>(pattern[0]);
  entries_.push_back({std::move(pattern), token.id, token.single_word, token.lstrip, token.rstrip});
  auto& bucket = by_first_byte_[first];
  bucket.push_back(static_cast<uint32_t>(entries_.size() - 1));
  std::stable_sort(bucket.begin(), bucket.end(), [&](uint32_t a, uint32_t b) {
    return entries_[a].pattern.size() > entries_[b].pattern.size();
  });
}

void AddedTokenMatcher::split(std::string_view text, std::vector<Piece>& out) const {
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const Entry* hit = nullptr;
    for (uint32_t index : by_first_byte_[static_cast<uint8_t>(text[pos])]) {
      const Entry& entry = entries_[index];
      if (text.compare(pos, entry.pattern.size(), entry.pattern) == 0) {
        hit = &entry;
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + hit->pattern.size();
    pos = stop;  // the scan resumes after the match even when the rules below discard it
    if (hit->single_word) {
      size_t at = 0, length = 0;
      bool word_before = start > 0 && [&] {
        int64_t c = char_before(text, start, &at);
        return c >= 0 && is_word_char(static_cast<char32_t>(c));
      }();
      bool word_after = stop < text.size() && [&] {
        int64_t c = char_at(text, stop, &length);
        return c >= 0 && is_word_char(static_cast<char32_t>(c));
      }();
      if (word_before || word_after) continue;
    }
    if (hit->lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        size_t at = 0;
        int64_t c = char_before(text, new_start, &at);
        if (c < 0 || !is_white_space(static_cast<char32_t>(c))) break;
        new_start = at;
      }
      start = std::max(new_start, start_offset);
    }
    if (hit->rstrip) {
      while (stop < text.size()) {
        size_t length = 0;
        int64_t c = char_at(text, stop, &length);
        if (c < 0 || !is_white_space(static_cast<char32_t>(c))) break;
        stop += length;
      }
    }
    // Only reachable when a token starts with whitespace another token's rstrip already took;
    // HF would emit overlapping pieces there, we keep the first.
    if (start < start_offset) continue;
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, hit->id});
    start_offset = stop;
    pos = std::max(pos, stop);
  }
  if (start_offset < text.size()) out.push_back({start_offset, text.size(), -1});
}

// ---- Pre-tokenizer ----

struct PreTokenizer::Step {
  std::shared_ptr<const Regex> regex;  // null for a ByteLevel step without its regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel only

  void apply(const std::string& piece, std::vector<std::string>& out,
             std::vector<std::pair<Piece, bool>>& matches) const {
    std::string prefixed;
    const std::string* text = &piece;
    if (add_prefix_space && (piece.empty() || piece[0] != ' ')) {
      prefixed = " " + piece;
      text = &prefixed;
    }
    if (regex == nullptr) {
      if (!text->empty()) out.push_back(*text);
      return;
    }
    regex->find_matches(*text, matches);
    if (invert)
      for (auto& m : matches) m.second = !m.second;
    // The same folds as HF `NormalizedString::split`.
    std::vector<std::pair<Piece, bool>> splits;  // (slice, remove)
    splits.reserve(matches.size());
    bool previous_match = false;
    switch (behavior) {
      case Behavior::kIsolated:
        for (auto& [slice, is_match] : matches) splits.push_back({slice, false});
        break;
      case Behavior::kRemoved:
        splits = matches;
        break;
      case Behavior::kContiguous:
        for (auto& [slice, is_match] : matches) {
          if (is_match == previous_match && !splits.empty()) {
            splits.back().first.end = slice.end;
          } else {
            splits.push_back({slice, false});
          }
          previous_match = is_match;
        }
        break;
      case Behavior::kMergedWithPrevious:
        for (auto& [slice, is_match] : matches) {
          if (is_match && !previous_match && !splits.empty()) {
            splits.back().first.end = slice.end;
          } else {
            splits.push_back({slice, false});
          }
          previous_match = is_match;
        }
        break;
      case Behavior::kMergedWithNext:
        for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
          if (it->second && !previous_match && !splits.empty()) {
            splits.back().first.begin = it->first.begin;
          } else {
            splits.push_back({it->first, false});
          }
          previous_match = it->second;
        }
        std::reverse(splits.begin(), splits.end());
        break;
    }
    for (auto& [slice, remove] : splits)
      if (!remove && slice.end > slice.begin)
        out.emplace_back(*text, slice.begin, slice.end - slice.begin);
  }
};

PreTokenizer PreTokenizer::from_json(const json& j, const std::string& source,
                                     const std::string& field) {
  std::vector<std::pair<const json*, std::string>> flat;  // leaf steps and their field paths
  // Sequences apply their steps in order to every piece, so nesting them changes nothing.
  auto flatten = [&](auto& self, const json& node, const std::string& path) -> void {
    if (node.is_null()) return;
    if (type_of(node, source, path) != "Sequence") {
      flat.push_back({&node, path});
      return;
    }
    const std::string list_field = path + ".pretokenizers";
    NIBBLE_CHECK(node.contains("pretokenizers") && node["pretokenizers"].is_array(),
                 "{}: expected an array (field {})", source, list_field);
    for (size_t i = 0; i < node["pretokenizers"].size(); ++i)
      self(self, node["pretokenizers"][i], fmt::format("{}[{}]", list_field, i));
  };
  flatten(flatten, j, field);
  PreTokenizer result;
  bool seen_byte_level = false;
  for (auto& [step_json, step_field] : flat) {
    std::string type = type_of(*step_json, source, step_field);
    // Steps after ByteLevel would see byte-level characters instead of text; no real
    // tokenizer.json does that, so it is rejected rather than supported half-way.
    NIBBLE_CHECK(!seen_byte_level,
                 "{}: pre-tokenizer step '{}' after ByteLevel is not supported (field {})",
                 source, type, step_field);
    auto step = std::make_shared<Step>();
    if (type == "Split") {
      const json& s = *step_json;
      NIBBLE_CHECK(s.contains("pattern") && s["pattern"].is_object(),
                   "{}: expected an object (field {}.pattern)", source, step_field);
      const json& pattern = s["pattern"];
      if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
        step->regex = std::make_shared<Regex>(pattern["Regex"].get<std::string>(), false, source,
                                              step_field + ".pattern.Regex");
      } else if (pattern.contains("String") && pattern["String"].is_string()) {
        step->regex = std::make_shared<Regex>(pattern["String"].get<std::string>(), true, source,
                                              step_field + ".pattern.String");
      } else {
        fail("{}: expected {{\"Regex\": ...}} or {{\"String\": ...}} (field {}.pattern)", source,
             step_field);
      }
      NIBBLE_CHECK(s.contains("behavior") && s["behavior"].is_string(),
                   "{}: expected a string (field {}.behavior)", source, step_field);
      std::string behavior = s["behavior"].get<std::string>();
      if (behavior == "Isolated") step->behavior = Behavior::kIsolated;
      else if (behavior == "Removed") step->behavior = Behavior::kRemoved;
      else if (behavior == "MergedWithPrevious") step->behavior = Behavior::kMergedWithPrevious;
      else if (behavior == "MergedWithNext") step->behavior = Behavior::kMergedWithNext;
      else if (behavior == "Contiguous") step->behavior = Behavior::kContiguous;
      else fail("{}: unsupported split behavior '{}' (field {}.behavior)", source, behavior,
                step_field);
      step->invert = bool_field(s, "invert", false, source, step_field);
    } else if (type == "ByteLevel") {
      seen_byte_level = true;
      step->add_prefix_space = bool_field(*step_json, "add_prefix_space", true, source, step_field);
      if (bool_field(*step_json, "use_regex", true, source, step_field))
        step->regex = std::make_shared<Regex>(kGpt2Pattern, false, source, step_field);
      // Without a prefix space or regex the step only maps bytes, which the model does itself.
      if (!step->add_prefix_space && step->regex == nullptr) continue;
    } else {
      fail("{}: unsupported pre-tokenizer type '{}' (field {}.type)", source, type, step_field);
    }
    result.steps_.push_back(std::move(step));
  }
  NIBBLE_CHECK(seen_byte_level,
               "{}: only byte-level BPE is supported, but there is no ByteLevel pre-tokenizer "
               "(field {})",
               source, field);
  return result;
}

void PreTokenizer::split(std::string_view text, std::vector<std::string>& out) const {
  if (text.empty()) return;
  std::vector<std::pair<Piece, bool>> matches;
  if (steps_.empty()) {
    out.emplace_back(text);
    return;
  }
  std::vector<std::string> current{std::string(text)};
  std::vector<std::string> next;
  for (size_t k = 0; k < steps_.size(); ++k) {
    std::vector<std::string>& target = k + 1 == steps_.size() ? out : next;
    for (const std::string& piece : current) steps_[k]->apply(piece, target, matches);
    if (k + 1 < steps_.size()) {
      current.swap(next);
      next.clear();
    }
  }
}

// ---- Oniguruma to PCRE2 pattern translation ----

std::string onig_to_pcre2(std::string_view pattern) {
  auto class_body = [](char c) -> const char* {
    switch (c) {
      case 's': case 'S': return "\\t-\\r\\x{85}\\p{Z}";
      case 'w': case 'W': return "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
      case 'd': case 'D': return "\\p{Nd}";
      case 'h': case 'H': return "0-9a-fA-F";  // Oniguruma's \h is a hex digit
      default: return nullptr;
    }
  };
  std::string out;
  bool in_class = false;
  size_t i = 0;
  while (i < pattern.size()) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char d = pattern[i + 1];
      const char* body = class_body(d);
      bool negated = d >= 'A' && d <= 'Z';
      if (body != nullptr && !(in_class && negated)) {
        out += in_class ? std::string(body) : fmt::format("[{}{}]", negated ? "^" : "", body);
        i += 2;
        continue;
      }
      size_t end = i + 2;
      if ((d == 'p' || d == 'P' || d == 'x') && end < pattern.size() && pattern[end] == '{') {
        size_t close = pattern.find('}', end);
        end = close == std::string_view::npos ? pattern.size() : close + 1;
      }
      out.append(pattern.substr(i, end - i));
      i = end;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < pattern.size() && pattern[i] == '^') out += pattern[i++];
      if (i < pattern.size() && pattern[i] == ']') out += pattern[i++];  // a literal ']'
      continue;
    }
    if (in_class && c == '[' && i + 1 < pattern.size() && pattern[i + 1] == ':') {
      size_t close = pattern.find(":]", i + 2);
      size_t end = close == std::string_view::npos ? i + 1 : close + 2;
      out.append(pattern.substr(i, end - i));
      i = end;
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
    ++i;
  }
  return out;
}

}  // namespace nibble::tok
