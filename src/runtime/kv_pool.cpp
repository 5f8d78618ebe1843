#include "runtime/kv_pool.h"

#include <algorithm>
#include <atomic>

#include "runtime/kv_cache.h"

namespace nibble {

KvPool::KvPool(Backend& backend, int64_t n_layers, int64_t n_blocks, int64_t n_head_kv, int64_t head_dim,
               DType dtype, int block_size_log2, int64_t n_rows, int64_t blocks_per_row)
    : backend_(backend), n_blocks_(n_blocks), n_rows_(n_rows), blocks_per_row_(blocks_per_row), dtype_(dtype),
      block_size_log2_(block_size_log2) {
  static std::atomic<uint64_t> counter{0};
  id_ = ++counter;
  NIBBLE_CHECK(kv_dtype_supported(dtype), "KV pool: dtype {} is not supported (F16, F32 or F8_E4M3)",
               dtype_name(dtype));
  NIBBLE_CHECK(block_size_log2 >= 0 && block_size_log2 <= 10, "KV pool: block size 2^{} out of range",
               block_size_log2);
  NIBBLE_CHECK(n_blocks >= 2 && n_rows >= 1 && blocks_per_row >= 1, "KV pool: {} blocks, {} rows of {} blocks",
               n_blocks, n_rows, blocks_per_row);
  const size_t bytes = size_t(n_blocks << block_size_log2) * size_t(n_head_kv * head_dim) * dtype_size_bytes(dtype);
  // Zeroed (as vLLM's torch.zeros): all of it resident from the start, so the server's memory
  // does not creep up as the free list cycles through blocks never touched before (a load test's
  // leak check would see that as growth), and no block ever holds garbage.
  // fill_random with an empty range writes zeros; E4M3's zero is the byte 0.
  const DType fill = dtype == DType::F8_E4M3 ? DType::U8 : dtype;
  const int64_t elements = int64_t(bytes / dtype_size_bytes(dtype));
  for (int64_t i = 0; i < n_layers; ++i) {
    k_.emplace_back(backend, bytes);
    v_.emplace_back(backend, bytes);
    backend.fill_random(k_.back().data(), fill, elements, 0.f, 0.f, 0);
    backend.fill_random(v_.back().data(), fill, elements, 0.f, 0.f, 0);
  }
  host_table_.assign(size_t((n_rows + 1) * blocks_per_row), 0);
  table_ = Buffer(backend, host_table_.size() * sizeof(int32_t));
  backend_.copy_to_backend(table_.data(), host_table_.data(), host_table_.size() * sizeof(int32_t));
}

void KvPool::set_row(int64_t row, const std::vector<int32_t>& blocks) {
  NIBBLE_CHECK(row >= 0 && row < n_rows_, "KV pool: row {} of {}", row, n_rows_);
  NIBBLE_CHECK(int64_t(blocks.size()) <= blocks_per_row_, "KV pool: {} blocks for a row of {}", blocks.size(),
               blocks_per_row_);
  int32_t* entries = host_table_.data() + row * blocks_per_row_;
  int64_t first = -1, last = -1;
  for (size_t b = 0; b < blocks.size(); ++b) {
    NIBBLE_ASSERT(blocks[b] > 0 && blocks[b] < n_blocks_);
    if (entries[b] == blocks[b]) continue;
    entries[b] = blocks[b];
    if (first < 0) first = int64_t(b);
    last = int64_t(b);
  }
  if (first >= 0) dirty_.emplace_back(row * blocks_per_row_ + first, row * blocks_per_row_ + last + 1);
}

void KvPool::sync() {
  for (auto [begin, end] : dirty_)
    backend_.copy_to_backend(table_.data<int32_t>() + begin, host_table_.data() + begin,
                             size_t(end - begin) * sizeof(int32_t));
  dirty_.clear();
}

}  // namespace nibble
