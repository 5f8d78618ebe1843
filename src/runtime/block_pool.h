// Which KV blocks hold what (vLLM v1's KV cache manager, host side): a pool of n_blocks blocks of
// block_size positions, each either free or held by one or more sequences (reference counts).
// Prefix caching: a block whose positions a sequence has filled is registered under the hash of
// its tokens chained with the hash of the blocks before it, so a later sequence whose prompt
// starts with the same tokens takes the block instead of computing it again. Freed blocks keep
// their contents and stay findable until they are reused: free blocks are handed out least
// recently freed first, blocks holding nothing cached before any that do.
//
// Block 0 is reserved (the padding rows of a recorded batch step write there) and never handed out.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace nibble {

class BlockPool {
 public:
  BlockPool(int64_t n_blocks, int64_t block_size, bool prefix_caching);

  int64_t block_size() const { return block_size_; }
  int64_t n_blocks() const { return n_blocks_ - 1; }  // usable ones (block 0 is reserved)
  int64_t n_free() const { return n_free_; }          // not held by any sequence (cached or not)
  int64_t n_used() const { return n_blocks() - n_free_; }
  bool prefix_caching() const { return prefix_caching_; }

  // The cached blocks that hold the longest prefix of `tokens` in whole blocks, at most
  // max_tokens tokens: each gets a reference. (The caller counts queries and hits: a lookup
  // whose sequence then cannot be admitted is undone and must not count.)
  std::vector<int32_t> take_cached_prefix(std::span<const int32_t> tokens, int64_t max_tokens);
  // Appends n fresh blocks to `blocks`; false (nothing taken) when fewer than n are free.
  bool allocate(int64_t n, std::vector<int32_t>& blocks);
  // Registers blocks[index] (whose positions now hold tokens[index·bs, (index+1)·bs) of its
  // sequence) for prefix caching; blocks before it must have been registered. A block of the
  // same content already registered stays the one found.
  void cache_full_block(std::span<const int32_t> blocks, int64_t index, std::span<const int32_t> tokens);
  // Drops a sequence's references (in reverse, so a sequence's tail is reused before its head).
  void release(std::span<const int32_t> blocks);

  // A second pool that follows this one's chain (the sliding-window layers' blocks, which a
  // sequence drops as its window moves on) finds and registers its blocks by this pool's hashes:
  // the registered hash of block b and of its parent (0: not registered)...
  uint64_t hash_of(int32_t b) const { return hash_[size_t(b)]; }
  uint64_t parent_hash_of(int32_t b) const { return parent_hash_[size_t(b)]; }
  // ...the block registered under `hash` with that parent and content, or -1; take_cached also
  // gives it a reference...
  int32_t find_cached(uint64_t hash, uint64_t parent, std::span<const int32_t> chunk) const;
  int32_t take_cached(uint64_t hash, uint64_t parent, std::span<const int32_t> chunk);
  // ...and registers held block b under them (a block of that hash already registered stays).
  void cache_block(int32_t b, uint64_t hash, uint64_t parent, std::span<const int32_t> chunk);


 private:
  uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens) const;
  void unlink(int32_t b);
  void push_back(int32_t b);
  void push_front(int32_t b);
  void evict(int32_t b);

  int64_t n_blocks_, block_size_;
  bool prefix_caching_;
  std::vector<int32_t> refs_;
  // The free list, doubly linked through prev_/next_ (index n_blocks_ is the sentinel).
  std::vector<int32_t> prev_, next_;
  int64_t n_free_ = 0;
  // Per block: its hash (0: not registered), its parent's hash and tokens (to confirm a match).
  std::vector<uint64_t> hash_, parent_hash_;
  std::vector<int32_t> tokens_;
  std::unordered_map<uint64_t, int32_t> cached_;
};

}  // namespace nibble
