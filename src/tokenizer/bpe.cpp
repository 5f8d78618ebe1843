// The BPE model: loading vocab and merges from tokenizer.json, and the merge loop. The loop is a
// transcription of HF `Word::merge_all` (lowest rank first, leftmost on ties, stale queue entries
// checked by merged id only), because vocabularies such as o200k reach one token through several
// merges and any other bookkeeping gives different ids on some inputs.
#include "tokenizer/bpe.h"

#include <nlohmann/json.hpp>
#include <queue>

#include "core/status.h"

namespace nibble::tok {

namespace {

using nlohmann::json;

// Larger ids would make the per-id tables absurdly big; real vocabularies stay far below.
constexpr int64_t kMaxTokenId = (int64_t{1} << 26) - 1;

std::optional<std::string> optional_string(const json& j, const char* key,
                                           const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  NIBBLE_CHECK(j[key].is_string(), "{}: expected a string or null (field model.{})", source, key);
  return j[key].get<std::string>();
}

bool optional_bool(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return false;
  NIBBLE_CHECK(j[key].is_boolean(), "{}: expected a boolean (field model.{})", source, key);
  return j[key].get<bool>();
}

uint64_t merge_key(int32_t left, int32_t right) {
  return ((static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
          static_cast<uint32_t>(right)) + 1;
}

size_t merge_hash(uint64_t key) {
  key *= 0x9E3779B97F4A7C15ull;
  return static_cast<size_t>(key ^ (key >> 31));
}

}  // namespace

BpeModel BpeModel::from_json(const json& j, const std::string& source) {
  NIBBLE_CHECK(j.is_object(), "{}: expected an object (field model)", source);
  if (j.contains("type")) {
    NIBBLE_CHECK(j["type"].is_string(), "{}: expected a string (field model.type)", source);
    std::string type = j["type"].get<std::string>();
    NIBBLE_CHECK(type == "BPE", "{}: unsupported model type '{}', only BPE is (field model.type)",
                 source, type);
  }
  NIBBLE_CHECK(j.contains("vocab") && j["vocab"].is_object(),
               "{}: expected an object mapping tokens to ids (field model.vocab)", source);
  NIBBLE_CHECK(j.contains("merges") && j["merges"].is_array(),
               "{}: expected an array (field model.merges)", source);

  BpeModel m;
  const json& vocab = j["vocab"];
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    NIBBLE_CHECK(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 &&
                     it.value().get<int64_t>() <= kMaxTokenId,
                 "{}: token '{}' has an invalid id (field model.vocab)", source, it.key());
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  m.spellings_.resize(static_cast<size_t>(max_id + 1));
  m.has_id_.assign(static_cast<size_t>(max_id + 1), false);
  m.by_bytes_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    auto id = it.value().get<int32_t>();
    m.spellings_[static_cast<size_t>(id)] = it.key();
    m.has_id_[static_cast<size_t>(id)] = true;
    if (auto bytes = byte_level_to_bytes(it.key())) {
      m.by_bytes_[std::move(*bytes)] = id;
    } else {
      m.unmappable_[it.key()] = id;
    }
  }

  m.continuing_subword_prefix_ = optional_string(j, "continuing_subword_prefix", source);
  m.end_of_word_suffix_ = optional_string(j, "end_of_word_suffix", source);
  if (auto unk = optional_string(j, "unk_token", source)) {
    // HF only fails once an unknown character shows up; without the token we drop it, which is
    // what HF does when no unk_token is set at all.
    m.unk_id_ = m.id_of_spelling(*unk);
  }
  m.fuse_unk_ = optional_bool(j, "fuse_unk", source);
  m.byte_fallback_ = optional_bool(j, "byte_fallback", source);
  m.ignore_merges_ = optional_bool(j, "ignore_merges", source);
  // Dropout only randomizes training-time segmentations; inference always runs without it.

  m.fast_symbols_ = (!m.continuing_subword_prefix_ || m.continuing_subword_prefix_->empty()) &&
                    (!m.end_of_word_suffix_ || m.end_of_word_suffix_->empty());
  for (int b = 0; b < 256; ++b) {
    auto it = m.by_bytes_.find(std::string(1, static_cast<char>(b)));
    m.byte_ids_[static_cast<size_t>(b)] = it == m.by_bytes_.end() ? -1 : it->second;
    if (it == m.by_bytes_.end()) m.fast_symbols_ = false;
  }

  const json& merges = j["merges"];
  size_t capacity = 16;
  while (capacity < merges.size() * 2) capacity *= 2;
  m.merges_.assign(capacity, MergeSlot{0, 0, 0});
  m.merge_mask_ = capacity - 1;
  size_t prefix_len = m.continuing_subword_prefix_ ? m.continuing_subword_prefix_->size() : 0;
  uint32_t rank = 0;
  for (size_t i = 0; i < merges.size(); ++i) {
    const json& entry = merges[i];
    std::string left, right;
    if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else if (entry.is_string()) {
      // The older "a b" form of merges.txt, version header included.
      std::string line = entry.get<std::string>();
      if (line.rfind("#version", 0) == 0) continue;
      size_t space = line.find(' ');
      NIBBLE_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos,
                   "{}: merge '{}' is not two tokens separated by one space (field "
                   "model.merges[{}])",
                   source, line, i);
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else {
      fail("{}: expected [\"a\", \"b\"] or \"a b\" (field model.merges[{}])", source, i);
    }
    auto left_id = m.id_of_spelling(left);
    auto right_id = m.id_of_spelling(right);
    NIBBLE_CHECK(left_id && right_id && right.size() >= prefix_len,
                 "{}: merge '{}' '{}' uses a token missing from the vocab (field model.merges[{}])",
                 source, left, right, i);
    std::string merged_spelling = left + right.substr(prefix_len);
    auto merged_id = m.id_of_spelling(merged_spelling);
    NIBBLE_CHECK(merged_id.has_value(),
                 "{}: merge '{}' '{}' makes '{}', which is missing from the vocab (field "
                 "model.merges[{}])",
                 source, left, right, merged_spelling, i);
    m.insert_merge(*left_id, *right_id, rank++, *merged_id);
  }
  return m;
}

void BpeModel::insert_merge(int32_t left, int32_t right, uint32_t rank, int32_t merged) {
  uint64_t key = merge_key(left, right);
  size_t slot = merge_hash(key) & merge_mask_;
  while (merges_[slot].key != 0 && merges_[slot].key != key) slot = (slot + 1) & merge_mask_;
  // A repeated pair overwrites the earlier one, as collecting into HF's HashMap does.
  merges_[slot] = MergeSlot{key, rank, merged};
}

const BpeModel::MergeSlot* BpeModel::find_merge(int32_t left, int32_t right) const {
  uint64_t key = merge_key(left, right);
  size_t slot = merge_hash(key) & merge_mask_;
  while (true) {
    const MergeSlot& s = merges_[slot];
    if (s.key == key) return &s;
    if (s.key == 0) return nullptr;
    slot = (slot + 1) & merge_mask_;
  }
}

std::optional<int32_t> BpeModel::id_of_spelling(std::string_view spelling) const {
  if (auto bytes = byte_level_to_bytes(spelling)) {
    auto it = by_bytes_.find(*bytes);
    if (it != by_bytes_.end()) return it->second;
    return std::nullopt;
  }
  auto it = unmappable_.find(std::string(spelling));
  if (it != unmappable_.end()) return it->second;
  return std::nullopt;
}

const std::string* BpeModel::spelling(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= spellings_.size() || !has_id_[static_cast<size_t>(id)])
    return nullptr;
  return &spellings_[static_cast<size_t>(id)];
}

// HF `BPE::merge_word` before the merges: one symbol per byte-level character, with the
// subword prefix/suffix, byte fallback and unk rules.
void BpeModel::initial_symbols_slow(std::string_view bytes, std::vector<Symbol>& symbols) const {
  auto add = [&symbols](int32_t id) {
    auto prev = static_cast<int32_t>(symbols.size()) - 1;
    if (prev >= 0) symbols.back().next = prev + 1;
    symbols.push_back({id, prev, -1, false});
  };
  int32_t pending_unk = -1;  // an unk token not added yet, so that runs of unknowns can fuse
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string s;
    utf8_append(s, byte_to_char(static_cast<uint8_t>(bytes[i])));
    if (i > 0 && continuing_subword_prefix_) s = *continuing_subword_prefix_ + s;
    if (i + 1 == bytes.size() && end_of_word_suffix_) s += *end_of_word_suffix_;
    if (auto id = id_of_spelling(s)) {
      if (pending_unk >= 0) add(pending_unk);
      pending_unk = -1;
      add(*id);
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> fallback;
      for (unsigned char c : s) {
        auto id = id_of_spelling(fmt::format("<0x{:02X}>", c));
        if (!id) break;
        fallback.push_back(*id);
      }
      if (fallback.size() == s.size()) {
        for (int32_t id : fallback) add(id);  // HF leaves a pending unk pending here
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk >= 0 && !fuse_unk_) add(pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk >= 0) add(pending_unk);
}

void BpeModel::merge_all(std::vector<Symbol>& symbols) const {
  struct Entry {
    uint32_t rank;
    int32_t pos;
    int32_t merged;
  };
  // priority_queue pops the "largest": make that the lowest rank, then the leftmost position.
  auto lower_priority = [](const Entry& a, const Entry& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::vector<Entry> storage;
  storage.reserve(symbols.size() * 2);
  std::priority_queue<Entry, std::vector<Entry>, decltype(lower_priority)> queue(
      lower_priority, std::move(storage));
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeSlot* m = find_merge(symbols[i].id, symbols[i + 1].id))
      queue.push({m->rank, static_cast<int32_t>(i), m->merged});
  }
  while (!queue.empty()) {
    Entry top = queue.top();
    queue.pop();
    Symbol& current = symbols[static_cast<size_t>(top.pos)];
    if (current.removed || current.next < 0) continue;
    Symbol right = symbols[static_cast<size_t>(current.next)];
    const MergeSlot* m = find_merge(current.id, right.id);
    if (m == nullptr || m->merged != top.merged) continue;  // stale entry
    symbols[static_cast<size_t>(current.next)].removed = true;
    current.id = top.merged;
    current.next = right.next;
    if (right.next >= 0) symbols[static_cast<size_t>(right.next)].prev = top.pos;
    if (current.prev >= 0) {
      if (const MergeSlot* p = find_merge(symbols[static_cast<size_t>(current.prev)].id, current.id))
        queue.push({p->rank, current.prev, p->merged});
    }
    if (current.next >= 0) {
      if (const MergeSlot* n = find_merge(current.id, symbols[static_cast<size_t>(current.next)].id))
        queue.push({n->rank, top.pos, n->merged});
    }
  }
}

void BpeModel::encode_word(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.empty()) return;
  if (ignore_merges_) {
    auto it = by_bytes_.find(std::string(bytes));
    if (it != by_bytes_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> symbols;
  symbols.reserve(bytes.size());
  if (fast_symbols_) {
    auto n = static_cast<int32_t>(bytes.size());
    for (int32_t i = 0; i < n; ++i)
      symbols.push_back(
          {byte_ids_[static_cast<uint8_t>(bytes[static_cast<size_t>(i)])], i - 1,
           i + 1 < n ? i + 1 : -1, false});
  } else {
    initial_symbols_slow(bytes, symbols);
  }
  if (symbols.size() > 1) merge_all(symbols);
  for (const Symbol& s : symbols)
    if (!s.removed) out.push_back(s.id);
}

}  // namespace nibble::tok
