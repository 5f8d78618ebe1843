// A Jinja2 subset for chat templates (see chat_template.h): lexer with trim_blocks/lstrip_blocks
// and whitespace control, recursive-descent parser to a small AST, tree-walking evaluator over
// Python-like values.
#include "tokenizer/chat_template.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <unordered_map>
#include <variant>

#include "core/status.h"

namespace nibble {
namespace jinja {
namespace {

// ---------------------------------------------------------------------------------------------
// Values

struct Value;
using List = std::vector<Value>;
struct Dict;
struct Args;
using Function = std::function<Value(Args&)>;

struct Value {
  enum Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };
  Kind kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // string value, or the name of an undefined value (for errors)
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  bool is_namespace = false;
  bool is_tuple = false;  // a list that prints as a Python tuple: (a, b)
  std::shared_ptr<Function> fn;

  static Value undefined(std::string name = "") {
    Value v;
    v.s = std::move(name);
    return v;
  }
  static Value none() { return make(kNone); }
  static Value boolean(bool x) {
    Value v = make(kBool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = make(kInt);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = make(kFloat);
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v = make(kString);
    v.s = std::move(x);
    return v;
  }
  static Value of_list(List l) {
    Value v = make(kList);
    v.list = std::make_shared<List>(std::move(l));
    return v;
  }
  static Value tuple(List l) {
    Value v = of_list(std::move(l));
    v.is_tuple = true;
    return v;
  }
  static Value of_dict(std::shared_ptr<Dict> d, bool ns = false) {
    Value v = make(kDict);
    v.dict = std::move(d);
    v.is_namespace = ns;
    return v;
  }
  static Value function(Function f) {
    Value v = make(kFunction);
    v.fn = std::make_shared<Function>(std::move(f));
    return v;
  }
  bool is_undefined() const { return kind == kUndefined; }
  bool is_number() const { return kind == kInt || kind == kFloat || kind == kBool; }
  double as_double() const { return kind == kFloat ? f : kind == kBool ? double(b) : double(i); }

 private:
  static Value make(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& key) const {
    for (auto& [k, v] : items)
      if (k == key) return &v;
    return nullptr;
  }
  void set(const std::string& key, Value v) {
    for (auto& [k, old] : items)
      if (k == key) {
        old = std::move(v);
        return;
      }
    items.emplace_back(key, std::move(v));
  }
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Positional argument i, or keyword `name`, or the default.
  Value get(size_t i, const char* name, Value def = Value::undefined()) const {
    for (auto& [k, v] : kw)
      if (k == name) return v;
    return i < pos.size() ? pos[i] : def;
  }
};

[[noreturn]] void fail(const std::string& msg) { throw Error("chat template: " + msg); }

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone: return false;
    case Value::kBool: return v.b;
    case Value::kInt: return v.i != 0;
    case Value::kFloat: return v.f != 0;
    case Value::kString: return !v.s.empty();
    case Value::kList: return !v.list->empty();
    case Value::kDict: return !v.dict->items.empty() || v.is_namespace;
    case Value::kFunction: return true;
  }
  return false;
}

// Python's repr of a float: the shortest digits that round-trip, scientific below 1e-4 and from
// 1e16 on, ".0" on integral values.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::stoi(sci.substr(e + 1));
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  } else if (exp < 0) {
    out = "0." + std::string(size_t(-exp - 1), '0') + digits;
  } else if (size_t(exp) + 1 >= digits.size()) {
    out = digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
  }
  return neg ? "-" + out : out;
}

// Values nest at most this deep when printed or serialised: only a namespace that holds itself
// ({% set ns.self = ns %}) goes deeper, and that must end in an error, not a stack overflow.
constexpr int kMaxValueNesting = 256;
void check_nesting(int depth, const char* what) {
  if (depth > kMaxValueNesting)
    fail(fmt::format("{}: a value nested more than {} deep (a namespace that holds itself?)", what, kMaxValueNesting));
}

std::string repr(const Value& v, int depth = 0);

// Python str(): what {{ }} prints.
std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined: return "";
    case Value::kNone: return "None";
    case Value::kBool: return v.b ? "True" : "False";
    case Value::kInt: return std::to_string(v.i);
    case Value::kFloat: return float_repr(v.f);
    case Value::kString: return v.s;
    default: return repr(v);
  }
}

std::string py_quote(const std::string& s) {
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\')
      out += '\\', out += c;
    else if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c == '\r')
      out += "\\r";
    else
      out += c;
  }
  return out + q;
}

std::string repr(const Value& v, int depth) {
  check_nesting(depth, "printing");
  switch (v.kind) {
    case Value::kString: return py_quote(v.s);
    case Value::kList: {
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t i = 0; i < v.list->size(); ++i) out += (i ? ", " : "") + repr((*v.list)[i], depth + 1);
      if (v.is_tuple) return out + (v.list->size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Value::kDict: {
      std::string out = v.is_namespace ? "<Namespace {" : "{";
      bool first = true;
      for (auto& [k, x] : v.dict->items)
        out += (first ? "" : ", ") + py_quote(k) + ": " + repr(x, depth + 1), first = false;
      return out + (v.is_namespace ? "}>" : "}");
    }
    case Value::kFunction: return "<function>";
    default: return to_str(v);
  }
}

// json.dumps(x, ensure_ascii=False, indent=indent), as transformers' tojson filter does.
void to_json(const Value& v, int indent, int depth, std::string& out) {
  check_nesting(depth, "tojson");
  auto newline = [&](int d) {
    if (indent >= 0) out += '\n' + std::string(size_t(indent * d), ' ');
  };
  switch (v.kind) {
    case Value::kUndefined: fail("tojson: the value is undefined" + (v.s.empty() ? "" : " ('" + v.s + "')"));
    case Value::kNone: out += "null"; return;
    case Value::kBool: out += v.b ? "true" : "false"; return;
    case Value::kInt: out += std::to_string(v.i); return;
    case Value::kFloat:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : float_repr(v.f);
      return;
    case Value::kString: {
      out += '"';
      for (unsigned char c : v.s) {
        switch (c) {
          case '"': out += "\\\""; break;
          case '\\': out += "\\\\"; break;
          case '\n': out += "\\n"; break;
          case '\r': out += "\\r"; break;
          case '\t': out += "\\t"; break;
          case '\b': out += "\\b"; break;
          case '\f': out += "\\f"; break;
          default:
            if (c < 0x20)
              out += fmt::format("\\u{:04x}", c);
            else
              out += char(c);
        }
      }
      out += '"';
      return;
    }
    case Value::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += indent >= 0 ? "," : ", ";
        newline(depth + 1);
        to_json((*v.list)[i], indent, depth + 1, out);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      bool first = true;
      for (auto& [k, x] : v.dict->items) {
        if (!first) out += indent >= 0 ? "," : ", ";
        first = false;
        newline(depth + 1);
        to_json(Value::string(k), indent, depth + 1, out);
        out += ": ";
        to_json(x, indent, depth + 1, out);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::kFunction: fail("tojson: a function is not JSON serializable");
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (auto& x : j) l.push_back(from_json(x));
      return Value::of_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      for (auto& [k, x] : j.items()) d->items.emplace_back(k, from_json(x));
      return Value::of_dict(d);
    }
    default: fail("unsupported JSON value in the template context");
  }
}

// UTF-8 code points, for Python's len() and indexing of strings.
std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

uint32_t decode_cp(const std::string& cp) {
  const unsigned char c = cp[0];
  if (cp.size() == 1) return c;
  uint32_t v = cp.size() == 2 ? c & 0x1F : cp.size() == 3 ? c & 0x0F : c & 0x07;
  for (size_t i = 1; i < cp.size(); ++i) v = (v << 6) | (static_cast<unsigned char>(cp[i]) & 0x3F);
  return v;
}

std::string encode_cp(uint32_t v) {
  std::string o;
  if (v < 0x80)
    o += char(v);
  else if (v < 0x800)
    o += char(0xC0 | (v >> 6)), o += char(0x80 | (v & 0x3F));
  else if (v < 0x10000)
    o += char(0xE0 | (v >> 12)), o += char(0x80 | ((v >> 6) & 0x3F)), o += char(0x80 | (v & 0x3F));
  else
    o += char(0xF0 | (v >> 18)), o += char(0x80 | ((v >> 12) & 0x3F)), o += char(0x80 | ((v >> 6) & 0x3F)),
        o += char(0x80 | (v & 0x3F));
  return o;
}

// Simple case mapping of ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic: what Python's
// str.upper()/lower() do for the text templates see (other scripts pass through).
uint32_t to_case(uint32_t c, bool upper) {
  if (c < 0x80) return uint32_t(upper ? std::toupper(int(c)) : std::tolower(int(c)));
  if (upper) {
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7) || (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) || (c >= 0x430 && c <= 0x44F))
      return c - 0x20;
    if (c >= 0x450 && c <= 0x45F) return c - 0x50;
    if (c >= 0x100 && c <= 0x17F && c != 0x138 && c != 0x149 && ((c < 0x139 || c > 0x148) ? c % 2 == 1 : c % 2 == 0) &&
        !(c >= 0x179 && c % 2 == 1))
      return c - 1;
    if (c >= 0x179 && c <= 0x17E && c % 2 == 0) return c - 1;
    return c;
  }
  if ((c >= 0xC0 && c <= 0xDE && c != 0xD7) || (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) || (c >= 0x410 && c <= 0x42F))
    return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  if (c >= 0x100 && c <= 0x137 && c % 2 == 0) return c + 1;
  if (c >= 0x139 && c <= 0x148 && c % 2 == 1) return c + 1;
  if (c >= 0x14A && c <= 0x177 && c % 2 == 0) return c + 1;
  if (c >= 0x179 && c <= 0x17E && c % 2 == 1) return c + 1;
  return c;
}

std::string change_case(const std::string& cp, bool upper) { return encode_cp(to_case(decode_cp(cp), upper)); }

bool is_cased_letter(const std::string& cp) {
  const uint32_t c = decode_cp(cp);
  if (c < 0x80) return std::isalpha(int(c));
  return to_case(c, true) != c || to_case(c, false) != c || c == 0xDF;
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number() && a.kind != Value::kBool && b.kind != Value::kBool)
    return a.as_double() == b.as_double() && (a.kind != Value::kInt || b.kind != Value::kInt || a.i == b.i);
  if (a.kind != b.kind) {
    if (a.is_number() && b.is_number()) return a.as_double() == b.as_double();
    return false;
  }
  switch (a.kind) {
    case Value::kUndefined:
    case Value::kNone: return true;
    case Value::kBool: return a.b == b.b;
    case Value::kString: return a.s == b.s;
    case Value::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i)
        if (!equal((*a.list)[i], (*b.list)[i])) return false;
      return true;
    case Value::kDict:
      // Namespaces compare by identity, as Jinja's do (and a namespace may hold itself).
      if (a.is_namespace || b.is_namespace) return a.dict == b.dict;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default: return a.fn == b.fn;
  }
}

const char* kind_name(const Value& v) {
  static const char* names[] = {"undefined", "none", "bool", "int", "float", "string", "list", "dict", "function"};
  return v.is_namespace ? "namespace" : names[v.kind];
}

// ---------------------------------------------------------------------------------------------
// Lexer

struct Token {
  enum Kind { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Kind kind;
  std::string text;
  int line;
};

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& name) : src_(src), name_(name) {}

  std::vector<Token> run() {
    std::string text;
    while (pos_ < src_.size()) {
      const size_t open = find_open(pos_);
      text += src_.substr(pos_, open - pos_);
      advance_to(open);
      if (open >= src_.size()) break;
      const char kind = src_[open + 1];  // '{', '%' or '#'
      const bool strip_left = open + 2 < src_.size() && src_[open + 2] == '-';
      const bool keep_left = open + 2 < src_.size() && src_[open + 2] == '+';
      if (strip_left) {
        rstrip_all(text);
      } else if (kind != '{' && !keep_left) {
        lstrip_block(text);  // lstrip_blocks
      }
      if (!text.empty()) out_.push_back({Token::kText, text, line_});
      text.clear();
      advance_to(open + 2 + (strip_left || keep_left ? 1 : 0));
      bool strip_right = false;
      if (kind == '#') {
        const size_t close = src_.find("#}", pos_);
        if (close == std::string::npos) error("unterminated comment");
        strip_right = close > pos_ && src_[close - 1] == '-';
        advance_to(close + 2);
      } else {
        out_.push_back({kind == '{' ? Token::kVarBegin : Token::kBlockBegin, "", line_});
        strip_right = lex_tag(kind == '{' ? '}' : '%');
        out_.push_back({kind == '{' ? Token::kVarEnd : Token::kBlockEnd, "", line_});
        if (kind == '%' && is_raw_tag()) lex_raw(text);
      }
      if (strip_right) {
        while (pos_ < src_.size() && std::isspace(static_cast<unsigned char>(src_[pos_]))) advance_to(pos_ + 1);
      } else if (kind != '{') {  // trim_blocks: the first newline after a block tag
        if (src_.compare(pos_, 2, "\r\n") == 0)
          advance_to(pos_ + 2);
        else if (pos_ < src_.size() && src_[pos_] == '\n')
          advance_to(pos_ + 1);
      }
    }
    if (!text.empty()) out_.push_back({Token::kText, text, line_});
    out_.push_back({Token::kEof, "", line_});
    return std::move(out_);
  }

 private:
  size_t find_open(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i)
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return src_.size();
  }
  void advance_to(size_t p) {
    p = std::min(p, src_.size());
    line_ += int(std::count(src_.begin() + long(pos_), src_.begin() + long(p), '\n'));
    pos_ = p;
  }
  static void rstrip_all(std::string& t) {
    while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  }
  // lstrip_blocks: spaces and tabs between the start of a line and a block or comment tag go.
  // `t` is the source text right before the tag (src_[pos_ - t.size(), pos_)).
  void lstrip_block(std::string& t) const {
    size_t i = t.size();
    while (i > 0 && (t[i - 1] == ' ' || t[i - 1] == '\t')) --i;
    const size_t start = pos_ - t.size();
    const bool line_start = i > 0 ? t[i - 1] == '\n' : start == 0 || src_[start - 1] == '\n';
    if (line_start) t.resize(i);
  }
  [[noreturn]] void error(const std::string& what) const { fail(fmt::format("{}:{}: {}", name_, line_, what)); }

  // Tokens of a {{ }} or {% %} tag; returns whether it ended with '-' (strip the right side).
  bool lex_tag(char close) {
    while (true) {
      while (pos_ < src_.size() && std::isspace(static_cast<unsigned char>(src_[pos_]))) advance_to(pos_ + 1);
      if (pos_ >= src_.size()) error("unterminated tag");
      const char c = src_[pos_];
      auto ends_at = [&](size_t p) { return p + 1 < src_.size() && src_[p] == close && src_[p + 1] == '}'; };
      if ((c == '-' || c == '+') && ends_at(pos_ + 1)) {
        advance_to(pos_ + 3);
        return c == '-';
      }
      if (ends_at(pos_)) {
        advance_to(pos_ + 2);
        return false;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = pos_;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        out_.push_back({Token::kName, src_.substr(pos_, e - pos_), line_});
        advance_to(e);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = pos_;
        bool is_float = false;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t x = e + 1;
          if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
          if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
            is_float = true;
            e = x;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string num = src_.substr(pos_, e - pos_);
        num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
        out_.push_back({is_float ? Token::kFloat : Token::kInt, num, line_});
        advance_to(e);
      } else if (c == '"' || c == '\'') {
        std::string s;
        size_t p = pos_ + 1;
        for (; p < src_.size() && src_[p] != c; ++p) {
          if (src_[p] != '\\' || p + 1 >= src_.size()) {
            s += src_[p];
            continue;
          }
          const char e = src_[++p];
          switch (e) {
            case 'n': s += '\n'; break;
            case 't': s += '\t'; break;
            case 'r': s += '\r'; break;
            case '0': s += '\0'; break;
            case '\\': s += '\\'; break;
            case '\'': s += '\''; break;
            case '"': s += '"'; break;
            case 'u': {
              if (p + 4 >= src_.size()) error("bad \\u escape");
              uint32_t cp = 0;
              const char* hex = src_.data() + p + 1;
              if (std::from_chars(hex, hex + 4, cp, 16).ptr != hex + 4) error("bad \\u escape");
              p += 4;
              if (cp < 0x80)
                s += char(cp);
              else if (cp < 0x800)
                s += char(0xC0 | (cp >> 6)), s += char(0x80 | (cp & 0x3F));
              else
                s += char(0xE0 | (cp >> 12)), s += char(0x80 | ((cp >> 6) & 0x3F)), s += char(0x80 | (cp & 0x3F));
              break;
            }
            default: s += '\\', s += e;
          }
        }
        if (p >= src_.size()) error("unterminated string");
        out_.push_back({Token::kString, s, line_});
        advance_to(p + 1);
      } else {
        static const char* ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                    ">",  "(",  ")",  "[",  "]",  "{",  "}", ",", ".", ":", "|", "="};
        bool found = false;
        for (const char* op : ops) {
          const size_t n = std::char_traits<char>::length(op);
          if (src_.compare(pos_, n, op) == 0) {
            out_.push_back({Token::kOp, op, line_});
            advance_to(pos_ + n);
            found = true;
            break;
          }
        }
        if (!found) error(fmt::format("unexpected character '{}'", c));
      }
    }
  }

  bool is_raw_tag() const {
    const size_t n = out_.size();
    return n >= 3 && out_[n - 2].kind == Token::kName && out_[n - 2].text == "raw" &&
           out_[n - 3].kind == Token::kBlockBegin;
  }
  // {% raw %}...{% endraw %}: the body is text, as is.
  void lex_raw(std::string& text) {
    out_.resize(out_.size() - 3);
    const size_t end = src_.find("endraw", pos_);
    if (end == std::string::npos) error("{% raw %} without {% endraw %}");
    size_t open = src_.rfind("{%", end);
    const size_t close = src_.find("%}", end);
    if (open == std::string::npos || open < pos_ || close == std::string::npos) error("malformed {% endraw %}");
    std::string body = src_.substr(pos_, open - pos_);
    if (src_[open + 2] == '-') rstrip_all(body);
    text += body;
    advance_to(close + 2);
  }

  const std::string& src_;
  const std::string& name_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> out_;
};

// ---------------------------------------------------------------------------------------------
// AST

struct Expr;
using ExprPtr = std::shared_ptr<Expr>;
struct Expr {
  enum Kind {
    kLiteral,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kUnary,
    kBinary,
    kAnd,
    kOr,
    kNot,
    kCond,
    kList,
    kTuple,
    kDict
  };
  Kind kind;
  int line = 0;
  Value value;             // literal
  std::string name;        // name, attribute, filter/test name, operator
  std::vector<ExprPtr> a;  // operands: object, index, slice bounds (null = absent), call args...
  std::vector<std::pair<std::string, ExprPtr>> kw;
  bool negated = false;
};

struct Node;
using NodePtr = std::shared_ptr<Node>;
using Body = std::vector<NodePtr>;
struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kBody };
  Kind kind;
  int line = 0;
  std::string text;                                // text; set/macro name
  ExprPtr expr;                                    // output/set value; for iterable; if-filter is cond
  std::vector<std::pair<ExprPtr, Body>> branches;  // if/elif
  Body body, else_body;
  std::vector<std::string> targets;  // for/set names; macro params
  std::vector<ExprPtr> defaults;     // macro parameter defaults (null = none)
  std::string attr;                  // set ns.attr
  ExprPtr cond;                      // for ... if cond
};

}  // namespace

struct Template {
  Body body;
  std::string name;
};

namespace {

// ---------------------------------------------------------------------------------------------
// Parser

class Parser {
 public:
  Parser(std::vector<Token> toks, const std::string& name) : t_(std::move(toks)), name_(name) {}

  Body parse_all() {
    std::string end;
    Body b = parse_body({}, end);
    return b;
  }

 private:
  const Token& peek(size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(p_++, t_.size() - 1)]; }
  [[noreturn]] void error(const std::string& what) const { fail(fmt::format("{}:{}: {}", name_, peek().line, what)); }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).kind == Token::kOp && peek(k).text == op; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).kind == Token::kName && peek(k).text == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) error(fmt::format("expected '{}', found '{}'", op, peek().text));
    ++p_;
  }
  std::string expect_name() {
    if (peek().kind != Token::kName) error(fmt::format("expected a name, found '{}'", peek().text));
    return next().text;
  }
  void expect_block_end() {
    if (peek().kind != Token::kBlockEnd) error(fmt::format("expected the end of the tag, found '{}'", peek().text));
    ++p_;
  }

  // Parses nodes until a block tag whose keyword is in `ends` (consumed up to the keyword; `end`
  // receives it). Empty `ends`: until the end of the template.
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
    Body out;
    while (true) {
      const Token& tk = peek();
      if (tk.kind == Token::kEof) {
        if (!ends.empty()) error(fmt::format("missing {{% {} %}}", ends.back()));
        return out;
      }
      if (tk.kind == Token::kText) {
        auto n = std::make_shared<Node>();
        n->kind = Node::kText;
        n->text = next().text;
        out.push_back(n);
      } else if (tk.kind == Token::kVarBegin) {
        ++p_;
        auto n = std::make_shared<Node>();
        n->kind = Node::kOutput;
        n->line = tk.line;
        n->expr = parse_expr();
        if (peek().kind != Token::kVarEnd) error(fmt::format("expected '}}}}', found '{}'", peek().text));
        ++p_;
        out.push_back(n);
      } else if (tk.kind == Token::kBlockBegin) {
        const std::string kw = peek(1).kind == Token::kName ? peek(1).text : "";
        if (std::find(ends.begin(), ends.end(), kw) != ends.end()) {
          p_ += 2;
          end = kw;
          return out;
        }
        ++p_;
        out.push_back(parse_statement());
      } else {
        error(fmt::format("unexpected '{}'", tk.text));
      }
    }
  }

  NodePtr parse_statement() {
    DepthGuard guard(*this);
    const int line = peek().line;
    const std::string kw = expect_name();
    auto n = std::make_shared<Node>();
    n->line = line;
    std::string end;
    if (kw == "if") {
      n->kind = Node::kIf;
      ExprPtr cond = parse_expr();
      expect_block_end();
      while (true) {
        Body b = parse_body({"elif", "else", "endif"}, end);
        n->branches.emplace_back(cond, std::move(b));
        if (end == "elif") {
          cond = parse_expr();
          expect_block_end();
          continue;
        }
        if (end == "else") {
          expect_block_end();
          n->else_body = parse_body({"endif"}, end);
        }
        expect_block_end();
        return n;
      }
    }
    if (kw == "for") {
      n->kind = Node::kFor;
      n->targets.push_back(expect_name());
      while (is_op(",")) {
        ++p_;
        n->targets.push_back(expect_name());
      }
      if (!is_name("in")) error("expected 'in' in the for tag");
      ++p_;
      n->expr = parse_or();  // not a ternary: a trailing `if` filters the loop
      if (is_name("if")) {
        ++p_;
        n->cond = parse_or();
      }
      if (is_name("recursive")) error("recursive for loops are not supported");
      expect_block_end();
      n->body = parse_body({"else", "endfor"}, end);
      if (end == "else") {
        expect_block_end();
        n->else_body = parse_body({"endfor"}, end);
      }
      expect_block_end();
      return n;
    }
    if (kw == "set") {
      n->targets.push_back(expect_name());
      if (is_op(".")) {
        ++p_;
        n->attr = expect_name();
      }
      while (is_op(",")) {
        ++p_;
        n->targets.push_back(expect_name());
      }
      if (is_op("=")) {
        ++p_;
        n->kind = Node::kSet;
        n->expr = parse_tuple_or_expr();
        expect_block_end();
        return n;
      }
      n->kind = Node::kSetBlock;  // {% set x %}...{% endset %}
      expect_block_end();
      n->body = parse_body({"endset"}, end);
      expect_block_end();
      return n;
    }
    if (kw == "macro") {
      n->kind = Node::kMacro;
      n->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        n->targets.push_back(expect_name());
        if (is_op("=")) {
          ++p_;
          n->defaults.push_back(parse_expr());
        } else {
          n->defaults.push_back(nullptr);
        }
        if (!is_op(")")) expect_op(",");
      }
      ++p_;
      expect_block_end();
      n->body = parse_body({"endmacro"}, end);
      expect_block_end();
      return n;
    }
    if (kw == "break" || kw == "continue") {
      n->kind = kw == "break" ? Node::kBreak : Node::kContinue;
      expect_block_end();
      return n;
    }
    if (kw == "generation") {  // transformers' AssistantTracker: renders its body
      n->kind = Node::kBody;
      expect_block_end();
      n->body = parse_body({"endgeneration"}, end);
      expect_block_end();
      return n;
    }
    error(fmt::format("unknown or unsupported tag '{}'", kw));
  }

  ExprPtr make(Expr::Kind k, int line) {
    auto e = std::make_shared<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // `a, b` without brackets (set targets' values).
  ExprPtr parse_tuple_or_expr() {
    ExprPtr first = parse_expr();
    if (!is_op(",")) return first;
    ExprPtr t = make(Expr::kTuple, first->line);
    t->a.push_back(first);
    while (is_op(",")) {
      ++p_;
      t->a.push_back(parse_expr());
    }
    return t;
  }

  ExprPtr parse_expr() {
    DepthGuard guard(*this);
    ExprPtr e = parse_or();
    while (is_name("if")) {
      ++p_;
      ExprPtr c = make(Expr::kCond, e->line);
      c->a = {e, parse_or(), nullptr};
      if (is_name("else")) {
        ++p_;
        c->a[2] = parse_expr();
      }
      e = c;
    }
    return e;
  }
  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      ++p_;
      ExprPtr e = make(Expr::kOr, l->line);
      e->a = {l, parse_and()};
      l = e;
    }
    return l;
  }
  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      ++p_;
      ExprPtr e = make(Expr::kAnd, l->line);
      e->a = {l, parse_not()};
      l = e;
    }
    return l;
  }
  ExprPtr parse_not() {
    DepthGuard guard(*this);
    if (is_name("not")) {
      const int line = next().line;
      ExprPtr e = make(Expr::kNot, line);
      e->a = {parse_not()};
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr l = parse_math1();
    while (true) {
      std::string op;
      if (peek().kind == Token::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">="))) {
        op = next().text;
      } else if (is_name("in")) {
        ++p_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        return l;
      }
      ExprPtr e = make(Expr::kBinary, l->line);
      e->name = op;
      e->a = {l, parse_math1()};
      l = e;
    }
  }
  ExprPtr binary(const char* const* ops, size_t n, ExprPtr (Parser::*sub)()) {
    ExprPtr l = (this->*sub)();
    while (true) {
      const char* hit = nullptr;
      for (size_t i = 0; i < n; ++i)
        if (is_op(ops[i])) hit = ops[i];
      if (!hit) return l;
      ++p_;
      ExprPtr e = make(Expr::kBinary, l->line);
      e->name = hit;
      e->a = {l, (this->*sub)()};
      l = e;
    }
  }
  ExprPtr parse_math1() {
    static const char* ops[] = {"+", "-"};
    return binary(ops, 2, &Parser::parse_concat);
  }
  ExprPtr parse_concat() {
    static const char* ops[] = {"~"};
    return binary(ops, 1, &Parser::parse_math2);
  }
  ExprPtr parse_math2() {
    static const char* ops[] = {"*", "/", "//", "%"};
    return binary(ops, 4, &Parser::parse_pow);
  }
  ExprPtr parse_pow() {
    static const char* ops[] = {"**"};
    return binary(ops, 1, &Parser::parse_unary_filtered);
  }
  ExprPtr parse_unary_filtered() { return parse_unary(true); }
  // As Jinja2: `-3 | abs` is (-3) | abs; filters and tests bind to the whole unary expression.
  ExprPtr parse_unary(bool with_filters = true) {
    DepthGuard guard(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      e = make(Expr::kUnary, t.line);
      e->name = t.text;
      e->a = {parse_unary(false)};
    } else {
      e = parse_postfix(parse_primary());
    }
    return with_filters ? parse_filters(e) : e;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == Token::kName && is_op("=", 1)) {
        std::string k = next().text;
        ++p_;
        e.kw.emplace_back(k, parse_expr());
      } else {
        e.a.push_back(parse_expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    ++p_;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        ++p_;
        ExprPtr x = make(Expr::kAttr, e->line);
        if (peek().kind == Token::kInt)
          x->name = next().text;  // tuple.0
        else
          x->name = expect_name();
        x->a = {e};
        e = x;
      } else if (is_op("[")) {
        ++p_;
        ExprPtr idx[3] = {nullptr, nullptr, nullptr};
        int part = 0;
        bool slice = false;
        while (!is_op("]")) {
          if (is_op(":")) {
            ++p_;
            slice = true;
            if (++part > 2) error("too many ':' in a slice");
            continue;
          }
          idx[part] = parse_expr();
        }
        ++p_;
        ExprPtr x = make(slice ? Expr::kSlice : Expr::kItem, e->line);
        if (!slice && !idx[0]) error("empty subscript");
        x->a = {e, idx[0], idx[1], idx[2]};
        e = x;
      } else if (is_op("(")) {
        ExprPtr x = make(Expr::kCall, e->line);
        x->a.push_back(e);
        parse_call_args(*x);
        e = x;
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_filters(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        ++p_;
        ExprPtr f = make(Expr::kFilter, e->line);
        f->name = expect_name();
        f->a.push_back(e);
        if (is_op("(")) parse_call_args(*f);
        e = f;
      } else if (is_name("is")) {
        ++p_;
        ExprPtr t = make(Expr::kTest, e->line);
        if (is_name("not")) {
          ++p_;
          t->negated = true;
        }
        // `none`, `true` and `false` are test names here, not literals.
        t->name = peek().kind == Token::kName ? next().text : "";
        if (t->name.empty()) {
          if (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">="))
            t->name = next().text;
          else
            error("expected a test name after 'is'");
        }
        t->a.push_back(e);
        if (is_op("(")) {
          parse_call_args(*t);
        } else if (peek().kind == Token::kString || peek().kind == Token::kInt || peek().kind == Token::kFloat ||
                   (peek().kind == Token::kName && !is_name("and") && !is_name("or") && !is_name("if") &&
                    !is_name("else") && !is_name("is") && !is_name("in") && !is_name("not"))) {
          t->a.push_back(parse_postfix(parse_primary()));  // `is divisibleby 3`, `is sameas x`
        }
        e = t;
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    ExprPtr e = make(Expr::kLiteral, t.line);
    switch (t.kind) {
      case Token::kString: {
        std::string s = next().text;
        while (peek().kind == Token::kString) s += next().text;  // adjacent literals concatenate
        e->value = Value::string(s);
        return e;
      }
      case Token::kInt: {  // beyond int64 (Python has big ints): a float, as close as it gets
        const std::string& t = next().text;
        int64_t v = 0;
        if (std::from_chars(t.data(), t.data() + t.size(), v).ec == std::errc()) e->value = Value::integer(v);
        else e->value = Value::real(std::strtod(t.c_str(), nullptr));
        return e;
      }
      case Token::kFloat: e->value = Value::real(std::strtod(next().text.c_str(), nullptr)); return e;
      case Token::kName: {
        const std::string n = next().text;
        if (n == "true" || n == "True")
          e->value = Value::boolean(true);
        else if (n == "false" || n == "False")
          e->value = Value::boolean(false);
        else if (n == "none" || n == "None")
          e->value = Value::none();
        else {
          e->kind = Expr::kName;
          e->name = n;
        }
        return e;
      }
      case Token::kOp:
        if (t.text == "(") {
          ++p_;
          if (is_op(")")) {
            ++p_;
            e->kind = Expr::kTuple;
            return e;
          }
          ExprPtr first = parse_expr();
          if (!is_op(",")) {
            expect_op(")");
            return first;
          }
          e->kind = Expr::kTuple;
          e->a.push_back(first);
          while (is_op(",")) {
            ++p_;
            if (is_op(")")) break;
            e->a.push_back(parse_expr());
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          ++p_;
          e->kind = Expr::kList;
          while (!is_op("]")) {
            e->a.push_back(parse_expr());
            if (!is_op("]")) expect_op(",");
          }
          ++p_;
          return e;
        }
        if (t.text == "{") {
          ++p_;
          e->kind = Expr::kDict;
          while (!is_op("}")) {
            e->a.push_back(parse_expr());
            expect_op(":");
            e->a.push_back(parse_expr());
            if (!is_op("}")) expect_op(",");
          }
          ++p_;
          return e;
        }
        break;
      default: break;
    }
    error(fmt::format("unexpected '{}' in an expression",
                      t.kind == Token::kBlockEnd || t.kind == Token::kVarEnd ? std::string("end of tag") : t.text));
  }

  // Nesting deeper than any real template would exhaust the stack on hostile input.
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > 200) p_.error("expressions or blocks nested too deeply");
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

  std::vector<Token> t_;
  size_t p_ = 0;
  int depth_ = 0;
  const std::string& name_;
};

// ---------------------------------------------------------------------------------------------
// Evaluator

struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
  Value* find(const std::string& n) {
    for (Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(n);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

struct LoopControl {
  enum Kind { kNone, kBreak, kContinue } kind = kNone;
};

class Renderer {
 public:
  Renderer(const Template& t, std::time_t now) : t_(t), now_(now) { install_globals(); }
  // A namespace is the one value a template can change after making it, so it can come to hold
  // itself ({% set ns.self = ns %}, found by the fuzzer): the shared pointers would never free
  // such a cycle. Emptying every namespace made during the render breaks them all.
  ~Renderer() {
    for (auto& d : namespaces_) d->items.clear();
  }
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  std::string render(const nlohmann::ordered_json& context) {
    NIBBLE_CHECK(context.is_object(), "chat template context must be a JSON object");
    for (auto& [k, v] : context.items()) root_.vars[k] = from_json(v);
    std::string out;
    LoopControl lc;
    exec(t_.body, root_, out, lc);
    return out;
  }

 private:
  [[noreturn]] void error(int line, const std::string& what) const {
    fail(fmt::format("{}:{}: {}", t_.name, line, what));
  }

  void install_globals() {
    globals_.vars["raise_exception"] = Value::function(
        [](Args& a) -> Value { throw Error("chat template raised an exception: " + to_str(a.get(0, "message"))); });
    const std::time_t now = now_;
    globals_.vars["strftime_now"] = Value::function([now](Args& a) {
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const std::string f = to_str(a.get(0, "format"));
      const size_t n = std::strftime(buf, sizeof buf, f.c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
    globals_.vars["namespace"] = Value::function([this](Args& a) {
      auto d = std::make_shared<Dict>();
      namespaces_.push_back(d);
      for (auto& p : a.pos) {
        if (p.kind != Value::kDict) fail("namespace() takes keyword arguments or a dict");
        for (auto& [k, v] : p.dict->items) d->set(k, v);
      }
      for (auto& [k, v] : a.kw) d->set(k, v);
      return Value::of_dict(d, true);
    });
    globals_.vars["dict"] = Value::function([](Args& a) {
      auto d = std::make_shared<Dict>();
      for (auto& [k, v] : a.kw) d->set(k, v);
      return Value::of_dict(d);
    });
    globals_.vars["range"] = Value::function([](Args& a) {
      int64_t start = 0, stop = 0, step = 1;
      auto num = [](const Value& v) {
        if (v.kind != Value::kInt) fail("range() takes integers");
        return v.i;
      };
      if (a.pos.size() == 1)
        stop = num(a.pos[0]);
      else if (a.pos.size() >= 2)
        start = num(a.pos[0]), stop = num(a.pos[1]);
      if (a.pos.size() == 3) step = num(a.pos[2]);
      if (step == 0) fail("range() step must not be zero");
      List l;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        l.push_back(Value::integer(i));
        if (l.size() > 1'000'000) fail("range() too long");
      }
      return Value::of_list(std::move(l));
    });
    root_.parent = &globals_;
  }

  // Statements --------------------------------------------------------------------------------

  void exec(const Body& body, Scope& scope, std::string& out, LoopControl& lc) {
    for (const NodePtr& n : body) {
      exec(*n, scope, out, lc);
      if (lc.kind != LoopControl::kNone) return;
    }
  }

  void exec(const Node& n, Scope& scope, std::string& out, LoopControl& lc) {
    // A hostile or broken template must fail, not hang the server or exhaust its memory.
    if (++steps_ > 5'000'000) error(n.line, "the template runs too long (over 5 million steps)");
    if (out.size() > (64u << 20)) error(n.line, "the template's output is over 64 MiB");
    switch (n.kind) {
      case Node::kText: out += n.text; return;
      case Node::kOutput: out += to_str(eval(*n.expr, scope)); return;
      case Node::kBody: exec(n.body, scope, out, lc); return;
      case Node::kBreak: lc.kind = LoopControl::kBreak; return;
      case Node::kContinue: lc.kind = LoopControl::kContinue; return;
      case Node::kIf:
        for (auto& [cond, body] : n.branches)
          if (truthy(eval(*cond, scope))) return exec(body, scope, out, lc);
        return exec(n.else_body, scope, out, lc);
      case Node::kSet: {
        Value v = eval(*n.expr, scope);
        if (!n.attr.empty()) {
          Value* ns = scope.find(n.targets[0]);
          if (!ns || ns->kind != Value::kDict || !ns->is_namespace)
            error(n.line,
                  fmt::format("'{}' is not a namespace: cannot set '{}.{}'", n.targets[0], n.targets[0], n.attr));
          ns->dict->set(n.attr, v);
        } else {
          assign(n.targets, v, scope, n.line);
        }
        return;
      }
      case Node::kSetBlock: {
        std::string captured;
        LoopControl inner;
        exec(n.body, scope, captured, inner);
        scope.vars[n.targets[0]] = Value::string(captured);
        return;
      }
      case Node::kMacro: scope.vars[n.text] = make_macro(n); return;
      case Node::kFor: return exec_for(n, scope, out);
    }
  }

  void assign(const std::vector<std::string>& targets, const Value& v, Scope& scope, int line) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return;
    }
    if (v.kind != Value::kList || v.list->size() != targets.size())
      error(line, fmt::format("cannot unpack a {} into {} names", kind_name(v), targets.size()));
    for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = (*v.list)[i];
  }

  void exec_for(const Node& n, Scope& scope, std::string& out) {
    List items = iterate(eval(*n.expr, scope), n.line);
    if (n.cond) {  // `for x in xs if cond`: filtered before loop.* is computed
      List kept;
      for (auto& it : items) {
        Scope s{{}, &scope};
        assign(n.targets, it, s, n.line);
        if (truthy(eval(*n.cond, s))) kept.push_back(it);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      LoopControl lc;
      exec(n.else_body, scope, out, lc);
      return;
    }
    const int64_t len = int64_t(items.size());
    for (int64_t i = 0; i < len; ++i) {
      // A fresh scope per iteration, as Jinja2: assignments in the body neither leak out of the
      // loop nor carry over to the next iteration (templates use namespace() for that).
      Scope s{{}, &scope};
      if (++steps_ > 5'000'000) error(n.line, "the template runs too long (over 5 million steps)");
      auto loop = std::make_shared<Dict>();
      loop->set("index", Value::integer(i + 1));
      loop->set("index0", Value::integer(i));
      loop->set("revindex", Value::integer(len - i));
      loop->set("revindex0", Value::integer(len - i - 1));
      loop->set("first", Value::boolean(i == 0));
      loop->set("last", Value::boolean(i == len - 1));
      loop->set("length", Value::integer(len));
      loop->set("previtem", i > 0 ? items[size_t(i - 1)] : Value::undefined("loop.previtem"));
      loop->set("nextitem", i + 1 < len ? items[size_t(i + 1)] : Value::undefined("loop.nextitem"));
      s.vars["loop"] = Value::of_dict(loop);
      assign(n.targets, items[size_t(i)], s, n.line);
      LoopControl lc;
      exec(n.body, s, out, lc);
      if (lc.kind == LoopControl::kBreak) break;
    }
  }

  Value make_macro(const Node& n) {
    const Node* node = &n;
    return Value::function([this, node](Args& a) {
      if (macro_depth_ >= 100) error(node->line, fmt::format("macro '{}' recursed more than 100 deep", node->text));
      struct Depth {
        int& d;
        explicit Depth(int& x) : d(++x) {}
        ~Depth() { --d; }
      } depth(macro_depth_);
      Scope s{{}, &root_};
      for (size_t i = 0; i < node->targets.size(); ++i) {
        Value v = a.get(i, node->targets[i].c_str());
        if (v.is_undefined() && node->defaults[i]) v = eval(*node->defaults[i], s);
        s.vars[node->targets[i]] = v;
      }
      std::string out;
      LoopControl lc;
      exec(node->body, s, out, lc);
      return Value::string(out);
    });
  }

  List iterate(const Value& v, int line) {
    switch (v.kind) {
      case Value::kUndefined:
      case Value::kNone: return {};  // Jinja2's Undefined iterates as empty; None errors there
      case Value::kList: return *v.list;
      case Value::kDict: {
        List keys;
        for (auto& [k, x] : v.dict->items) keys.push_back(Value::string(k));
        return keys;
      }
      case Value::kString: {
        List chars;
        for (auto& c : code_points(v.s)) chars.push_back(Value::string(c));
        return chars;
      }
      default: error(line, fmt::format("a {} is not iterable", kind_name(v)));
    }
  }

  // Expressions -------------------------------------------------------------------------------

  Value eval(const Expr& e, Scope& scope) {
    switch (e.kind) {
      case Expr::kLiteral: return e.value;
      case Expr::kName: {
        if (Value* v = scope.find(e.name)) return *v;
        return Value::undefined(e.name);
      }
      case Expr::kAttr: return get_attr(eval(*e.a[0], scope), e.name, e.line);
      case Expr::kItem: return get_item(eval(*e.a[0], scope), eval(*e.a[1], scope), e.line);
      case Expr::kSlice: return slice(e, scope);
      case Expr::kCall: return call(e, scope);
      case Expr::kFilter: return filter(e, scope);
      case Expr::kTest: {
        const bool r = test(e, scope);
        return Value::boolean(e.negated ? !r : r);
      }
      case Expr::kUnary: {
        Value v = eval(*e.a[0], scope);
        if (!v.is_number()) error(e.line, fmt::format("bad operand for unary {}: {}", e.name, kind_name(v)));
        if (e.name == "+") return v;
        return v.kind == Value::kFloat ? Value::real(-v.f) : Value::integer(-int64_t(v.as_double()));
      }
      case Expr::kNot: return Value::boolean(!truthy(eval(*e.a[0], scope)));
      case Expr::kAnd: {
        Value l = eval(*e.a[0], scope);
        return truthy(l) ? eval(*e.a[1], scope) : l;
      }
      case Expr::kOr: {
        Value l = eval(*e.a[0], scope);
        return truthy(l) ? l : eval(*e.a[1], scope);
      }
      case Expr::kCond:
        if (truthy(eval(*e.a[1], scope))) return eval(*e.a[0], scope);
        return e.a[2] ? eval(*e.a[2], scope) : Value::undefined();
      case Expr::kList:
      case Expr::kTuple: {
        List l;
        for (auto& x : e.a) l.push_back(eval(*x, scope));
        return e.kind == Expr::kTuple ? Value::tuple(std::move(l)) : Value::of_list(std::move(l));
      }
      case Expr::kDict: {
        auto d = std::make_shared<Dict>();
        for (size_t i = 0; i + 1 < e.a.size(); i += 2) d->set(to_str(eval(*e.a[i], scope)), eval(*e.a[i + 1], scope));
        return Value::of_dict(d);
      }
      case Expr::kBinary: return binary(e, scope);
    }
    error(e.line, "bad expression");
  }

  static bool is_dict_method(const std::string& n) {
    return n == "items" || n == "keys" || n == "values" || n == "get";
  }

  // `x.name`: Jinja2 tries the Python attribute first, then the item.
  Value get_attr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined())
      error(line, fmt::format("'{}' is undefined (reading .{})", obj.s.empty() ? "value" : obj.s, name));
    if (obj.kind == Value::kDict) {
      if (!obj.is_namespace && is_dict_method(name)) return bound_method(obj, name);
      if (const Value* v = obj.dict->find(name)) return *v;
      return Value::undefined(name);
    }
    if (obj.kind == Value::kString || obj.kind == Value::kList) return bound_method(obj, name);
    return Value::undefined(name);
  }

  // `x[key]`: the item first, then the attribute.
  Value get_item(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined())
      error(line, fmt::format("'{}' is undefined (subscripted)", obj.s.empty() ? "value" : obj.s));
    if (obj.kind == Value::kDict) {
      if (const Value* v = obj.dict->find(to_str(key))) return *v;
      if (key.kind == Value::kString && is_dict_method(key.s) && !obj.is_namespace) return bound_method(obj, key.s);
      return Value::undefined(to_str(key));
    }
    if (obj.kind == Value::kList || obj.kind == Value::kString) {
      if (key.kind != Value::kInt) {
        if (key.kind == Value::kString) return bound_method(obj, key.s);
        error(line, fmt::format("{} indices must be integers, not {}", kind_name(obj), kind_name(key)));
      }
      if (obj.kind == Value::kList) {
        int64_t i = key.i < 0 ? key.i + int64_t(obj.list->size()) : key.i;
        if (i < 0 || i >= int64_t(obj.list->size())) return Value::undefined("index");
        return (*obj.list)[size_t(i)];
      }
      auto cps = code_points(obj.s);
      int64_t i = key.i < 0 ? key.i + int64_t(cps.size()) : key.i;
      if (i < 0 || i >= int64_t(cps.size())) return Value::undefined("index");
      return Value::string(cps[size_t(i)]);
    }
    return Value::undefined(to_str(key));
  }

  Value slice(const Expr& e, Scope& scope) {
    Value obj = eval(*e.a[0], scope);
    auto bound = [&](const ExprPtr& x) -> std::optional<int64_t> {
      if (!x) return std::nullopt;
      Value v = eval(*x, scope);
      if (v.kind == Value::kNone) return std::nullopt;
      if (v.kind != Value::kInt) error(e.line, "slice indices must be integers");
      return v.i;
    };
    auto start = bound(e.a[1]), stop = bound(e.a[2]), step_v = bound(e.a[3]);
    const int64_t step = step_v.value_or(1);
    if (step == 0) error(e.line, "slice step cannot be zero");
    std::vector<Value> items;
    std::vector<std::string> cps;
    if (obj.kind == Value::kList)
      items = *obj.list;
    else if (obj.kind == Value::kString)
      cps = code_points(obj.s);
    else
      error(e.line, fmt::format("cannot slice a {}", kind_name(obj)));
    const int64_t n = obj.kind == Value::kList ? int64_t(items.size()) : int64_t(cps.size());
    // Python's slice.indices().
    auto clamp = [&](std::optional<int64_t> v, int64_t def) {
      if (!v) return def;
      int64_t x = *v < 0 ? *v + n : *v;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t lo = clamp(start, step > 0 ? 0 : n - 1), hi = clamp(stop, step > 0 ? n : -1);
    List out;
    std::string s;
    for (int64_t i = lo; step > 0 ? i < hi : i > hi; i += step) {
      if (obj.kind == Value::kList)
        out.push_back(items[size_t(i)]);
      else
        s += cps[size_t(i)];
    }
    return obj.kind == Value::kList ? Value::of_list(std::move(out)) : Value::string(s);
  }

  Args eval_args(const Expr& e, Scope& scope, size_t first) {
    Args a;
    for (size_t i = first; i < e.a.size(); ++i) a.pos.push_back(eval(*e.a[i], scope));
    for (auto& [k, x] : e.kw) a.kw.emplace_back(k, eval(*x, scope));
    return a;
  }

  Value call(const Expr& e, Scope& scope) {
    Value f = eval(*e.a[0], scope);
    Args a = eval_args(e, scope, 1);
    if (f.kind != Value::kFunction) {
      const std::string what = e.a[0]->kind == Expr::kName   ? "'" + e.a[0]->name + "'"
                               : e.a[0]->kind == Expr::kAttr ? "method '" + e.a[0]->name + "'"
                                                             : "the value";
      error(e.line, fmt::format("{} is not callable ({})", what, kind_name(f)));
    }
    try {
      return (*f.fn)(a);
    } catch (const Error& err) {
      const std::string msg = err.what();
      if (msg.rfind("chat template", 0) == 0) throw;
      error(e.line, msg);
    }
  }

  static std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
    const std::string set = chars.kind == Value::kString ? chars.s : std::string(" \t\n\r\f\v");
    size_t b = 0, en = s.size();
    if (left)
      while (b < en && set.find(s[b]) != std::string::npos) ++b;
    if (right)
      while (en > b && set.find(s[en - 1]) != std::string::npos) --en;
    return s.substr(b, en - b);
  }

  static std::string title_case(const std::string& s) {
    std::string out;
    bool start = true;
    for (const std::string& cp : code_points(s)) {
      if (is_cased_letter(cp)) {
        out += change_case(cp, start);
        start = false;
      } else {
        out += cp;
        start = true;
      }
    }
    return out;
  }

  static std::string replace_all(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    if (from.empty()) return s;
    std::string out;
    size_t p = 0;
    for (int64_t n = 0; count < 0 || n < count; ++n) {
      const size_t q = s.find(from, p);
      if (q == std::string::npos) break;
      out += s.substr(p, q - p) + to;
      p = q + from.size();
    }
    return out + s.substr(p);
  }

  static List split(const std::string& s, const Value& sep, int64_t maxsplit) {
    List out;
    if (sep.kind != Value::kString) {  // whitespace split
      size_t i = 0;
      while (true) {
        while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
        if (i >= s.size()) break;
        if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
          std::string rest = s.substr(i);
          while (!rest.empty() && std::isspace(static_cast<unsigned char>(rest.back()))) rest.pop_back();
          out.push_back(Value::string(rest));
          break;
        }
        size_t j = i;
        while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
        out.push_back(Value::string(s.substr(i, j - i)));
        i = j;
      }
      return out;
    }
    if (sep.s.empty()) fail("split(): empty separator");
    size_t p = 0;
    while (maxsplit < 0 || int64_t(out.size()) < maxsplit) {
      const size_t q = s.find(sep.s, p);
      if (q == std::string::npos) break;
      out.push_back(Value::string(s.substr(p, q - p)));
      p = q + sep.s.size();
    }
    out.push_back(Value::string(s.substr(p)));
    return out;
  }

  // Python methods of strings, dicts and lists that templates call.
  Value bound_method(const Value& obj, const std::string& name) {
    Value self = obj;
    if (obj.kind == Value::kString) {
      const std::string& s = obj.s;
      if (name == "startswith" || name == "endswith") {
        return Value::function([s, name](Args& a) {
          Value p = a.get(0, "prefix");
          List opts = p.kind == Value::kList ? *p.list : List{p};
          for (auto& o : opts) {
            const std::string x = to_str(o);
            if (name == "startswith" ? s.rfind(x, 0) == 0
                                     : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0)
              return Value::boolean(true);
          }
          return Value::boolean(false);
        });
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip")
        return Value::function([s, name](Args& a) {
          return Value::string(strip_chars(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
        });
      if (name == "split")
        return Value::function([s](Args& a) {
          Value m = a.get(1, "maxsplit", Value::integer(-1));
          return Value::of_list(split(s, a.get(0, "sep"), m.kind == Value::kInt ? m.i : -1));
        });
      if (name == "upper" || name == "lower")
        return Value::function([s, name](Args&) {
          std::string o;
          for (const std::string& cp : code_points(s)) o += change_case(cp, name == "upper");
          return Value::string(o);
        });
      if (name == "title") return Value::function([s](Args&) { return Value::string(title_case(s)); });
      if (name == "capitalize")
        return Value::function([s](Args&) {
          std::string o;
          for (const std::string& cp : code_points(s)) o += change_case(cp, o.empty());
          return Value::string(o);
        });
      if (name == "replace")
        return Value::function([s](Args& a) {
          Value c = a.get(2, "count", Value::integer(-1));
          return Value::string(
              replace_all(s, to_str(a.get(0, "old")), to_str(a.get(1, "new")), c.kind == Value::kInt ? c.i : -1));
        });
      if (name == "find")
        return Value::function([s](Args& a) {
          const size_t p = s.find(to_str(a.get(0, "sub")));
          return Value::integer(p == std::string::npos ? -1 : int64_t(code_points(s.substr(0, p)).size()));
        });
      if (name == "count")
        return Value::function([s](Args& a) {
          const std::string x = to_str(a.get(0, "sub"));
          int64_t n = 0;
          for (size_t p = 0; !x.empty() && (p = s.find(x, p)) != std::string::npos; p += x.size()) ++n;
          return Value::integer(n);
        });
      if (name == "join")
        return Value::function([s](Args& a) {
          std::string out;
          List items = a.get(0, "iterable").kind == Value::kList ? *a.get(0, "iterable").list : List{};
          for (size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + to_str(items[i]);
          return Value::string(out);
        });
      if (name == "isdigit" || name == "isalpha" || name == "isspace")
        return Value::function([s, name](Args&) {
          bool ok = !s.empty();
          for (unsigned char c : s)
            ok = ok && (name == "isdigit" ? std::isdigit(c) : name == "isalpha" ? std::isalpha(c) : std::isspace(c));
          return Value::boolean(ok);
        });
    } else if (obj.kind == Value::kDict) {
      if (name == "items" || name == "keys" || name == "values")
        return Value::function([self, name](Args&) {
          List out;
          for (auto& [k, v] : self.dict->items) {
            if (name == "items")
              out.push_back(Value::tuple({Value::string(k), v}));
            else
              out.push_back(name == "keys" ? Value::string(k) : v);
          }
          return Value::of_list(std::move(out));
        });
      if (name == "get")
        return Value::function([self](Args& a) {
          const Value* v = self.dict->find(to_str(a.get(0, "key")));
          return v ? *v : a.get(1, "default", Value::none());
        });
    }
    return Value::undefined(name);
  }

  Value binary(const Expr& e, Scope& scope) {
    const std::string& op = e.name;
    Value l = eval(*e.a[0], scope), r = eval(*e.a[1], scope);
    if (op == "==") return Value::boolean(equal(l, r));
    if (op == "!=") return Value::boolean(!equal(l, r));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (r.kind == Value::kString)
        found = r.s.find(to_str(l)) != std::string::npos;
      else if (r.kind == Value::kList)
        found = std::any_of(r.list->begin(), r.list->end(), [&](const Value& x) { return equal(x, l); });
      else if (r.kind == Value::kDict)
        found = r.dict->find(to_str(l)) != nullptr;
      else if (!r.is_undefined())
        error(e.line, fmt::format("'in' needs a string, list or dict, not {}", kind_name(r)));
      return Value::boolean(op == "in" ? found : !found);
    }
    if (op == "~") return Value::string(to_str(l) + to_str(r));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c;
      if (l.is_number() && r.is_number())
        c = l.as_double() < r.as_double() ? -1 : l.as_double() > r.as_double();
      else if (l.kind == Value::kString && r.kind == Value::kString)
        c = l.s.compare(r.s);
      else
        error(e.line, fmt::format("'{}' not supported between {} and {}", op, kind_name(l), kind_name(r)));
      return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "+") {
      if (l.kind == Value::kString && r.kind == Value::kString) return Value::string(l.s + r.s);
      if (l.kind == Value::kList && r.kind == Value::kList) {
        List out = *l.list;
        out.insert(out.end(), r.list->begin(), r.list->end());
        return Value::of_list(std::move(out));
      }
    }
    if (op == "*" && l.kind == Value::kString && r.kind == Value::kInt) {
      std::string out;
      for (int64_t i = 0; i < r.i && out.size() < (1u << 24); ++i) out += l.s;
      return Value::string(out);
    }
    if (!l.is_number() || !r.is_number())
      error(e.line, fmt::format("unsupported operand types for {}: {} and {}", op, kind_name(l), kind_name(r)));
    const bool ints = l.kind != Value::kFloat && r.kind != Value::kFloat;
    const double x = l.as_double(), y = r.as_double();
    const int64_t xi = int64_t(x), yi = int64_t(y);
    if (op == "+") return ints ? Value::integer(xi + yi) : Value::real(x + y);
    if (op == "-") return ints ? Value::integer(xi - yi) : Value::real(x - y);
    if (op == "*") return ints ? Value::integer(xi * yi) : Value::real(x * y);
    if (op == "**") return ints && yi >= 0 ? Value::integer(int64_t(std::pow(x, y))) : Value::real(std::pow(x, y));
    if (y == 0) error(e.line, "division by zero");
    if (op == "/") return Value::real(x / y);
    if (op == "//") return ints ? Value::integer(int64_t(std::floor(x / y))) : Value::real(std::floor(x / y));
    if (op == "%") {
      if (ints) return Value::integer(((xi % yi) + yi) % yi);
      return Value::real(x - y * std::floor(x / y));
    }
    error(e.line, "unknown operator " + op);
  }

  static int64_t length(const Value& v) {
    switch (v.kind) {
      case Value::kString: return int64_t(code_points(v.s).size());
      case Value::kList: return int64_t(v.list->size());
      case Value::kDict: return int64_t(v.dict->items.size());
      case Value::kUndefined: return 0;
      default: fail(fmt::format("object of type {} has no length", kind_name(v)));
    }
  }

  bool run_test(const std::string& name, const Value& v, const Args& a, int line) {
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.kind == Value::kNone;
    if (name == "boolean") return v.kind == Value::kBool;
    if (name == "true") return v.kind == Value::kBool && v.b;
    if (name == "false") return v.kind == Value::kBool && !v.b;
    if (name == "integer") return v.kind == Value::kInt;
    if (name == "float") return v.kind == Value::kFloat;
    if (name == "number") return v.is_number();
    if (name == "string") return v.kind == Value::kString;
    if (name == "mapping") return v.kind == Value::kDict;
    if (name == "iterable")
      return v.kind == Value::kList || v.kind == Value::kDict || v.kind == Value::kString || v.is_undefined();
    if (name == "sequence") return v.kind == Value::kList || v.kind == Value::kDict || v.kind == Value::kString;
    if (name == "callable") return v.kind == Value::kFunction;
    if (name == "odd" || name == "even") {
      if (v.kind != Value::kInt) error(line, fmt::format("test '{}' needs an integer", name));
      return (v.i % 2 != 0) == (name == "odd");
    }
    if (name == "divisibleby") {
      Value d = a.get(0, "num");
      return v.kind == Value::kInt && d.kind == Value::kInt && d.i != 0 && v.i % d.i == 0;
    }
    if (name == "lower" || name == "upper") {
      if (v.kind != Value::kString) return false;
      for (unsigned char c : v.s)
        if (name == "lower" ? std::isupper(c) : std::islower(c)) return false;
      return true;
    }
    const Value other = a.get(0, "other");
    if (name == "eq" || name == "equalto" || name == "==" || name == "sameas") return equal(v, other);
    if (name == "ne" || name == "!=") return !equal(v, other);
    if (name == "in") {
      if (other.kind == Value::kList)
        return std::any_of(other.list->begin(), other.list->end(), [&](const Value& x) { return equal(x, v); });
      if (other.kind == Value::kString) return other.s.find(to_str(v)) != std::string::npos;
      if (other.kind == Value::kDict) return other.dict->find(to_str(v)) != nullptr;
      return false;
    }
    if (name == "lt" || name == "<" || name == "gt" || name == ">" || name == "le" || name == "<=" || name == "ge" ||
        name == ">=") {
      if (!v.is_number() || !other.is_number()) error(line, fmt::format("test '{}' needs numbers", name));
      const double x = v.as_double(), y = other.as_double();
      if (name == "lt" || name == "<") return x < y;
      if (name == "gt" || name == ">") return x > y;
      if (name == "le" || name == "<=") return x <= y;
      return x >= y;
    }
    error(line, fmt::format("unknown test '{}'", name));
  }

  bool test(const Expr& e, Scope& scope) {
    Value v = eval(*e.a[0], scope);
    Args a = eval_args(e, scope, 1);
    return run_test(e.name, v, a, e.line);
  }

  // The attribute path of map/selectattr/sort ("a.b" or an index).
  Value attribute(const Value& v, const std::string& path, int line) {
    Value cur = v;
    size_t p = 0;
    while (true) {
      const size_t q = path.find('.', p);
      const std::string part = path.substr(p, q == std::string::npos ? std::string::npos : q - p);
      if (cur.is_undefined()) return cur;
      cur = cur.kind == Value::kList && !part.empty() && std::isdigit(static_cast<unsigned char>(part[0]))
                ? get_item(cur, Value::integer(std::strtoll(part.c_str(), nullptr, 10)), line)
            : cur.kind == Value::kDict ? get_item(cur, Value::string(part), line)
                                       : Value::undefined(part);
      if (q == std::string::npos) return cur;
      p = q + 1;
    }
  }

  Value filter(const Expr& e, Scope& scope) {
    const std::string& f = e.name;
    Value v = eval(*e.a[0], scope);
    Args a = eval_args(e, scope, 1);
    const int line = e.line;
    auto need_list = [&](const Value& x) -> List {
      if (x.kind == Value::kList) return *x.list;
      if (x.is_undefined()) return {};
      return iterate(x, line);
    };
    if (f == "length" || f == "count") return Value::integer(length(v));
    if (f == "tojson") {
      Value ind = a.get(0, "indent", Value::none());
      std::string out;
      to_json(v, ind.kind == Value::kInt ? int(ind.i) : -1, 0, out);
      return Value::string(out);
    }
    if (f == "string") return Value::string(to_str(v));
    if (f == "safe" || f == "e" || f == "escape") {
      if (f == "safe") return v;
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value::string(out);
    }
    if (f == "trim") return Value::string(strip_chars(to_str(v), a.get(0, "chars"), true, true));
    if (f == "upper" || f == "lower" || f == "title" || f == "capitalize") {
      Value s = Value::string(to_str(v));
      Args none;
      return (*bound_method(s, f).fn)(none);
    }
    if (f == "replace") {
      Value c = a.get(2, "count", Value::integer(-1));
      return Value::string(
          replace_all(to_str(v), to_str(a.get(0, "old")), to_str(a.get(1, "new")), c.kind == Value::kInt ? c.i : -1));
    }
    if (f == "default" || f == "d") {
      const bool boolean = truthy(a.get(1, "boolean", Value::boolean(false)));
      if (v.is_undefined() || (boolean && !truthy(v))) return a.get(0, "default_value", Value::string(""));
      return v;
    }
    if (f == "join") {
      const std::string sep = to_str(a.get(0, "d", Value::string("")));
      Value attr = a.get(1, "attribute");
      std::string out;
      List items = need_list(v);
      for (size_t i = 0; i < items.size(); ++i)
        out += (i ? sep : "") + to_str(attr.is_undefined() ? items[i] : attribute(items[i], to_str(attr), line));
      return Value::string(out);
    }
    if (f == "first" || f == "last") {
      List items = need_list(v);
      if (items.empty()) return Value::undefined(f);
      return f == "first" ? items.front() : items.back();
    }
    if (f == "list") return Value::of_list(need_list(v));
    if (f == "reverse") {
      if (v.kind == Value::kString) {
        auto cps = code_points(v.s);
        std::string out;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
        return Value::string(out);
      }
      List items = need_list(v);
      std::reverse(items.begin(), items.end());
      return Value::of_list(std::move(items));
    }
    if (f == "int") {
      if (v.kind == Value::kString) {
        try {
          return Value::integer(std::stoll(v.s));
        } catch (...) {
          return a.get(0, "default", Value::integer(0));
        }
      }
      return v.is_number() ? Value::integer(int64_t(v.as_double())) : a.get(0, "default", Value::integer(0));
    }
    if (f == "float") {
      if (v.kind == Value::kString) {
        try {
          return Value::real(std::stod(v.s));
        } catch (...) {
          return a.get(0, "default", Value::real(0));
        }
      }
      return v.is_number() ? Value::real(v.as_double()) : a.get(0, "default", Value::real(0));
    }
    if (f == "abs") {
      if (!v.is_number()) error(line, "abs needs a number");
      return v.kind == Value::kFloat ? Value::real(std::fabs(v.f)) : Value::integer(std::llabs(int64_t(v.as_double())));
    }
    if (f == "items" || f == "dictsort") {
      if (v.is_undefined()) return Value::of_list({});
      if (v.kind != Value::kDict) error(line, fmt::format("'{}' needs a dict, not {}", f, kind_name(v)));
      List out;
      for (auto& [k, x] : v.dict->items) out.push_back(Value::tuple({Value::string(k), x}));
      if (f == "dictsort")
        std::stable_sort(out.begin(), out.end(),
                         [](const Value& p, const Value& q) { return (*p.list)[0].s < (*q.list)[0].s; });
      return Value::of_list(std::move(out));
    }
    if (f == "selectattr" || f == "rejectattr" || f == "select" || f == "reject") {
      const bool by_attr = f == "selectattr" || f == "rejectattr";
      const bool keep_if = f == "selectattr" || f == "select";
      const std::string attr = by_attr ? to_str(a.get(0, "attribute")) : "";
      const size_t test_at = by_attr ? 1 : 0;
      const Value test_name = test_at < a.pos.size() ? a.pos[test_at] : Value::undefined();
      Args targs;
      for (size_t i = test_at + 1; i < a.pos.size(); ++i) targs.pos.push_back(a.pos[i]);
      List out;
      for (auto& item : need_list(v)) {
        Value x = by_attr ? attribute(item, attr, line) : item;
        const bool ok = test_name.is_undefined() ? truthy(x) : run_test(to_str(test_name), x, targs, line);
        if (ok == keep_if) out.push_back(item);
      }
      return Value::of_list(std::move(out));
    }
    if (f == "map") {
      Value attr = a.get(99, "attribute");
      List out;
      for (auto& item : need_list(v)) {
        if (!attr.is_undefined()) {
          Value x = attribute(item, to_str(attr), line);
          out.push_back(x.is_undefined() ? a.get(99, "default", x) : x);
        } else {
          if (a.pos.empty()) error(line, "map() needs a filter name or attribute=");
          auto call = std::make_shared<Expr>();
          call->kind = Expr::kFilter;
          call->name = to_str(a.pos[0]);
          call->line = line;
          auto lit = std::make_shared<Expr>();
          lit->kind = Expr::kLiteral;
          lit->value = item;
          call->a.push_back(lit);
          for (size_t i = 1; i < a.pos.size(); ++i) {
            auto arg = std::make_shared<Expr>();
            arg->kind = Expr::kLiteral;
            arg->value = a.pos[i];
            call->a.push_back(arg);
          }
          out.push_back(filter(*call, scope));
        }
      }
      return Value::of_list(std::move(out));
    }
    if (f == "unique") {
      List out;
      for (auto& item : need_list(v))
        if (std::none_of(out.begin(), out.end(), [&](const Value& x) { return equal(x, item); })) out.push_back(item);
      return Value::of_list(std::move(out));
    }
    if (f == "sort") {
      List items = need_list(v);
      const bool rev = truthy(a.get(0, "reverse", Value::boolean(false)));
      Value attr = a.get(2, "attribute");
      auto key = [&](const Value& x) { return attr.is_undefined() ? x : attribute(x, to_str(attr), line); };
      std::stable_sort(items.begin(), items.end(), [&](const Value& p, const Value& q) {
        Value x = key(p), y = key(q);
        bool lt = x.is_number() && y.is_number() ? x.as_double() < y.as_double() : to_str(x) < to_str(y);
        return rev ? (x.is_number() && y.is_number() ? x.as_double() > y.as_double() : to_str(x) > to_str(y)) : lt;
      });
      return Value::of_list(std::move(items));
    }
    if (f == "indent") {
      Value w = a.get(0, "width", Value::integer(4));
      const std::string pad = w.kind == Value::kString ? w.s : std::string(size_t(std::max<int64_t>(0, w.i)), ' ');
      const bool first = truthy(a.get(1, "first", Value::boolean(false)));
      const bool blank = truthy(a.get(2, "blank", Value::boolean(false)));
      const std::string s = to_str(v);
      std::string out;
      size_t p = 0;
      bool line0 = true;
      while (p <= s.size()) {
        const size_t q = s.find('\n', p);
        const std::string ln = s.substr(p, q == std::string::npos ? std::string::npos : q - p);
        if ((line0 ? first : true) && (blank || !ln.empty())) out += pad;
        out += ln;
        if (q == std::string::npos) break;
        out += '\n';
        p = q + 1;
        line0 = false;
      }
      return Value::string(out);
    }
    if (f == "wordcount") return Value::integer(int64_t(split(to_str(v), Value::undefined(), -1).size()));
    if (f == "round") {
      if (!v.is_number()) error(line, "round needs a number");
      Value prec = a.get(0, "precision", Value::integer(0));
      const double m = std::pow(10.0, double(prec.kind == Value::kInt ? prec.i : 0));
      return Value::real(std::nearbyint(v.as_double() * m) / m);
    }
    error(line, fmt::format("unknown filter '{}'", f));
  }

  const Template& t_;
  std::time_t now_;
  Scope globals_, root_;
  std::vector<std::shared_ptr<Dict>> namespaces_;  // made by namespace() in this render
  int64_t steps_ = 0;
  int macro_depth_ = 0;
};

}  // namespace
}  // namespace jinja

ChatTemplate ChatTemplate::parse(const std::string& source, const std::string& source_name) {
  auto t = std::make_shared<jinja::Template>();
  t->name = source_name;
  jinja::Lexer lex(source, source_name);
  jinja::Parser parser(lex.run(), source_name);
  t->body = parser.parse_all();
  return ChatTemplate(std::move(t));
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context, std::time_t now) const {
  jinja::Renderer r(*t_, now);
  return r.render(context);
}

nlohmann::ordered_json chat_template_context(const std::string& model_dir, nlohmann::ordered_json messages,
                                             nlohmann::ordered_json tools, bool add_generation_prompt,
                                             const nlohmann::ordered_json& kwargs) {
  NIBBLE_CHECK(messages.is_array(), "messages must be a list");
  NIBBLE_CHECK(kwargs.is_object(), "chat template kwargs must be an object");
  nlohmann::ordered_json ctx = {{"messages", std::move(messages)},
                                {"tools", std::move(tools)},
                                {"documents", nullptr},
                                {"add_generation_prompt", add_generation_prompt}};
  const std::filesystem::path cfg = std::filesystem::path(model_dir) / "tokenizer_config.json";
  if (std::filesystem::exists(cfg)) {
    std::ifstream in(cfg);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    NIBBLE_CHECK(!j.is_discarded(), "{}: not valid JSON", cfg.string());
    for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
      if (!j.contains(key)) continue;
      const auto& v = j[key];  // a string, or an AddedToken {"content": ...}
      if (v.is_string())
        ctx[key] = v.get<std::string>();
      else if (v.is_object() && v.contains("content") && v["content"].is_string())
        ctx[key] = v["content"].get<std::string>();
    }
  }
  for (auto& [k, v] : kwargs.items()) ctx[k] = v;
  return ctx;
}

std::string load_chat_template_source(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path cfg = fs::path(model_dir) / "tokenizer_config.json";
  if (fs::exists(cfg)) {
    std::ifstream in(cfg);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    NIBBLE_CHECK(!j.is_discarded(), "{}: not valid JSON", cfg.string());
    if (j.contains("chat_template")) {
      const auto& t = j["chat_template"];
      if (t.is_string()) return t.get<std::string>();
      if (t.is_array()) {  // [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        for (const auto& e : t)
          if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
            return e["template"].get<std::string>();
      }
      NIBBLE_CHECK(t.is_null(), "{}: chat_template is neither a string nor a list with a \"default\" entry",
                   cfg.string());
    }
  }
  const fs::path jinja_file = fs::path(model_dir) / "chat_template.jinja";
  if (fs::exists(jinja_file)) {
    std::ifstream in(jinja_file, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  throw Error(
      fmt::format("{}: the model has no chat template (no chat_template in tokenizer_config.json, no "
                  "chat_template.jinja)",
                  model_dir));
}

}  // namespace nibble
