// BlockPool: reference counts, the free list's order, and prefix caching by chained block hashes
// (a hit needs the same tokens in every block before it too).
#include <gtest/gtest.h>

#include <numeric>

#include "core/status.h"
#include "runtime/block_pool.h"

namespace nibble {
namespace {

std::vector<int32_t> range(int32_t from, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

// A sequence's blocks filled with `tokens` and registered block by block, as the engine does.
std::vector<int32_t> fill(BlockPool& pool, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> blocks = pool.take_cached_prefix(tokens, int64_t(tokens.size()) - 1);
  const int64_t n = (int64_t(tokens.size()) + pool.block_size() - 1) / pool.block_size();
  EXPECT_TRUE(pool.allocate(n - int64_t(blocks.size()), blocks));
  for (int64_t b = 0; b < int64_t(tokens.size()) / pool.block_size(); ++b) pool.cache_full_block(blocks, b, tokens);
  return blocks;
}

TEST(BlockPool, AllocatesAndFreesEveryBlockButTheReservedOne) {
  BlockPool pool(9, 4, true);
  EXPECT_EQ(pool.n_blocks(), 8);
  std::vector<int32_t> a;
  ASSERT_TRUE(pool.allocate(8, a));
  EXPECT_EQ(std::count(a.begin(), a.end(), 0), 0) << "block 0 is reserved";
  std::vector<int32_t> b;
  EXPECT_FALSE(pool.allocate(1, b));
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(pool.n_used(), 8);
  pool.release(a);
  EXPECT_EQ(pool.n_free(), 8);
  EXPECT_TRUE(pool.allocate(8, b));
}

TEST(BlockPool, FindsWholeBlocksOfASharedPrefix) {
  BlockPool pool(32, 4, true);
  const auto doc = range(100, 14);  // 3 full blocks and 2 tokens
  auto first = fill(pool, doc);
  // Another prompt with the same first 9 tokens: two whole blocks match.
  auto other = range(100, 9);
  other.push_back(7);
  other.push_back(8);
  auto hit = pool.take_cached_prefix(other, int64_t(other.size()) - 1);
  ASSERT_EQ(hit.size(), 2u);
  EXPECT_EQ(hit[0], first[0]);
  EXPECT_EQ(hit[1], first[1]);
  EXPECT_EQ(int64_t(hit.size()) * pool.block_size(), 8);
  // Shared blocks are held twice: freeing one holder keeps them in use.
  pool.release(first);
  EXPECT_EQ(pool.n_used(), 2);
  pool.release(hit);
  EXPECT_EQ(pool.n_used(), 0);
  // Freed but not reused: still found, at most max_tokens of them.
  EXPECT_EQ(pool.take_cached_prefix(doc, 13).size(), 3u);
}

TEST(BlockPool, AMatchNeedsTheSameBlocksBeforeIt) {
  BlockPool pool(32, 4, true);
  auto a = range(0, 8);
  fill(pool, a);
  // Block 2 of b equals block 2 of a, block 1 does not: nothing after the mismatch is taken.
  auto b = a;
  b[1] = 99;
  EXPECT_TRUE(pool.take_cached_prefix(b, 8).empty());
  BlockPool off(32, 4, false);
  fill(off, a);
  EXPECT_TRUE(off.take_cached_prefix(a, 8).empty()) << "prefix caching off";
}

TEST(BlockPool, ReusesUncachedBlocksFirstThenTheLeastRecentlyFreed) {
  BlockPool pool(7, 4, true);  // 6 usable
  auto old_doc = range(0, 8), new_doc = range(50, 8);
  auto old_blocks = fill(pool, old_doc);
  auto new_blocks = fill(pool, new_doc);
  std::vector<int32_t> scratch;
  ASSERT_TRUE(pool.allocate(2, scratch));
  pool.release(old_blocks);
  pool.release(new_blocks);
  pool.release(scratch);  // holds nothing cached: handed out first
  std::vector<int32_t> taken;
  ASSERT_TRUE(pool.allocate(4, taken));  // the 2 uncached, then old_doc's 2
  EXPECT_TRUE(pool.take_cached_prefix(old_doc, 8).empty()) << "the least recently freed prefix is evicted";
  EXPECT_EQ(pool.take_cached_prefix(new_doc, 8).size(), 2u) << "the more recent one is kept";
}

}  // namespace
}  // namespace nibble
