#include "runtime/block_pool.h"

#include <algorithm>

#include "core/status.h"

namespace nibble {

BlockPool::BlockPool(int64_t n_blocks, int64_t block_size, bool prefix_caching)
    : n_blocks_(n_blocks), block_size_(block_size), prefix_caching_(prefix_caching) {
  NIBBLE_CHECK(n_blocks >= 2, "KV cache: {} blocks; at least 2 are needed", n_blocks);
  refs_.assign(size_t(n_blocks), 0);
  prev_.assign(size_t(n_blocks + 1), int32_t(n_blocks));
  next_.assign(size_t(n_blocks + 1), int32_t(n_blocks));
  hash_.assign(size_t(n_blocks), 0);
  parent_hash_.assign(size_t(n_blocks), 0);
  tokens_.assign(size_t(n_blocks * block_size), 0);
  refs_[0] = 1;  // reserved
  for (int32_t b = 1; b < n_blocks; ++b) push_back(b);
}

uint64_t BlockPool::chain_hash(uint64_t parent, std::span<const int32_t> tokens) const {
  // splitmix64 steps over the parent hash and each token; 0 is kept for "not registered".
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(parent ^ 0x6e6962626c65ull);
  for (int32_t t : tokens) h = mix(h ^ uint64_t(uint32_t(t)));
  return h ? h : 1;
}

void BlockPool::unlink(int32_t b) {
  next_[size_t(prev_[size_t(b)])] = next_[size_t(b)];
  prev_[size_t(next_[size_t(b)])] = prev_[size_t(b)];
  --n_free_;
}

void BlockPool::push_back(int32_t b) {
  const int32_t sentinel = int32_t(n_blocks_), last = prev_[size_t(sentinel)];
  prev_[size_t(b)] = last;
  next_[size_t(b)] = sentinel;
  next_[size_t(last)] = b;
  prev_[size_t(sentinel)] = b;
  ++n_free_;
}

void BlockPool::push_front(int32_t b) {
  const int32_t sentinel = int32_t(n_blocks_), first = next_[size_t(sentinel)];
  next_[size_t(b)] = first;
  prev_[size_t(b)] = sentinel;
  prev_[size_t(first)] = b;
  next_[size_t(sentinel)] = b;
  ++n_free_;
}

void BlockPool::evict(int32_t b) {
  if (!hash_[size_t(b)]) return;
  auto it = cached_.find(hash_[size_t(b)]);
  if (it != cached_.end() && it->second == b) cached_.erase(it);
  hash_[size_t(b)] = 0;
}

std::vector<int32_t> BlockPool::take_cached_prefix(std::span<const int32_t> tokens, int64_t max_tokens) {
  std::vector<int32_t> blocks;
  if (!prefix_caching_) return blocks;
  uint64_t parent = 0;
  const int64_t n = std::min<int64_t>(int64_t(tokens.size()), max_tokens) / block_size_;
  for (int64_t i = 0; i < n; ++i) {
    const auto chunk = tokens.subspan(size_t(i * block_size_), size_t(block_size_));
    const uint64_t h = chain_hash(parent, chunk);
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    const int32_t b = it->second;
    if (parent_hash_[size_t(b)] != parent ||
        !std::equal(chunk.begin(), chunk.end(), tokens_.begin() + b * block_size_))
      break;  // a hash collision: not the same content
    if (refs_[size_t(b)]++ == 0) unlink(b);
    blocks.push_back(b);
    parent = h;
  }
  return blocks;
}

bool BlockPool::allocate(int64_t n, std::vector<int32_t>& blocks) {
  if (n > n_free_) return false;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t b = next_[size_t(n_blocks_)];
    unlink(b);
    evict(b);
    refs_[size_t(b)] = 1;
    blocks.push_back(b);
  }
  return true;
}

void BlockPool::cache_full_block(std::span<const int32_t> blocks, int64_t index, std::span<const int32_t> tokens) {
  if (!prefix_caching_) return;
  const int32_t b = blocks[size_t(index)];
  if (hash_[size_t(b)]) return;  // already registered (a block taken from the cache)
  const uint64_t parent = index ? hash_[size_t(blocks[size_t(index - 1)])] : 0;
  NIBBLE_ASSERT(index == 0 || parent != 0);
  const auto chunk = tokens.subspan(size_t(index * block_size_), size_t(block_size_));
  const uint64_t h = chain_hash(parent, chunk);
  hash_[size_t(b)] = h;
  parent_hash_[size_t(b)] = parent;
  std::copy(chunk.begin(), chunk.end(), tokens_.begin() + b * block_size_);
  cached_.try_emplace(h, b);
}

int32_t BlockPool::find_cached(uint64_t hash, uint64_t parent, std::span<const int32_t> chunk) const {
  if (!prefix_caching_ || !hash) return -1;
  auto it = cached_.find(hash);
  if (it == cached_.end()) return -1;
  const int32_t b = it->second;
  if (parent_hash_[size_t(b)] != parent || !std::equal(chunk.begin(), chunk.end(), tokens_.begin() + b * block_size_))
    return -1;
  return b;
}

int32_t BlockPool::take_cached(uint64_t hash, uint64_t parent, std::span<const int32_t> chunk) {
  const int32_t b = find_cached(hash, parent, chunk);
  if (b >= 0 && refs_[size_t(b)]++ == 0) unlink(b);
  return b;
}

void BlockPool::cache_block(int32_t b, uint64_t hash, uint64_t parent, std::span<const int32_t> chunk) {
  if (!prefix_caching_ || hash_[size_t(b)]) return;
  NIBBLE_ASSERT(refs_[size_t(b)] > 0 && hash != 0 && int64_t(chunk.size()) == block_size_);
  hash_[size_t(b)] = hash;
  parent_hash_[size_t(b)] = parent;
  std::copy(chunk.begin(), chunk.end(), tokens_.begin() + b * block_size_);
  cached_.try_emplace(hash, b);
}

void BlockPool::release(std::span<const int32_t> blocks) {
  for (size_t i = blocks.size(); i-- > 0;) {
    const int32_t b = blocks[i];
    NIBBLE_ASSERT(b > 0 && refs_[size_t(b)] > 0);
    if (--refs_[size_t(b)] > 0) continue;
    // Blocks nobody can find again are reused first; cached ones in the order they were freed.
    if (hash_[size_t(b)] && cached_.count(hash_[size_t(b)]) && cached_[hash_[size_t(b)]] == b)
      push_back(b);
    else {
      evict(b);
      push_front(b);
    }
  }
}

}  // namespace nibble
