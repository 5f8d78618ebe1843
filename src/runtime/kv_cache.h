// Key/value cache of one sequence: per layer, K and V pools of blocks (backend/kv_pages.h) in the
// backend's memory and the sequence's block table. The table is the identity unless a caller
// reorders it (tests do, to prove every attention path follows the table); the server's shared,
// prefix-caching block pool hands out the same KvPages views.
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

  KvCache(Backend& backend, int64_t n_layers, int64_t max_tokens, int64_t n_head_kv, int64_t head_dim,
          DType dtype = DType::F16, int block_size_log2 = kDefaultBlockSizeLog2)
      : backend_(&backend), id_(next_id()), max_tokens_(max_tokens), row_(n_head_kv * head_dim), dtype_(dtype),
        block_size_log2_(block_size_log2) {
    NIBBLE_CHECK(kv_dtype_supported(dtype), "KV cache: dtype {} is not supported (F16, F32 or F8_E4M3)", dtype_name(dtype));
    NIBBLE_CHECK(block_size_log2 >= 0 && block_size_log2 <= 10, "KV cache: block size 2^{} out of range",
                 block_size_log2);
    const int64_t block = int64_t(1) << block_size_log2;
    n_blocks_ = std::max<int64_t>(1, (max_tokens + block - 1) / block);
    const size_t bytes = size_t(n_blocks_ * block * row_) * dtype_size_bytes(dtype);
    for (int64_t i = 0; i < n_layers; ++i) {
      k_.emplace_back(backend, bytes);
      v_.emplace_back(backend, bytes);
    }
    std::vector<int32_t> identity(static_cast<size_t>(n_blocks_));
    for (int64_t b = 0; b < n_blocks_; ++b) identity[size_t(b)] = int32_t(b);
    table_ = Buffer(backend, identity.size() * sizeof(int32_t));
    set_block_table(identity);
  }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t n_blocks() const { return n_blocks_; }
  DType dtype() const { return dtype_; }
  KvPages layer(int64_t i) const {
    return {k_[size_t(i)].data(), v_[size_t(i)].data(), dtype_, table_.data<int32_t>(), block_size_log2_};
  }
  int64_t row_elements() const { return row_; }  // n_head_kv * head_dim
  // Logical block b of the sequence -> pool block table[b]: a permutation of 0..n_blocks-1.
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
  int64_t max_tokens_, row_, n_blocks_ = 0;
  DType dtype_;
  int block_size_log2_;
  std::vector<Buffer> k_, v_;
  Buffer table_;
};

}  // namespace nibble
