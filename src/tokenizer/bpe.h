// Internal to the tokenizer: the BPE model (vocab, merges, the merge loop) and the immutable state
// a Tokenizer shares between its copies. The model is keyed by raw bytes rather than by byte-level
// spellings, so pre-tokens never need to be converted to "Ġ"-style strings on the hot path.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tokenizer/pretokenize.h"

namespace nibble::tok {

class BpeModel {
 public:
  // `j` is the "model" object of file `source`; throws nibble::Error naming the field.
  static BpeModel from_json(const nlohmann::json& j, const std::string& source);

  // Appends the ids of one pre-token given as raw bytes (HF `BPE::tokenize`).
  void encode_word(std::string_view bytes, std::vector<int32_t>& out) const;
  // HF `token_to_id` on the model: a vocab entry by its byte-level spelling.
  std::optional<int32_t> id_of_spelling(std::string_view spelling) const;
  // The byte-level spelling of id, or nullptr if the vocab has no such id.
  const std::string* spelling(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(spellings_.size()) - 1; }

 private:
  struct MergeSlot {
    uint64_t key;  // (left << 32 | right) + 1, so that 0 marks an empty slot
    uint32_t rank;
    int32_t merged;
  };
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool removed;
  };

  const MergeSlot* find_merge(int32_t left, int32_t right) const;
  void insert_merge(int32_t left, int32_t right, uint32_t rank, int32_t merged);
  void initial_symbols_slow(std::string_view bytes, std::vector<Symbol>& symbols) const;
  void merge_all(std::vector<Symbol>& symbols) const;

  std::unordered_map<std::string, int32_t> by_bytes_;    // spellings inside the byte alphabet
  std::unordered_map<std::string, int32_t> unmappable_;  // any other spelling, as written
  std::vector<std::string> spellings_;                   // by id; "" where an id is unused
  std::vector<bool> has_id_;
  std::array<int32_t, 256> byte_ids_{};  // id of each single-byte token, -1 if absent
  bool fast_symbols_ = true;             // every byte has a token and no prefix/suffix is set
  std::vector<MergeSlot> merges_;        // open addressing, power-of-two size
  uint64_t merge_mask_ = 0;

  std::optional<std::string> continuing_subword_prefix_;
  std::optional<std::string> end_of_word_suffix_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
};

struct TokenizerImpl {
  std::string source;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  BpeModel model;
  std::unordered_map<std::string, int32_t> added_by_content;
  AddedTokenMatcher raw_matcher;         // added tokens with normalized=false
  AddedTokenMatcher normalized_matcher;  // added tokens with normalized=true
  // What decode() emits for each id (bytes, possibly partial UTF-8) and per-id flags.
  std::vector<std::string> id_bytes;
  enum : uint8_t { kKnown = 1, kSpecial = 2, kSkippedAsSpecial = 4 };
  std::vector<uint8_t> id_flags;

  bool emits(int32_t id, bool skip_special_tokens) const {
    if (id < 0 || static_cast<size_t>(id) >= id_flags.size()) return false;
    uint8_t f = id_flags[static_cast<size_t>(id)];
    return (f & kKnown) != 0 && !(skip_special_tokens && (f & kSkippedAsSpecial) != 0);
  }
};

}  // namespace nibble::tok
