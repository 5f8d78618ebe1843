// Key/value cache of one sequence: per layer, K and V pools of blocks (backend/kv_pages.h) in the
// backend's memory and the sequence's block table. The table is the identity unless a caller
// reorders it (tests do, to prove every attention path follows the table); the server's shared,
// prefix-caching block pool hands out the same KvPages views.
//
// Sliding-window layers (gpt-oss's) keep only a ring of blocks when the context is longer than the
// ring: logical block b of such a layer is ring block b mod ring_blocks (a table of its own), so
// memory per token is that of the full-attention layers only. A forward of T tokens needs the
// window's older positions and its T new ones at once, so the ring holds window + max_chunk()
// positions and Model::forward splits longer inputs into chunks of max_chunk().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/kv_pages.h"
#include "core/status.h"

namespace nibble {

// KV element types a cache can hold: F16 (the default, as llama.cpp's) or F32 (exact, for the
// reference comparisons against transformers).
inline bool kv_dtype_supported(DType t) { return t == DType::F16 || t == DType::F32 || t == DType::F8_E4M3; }

class KvCache {
 public:
  static constexpr int kDefaultBlockSizeLog2 = 4;  // 16 positions, vLLM's default block size

  // Longest forward a ring cache takes in one piece by default (bench's pp2048 in one).
  static constexpr int64_t kDefaultRingChunk = 2048;

  // windows: per layer, 0 for full attention or the sliding window (empty: all full). A layer
  // with a window gets a ring when that saves memory: window + ring_chunk positions fewer than
  // the context's.
  KvCache(Backend& backend, int64_t n_layers, int64_t max_tokens, int64_t n_head_kv, int64_t head_dim,
          DType dtype = DType::F16, int block_size_log2 = kDefaultBlockSizeLog2, std::vector<int64_t> windows = {},
          int64_t ring_chunk = kDefaultRingChunk)
      : backend_(&backend), id_(next_id()), max_tokens_(max_tokens), row_(n_head_kv * head_dim), dtype_(dtype),
        block_size_log2_(block_size_log2) {
    NIBBLE_CHECK(kv_dtype_supported(dtype), "KV cache: dtype {} is not supported (F16, F32 or F8_E4M3)", dtype_name(dtype));
    NIBBLE_CHECK(block_size_log2 >= 0 && block_size_log2 <= 10, "KV cache: block size 2^{} out of range",
                 block_size_log2);
    NIBBLE_CHECK(ring_chunk >= 1, "KV cache: ring chunk {} must be positive", ring_chunk);
    const int64_t block = int64_t(1) << block_size_log2;
    n_blocks_ = std::max<int64_t>(1, (max_tokens + block - 1) / block);
    // Positions window - 1 before a chunk's first through its last span at most this many blocks.
    const int64_t window = windows.empty() ? 0 : *std::max_element(windows.begin(), windows.end());
    if (window > 0) {
      const int64_t ring = (window + ring_chunk - 1 + block - 1) / block + 1;
      if (ring < n_blocks_) ring_blocks_ = ring, max_chunk_ = (ring - 1) * block - window + 1;
    }
    const size_t bytes = size_t(n_blocks_ * block * row_) * dtype_size_bytes(dtype);
    const size_t ring_bytes = size_t(ring_blocks_ * block * row_) * dtype_size_bytes(dtype);
    for (int64_t i = 0; i < n_layers; ++i) {
      const bool ring = ring_blocks_ > 0 && windows[size_t(i)] > 0;
      ring_.push_back(ring);
      k_.emplace_back(backend, ring ? ring_bytes : bytes);
      v_.emplace_back(backend, ring ? ring_bytes : bytes);
    }
    std::vector<int32_t> identity(static_cast<size_t>(n_blocks_));
    for (int64_t b = 0; b < n_blocks_; ++b) identity[size_t(b)] = int32_t(b);
    table_ = Buffer(backend, identity.size() * sizeof(int32_t));
    set_block_table(identity);
    if (ring_blocks_ > 0) {
      std::vector<int32_t> ring(static_cast<size_t>(n_blocks_));
      for (int64_t b = 0; b < n_blocks_; ++b) ring[size_t(b)] = int32_t(b % ring_blocks_);
      ring_table_ = Buffer(backend, ring.size() * sizeof(int32_t));
      backend.copy_to_backend(ring_table_.data(), ring.data(), ring.size() * sizeof(int32_t));
    }
  }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t n_blocks() const { return n_blocks_; }
  DType dtype() const { return dtype_; }
  KvPages layer(int64_t i) const {
    const Buffer& table = ring_[size_t(i)] ? ring_table_ : table_;
    return {k_[size_t(i)].data(), v_[size_t(i)].data(), dtype_, table.data<int32_t>(), block_size_log2_};
  }
  // Ring blocks of the sliding-window layers (0: they keep every position), and the longest
  // forward the cache takes in one piece (any, without a ring).
  int64_t ring_blocks() const { return ring_blocks_; }
  int64_t max_chunk() const { return ring_blocks_ > 0 ? max_chunk_ : max_tokens_; }
  // Bytes of K and V held, all layers.
  size_t bytes() const {
    size_t total = 0;
    for (size_t i = 0; i < k_.size(); ++i) total += k_[i].bytes() + v_[i].bytes();
    return total;
  }
  int64_t row_elements() const { return row_; }  // n_head_kv * head_dim
  // Logical block b of the sequence -> pool block table[b]: a permutation of 0..n_blocks-1 (the
  // full-attention layers').
  void set_block_table(const std::vector<int32_t>& table) {
    NIBBLE_CHECK(int64_t(table.size()) == n_blocks_, "KV cache: block table of {} entries for {} blocks",
                 table.size(), n_blocks_);
    std::vector<bool> seen(table.size());
    for (int32_t b : table) {
      NIBBLE_CHECK(b >= 0 && b < n_blocks_ && !seen[size_t(b)], "KV cache: block table is not a permutation");
      seen[size_t(b)] = true;
    }
    backend_->copy_to_backend(table_.data(), table.data(), table.size() * sizeof(int32_t));
  }
  // Unique for the process's life (graphs recorded for one cache are never replayed on another
  // that happens to reuse its address).
  uint64_t id() const { return id_; }

 private:
  static uint64_t next_id() {
    static std::atomic<uint64_t> counter{0};
    return ++counter;
  }
  Backend* backend_;
  uint64_t id_;
  int64_t max_tokens_, row_, n_blocks_ = 0, ring_blocks_ = 0, max_chunk_ = 0;
  DType dtype_;
  int block_size_log2_;
  std::vector<Buffer> k_, v_;
  std::vector<bool> ring_;
  Buffer table_, ring_table_;
};

}  // namespace nibble
