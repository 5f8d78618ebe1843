// UTF-8 validation and lossy conversion, and the GPT-2 byte-level alphabet. Encode and decode both
// depend on these agreeing exactly with Rust's UTF-8 rules (`from_utf8_lossy`) and with
// `bytes_to_unicode`, so they live in one place.
#include <array>

#include "tokenizer/pretokenize.h"

namespace nibble::tok {

namespace {

// The range the byte after lead byte b0 must fall in for the sequence to be well formed; this is
// what rules out overlongs (E0, F0), surrogates (ED) and code points past U+10FFFF (F4).
struct SecondByteRange {
  uint8_t lo, hi;
};

SecondByteRange second_byte_range(uint8_t b0) {
  switch (b0) {
    case 0xE0: return {0xA0, 0xBF};
    case 0xED: return {0x80, 0x9F};
    case 0xF0: return {0x90, 0xBF};
    case 0xF4: return {0x80, 0x8F};
    default: return {0x80, 0xBF};
  }
}

// Total length of the sequence lead byte b0 starts, or 0 if b0 cannot start one.
size_t lead_length(uint8_t b0) {
  if (b0 < 0x80) return 1;
  if (b0 < 0xC2) return 0;
  if (b0 < 0xE0) return 2;
  if (b0 < 0xF0) return 3;
  if (b0 < 0xF5) return 4;
  return 0;
}

// How many bytes starting at s[i] are a prefix of some well-formed sequence (at least 1 when the
// lead is usable). Equals the full length for a complete sequence.
size_t valid_prefix_length(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  size_t need = lead_length(p[i]);
  if (need == 0) return 0;
  size_t have = 1;
  while (have < need && i + have < s.size()) {
    uint8_t b = p[i + have];
    if (have == 1) {
      SecondByteRange r = second_byte_range(p[i]);
      if (b < r.lo || b > r.hi) break;
    } else if ((b & 0xC0) != 0x80) {
      break;
    }
    ++have;
  }
  return have;
}

struct Alphabet {
  std::array<char32_t, 256> byte_to_char{};
  std::array<int16_t, 512> char_to_byte{};  // every alphabet character is below U+0200

  Alphabet() {
    char_to_byte.fill(-1);
    // Printable Latin-1 bytes stand for themselves; the others are shifted to U+0100 and up, in
    // byte order, so every byte gets a visible, non-space character.
    auto printable = [](int b) {
      return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      byte_to_char[b] = printable(b) ? static_cast<char32_t>(b) : next++;
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet instance;
  return instance;
}

}  // namespace

size_t utf8_sequence_length(std::string_view s, size_t i) {
  size_t need = lead_length(static_cast<uint8_t>(s[i]));
  if (need <= 1) return need;
  return valid_prefix_length(s, i) == need ? need : 0;
}

char32_t utf8_decode_at(std::string_view s, size_t i, size_t length) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  switch (length) {
    case 1: return p[0];
    case 2: return ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    case 3: return ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    default:
      return ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) |
             (p[3] & 0x3Fu);
  }
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    size_t length = utf8_sequence_length(bytes, i);
    if (length > 0) {
      out.append(bytes.substr(i, length));
      i += length;
    } else {
      // One replacement per maximal subpart of a would-be sequence, as Rust and WHATWG do.
      out += kReplacement;
      i += std::max<size_t>(1, valid_prefix_length(bytes, i));
    }
  }
  return out;
}

size_t utf8_stable_prefix(std::string_view bytes) {
  size_t n = bytes.size();
  // Only the last character can still be completed by later bytes; its lead is at most 3 back.
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    size_t i = n - back;
    auto b = static_cast<uint8_t>(bytes[i]);
    if ((b & 0xC0) == 0x80) continue;
    size_t need = lead_length(b);
    if (need > back && valid_prefix_length(bytes, i) == back) return i;
    return n;
  }
  return n;
}

char32_t byte_to_char(uint8_t b) { return alphabet().byte_to_char[b]; }

int char_to_byte(char32_t cp) {
  return cp < alphabet().char_to_byte.size() ? alphabet().char_to_byte[cp] : -1;
}

std::optional<std::string> byte_level_to_bytes(std::string_view spelling) {
  std::string out;
  out.reserve(spelling.size());
  size_t i = 0;
  while (i < spelling.size()) {
    size_t length = utf8_sequence_length(spelling, i);
    if (length == 0) return std::nullopt;
    int b = char_to_byte(utf8_decode_at(spelling, i, length));
    if (b < 0) return std::nullopt;
    out += static_cast<char>(b);
    i += length;
  }
  return out;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) utf8_append(out, byte_to_char(static_cast<uint8_t>(c)));
  return out;
}

}  // namespace nibble::tok
