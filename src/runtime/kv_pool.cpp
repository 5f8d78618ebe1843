#include "runtime/kv_pool.h"

#include <algorithm>
#include <atomic>

#include "runtime/kv_cache.h"

namespace nibble {

KvPool::KvPool(Backend& backend, int64_t n_layers, int64_t n_blocks, int64_t n_head_kv, int64_t head_dim,
               DType dtype, int block_size_log2, int64_t n_rows, int64_t blocks_per_row, std::vector<bool> sliding,
               int64_t n_sliding_blocks)
    : backend_(backend), n_blocks_(n_blocks), n_sliding_blocks_(sliding.empty() ? 0 : n_sliding_blocks),
      n_rows_(n_rows), blocks_per_row_(blocks_per_row), dtype_(dtype), block_size_log2_(block_size_log2),
      sliding_(n_sliding_blocks > 0 ? std::move(sliding) : std::vector<bool>{}) {
  static std::atomic<uint64_t> counter{0};
  id_ = ++counter;
  NIBBLE_CHECK(kv_dtype_supported(dtype), "KV pool: dtype {} is not supported (F16, F32 or F8_E4M3)",
               dtype_name(dtype));
  NIBBLE_CHECK(block_size_log2 >= 0 && block_size_log2 <= 10, "KV pool: block size 2^{} out of range",
               block_size_log2);
  NIBBLE_CHECK(n_blocks >= 2 && n_rows >= 1 && blocks_per_row >= 1, "KV pool: {} blocks, {} rows of {} blocks",
               n_blocks, n_rows, blocks_per_row);
  NIBBLE_CHECK(sliding_.empty() || (int64_t(sliding_.size()) == n_layers && n_sliding_blocks_ >= 2),
               "KV pool: sliding flags for {} of {} layers, {} sliding blocks", sliding_.size(), n_layers,
               n_sliding_blocks_);
  // Zeroed (as vLLM's torch.zeros): all of it resident from the start, so the server's memory
  // does not creep up as the free list cycles through blocks never touched before (a load test's
  // leak check would see that as growth), and no block ever holds garbage.
  // fill_random with an empty range writes zeros; E4M3's zero is the byte 0.
  const DType fill = dtype == DType::F8_E4M3 ? DType::U8 : dtype;
  for (int64_t i = 0; i < n_layers; ++i) {
    const int64_t blocks = !sliding_.empty() && sliding_[size_t(i)] ? n_sliding_blocks_ : n_blocks;
    const int64_t elements = (blocks << block_size_log2) * n_head_kv * head_dim;
    const size_t bytes = size_t(elements) * dtype_size_bytes(dtype);
    k_.emplace_back(backend, bytes);
    v_.emplace_back(backend, bytes);
    backend.fill_random(k_.back().data(), fill, elements, 0.f, 0.f, 0);
    backend.fill_random(v_.back().data(), fill, elements, 0.f, 0.f, 0);
  }
  for (Table* t : {&table_, &sliding_table_}) {
    if (t == &sliding_table_ && sliding_.empty()) break;
    t->host.assign(size_t((n_rows + 1) * blocks_per_row), 0);
    t->device = Buffer(backend, t->host.size() * sizeof(int32_t));
    backend_.copy_to_backend(t->device.data(), t->host.data(), t->host.size() * sizeof(int32_t));
  }
}

void KvPool::set_table_row(Table& table, int64_t row, const std::vector<int32_t>& blocks, int64_t n_blocks,
                           bool zeros) {
  NIBBLE_CHECK(row >= 0 && row < n_rows_, "KV pool: row {} of {}", row, n_rows_);
  NIBBLE_CHECK(int64_t(blocks.size()) <= blocks_per_row_, "KV pool: {} blocks for a row of {}", blocks.size(),
               blocks_per_row_);
  int32_t* entries = table.host.data() + row * blocks_per_row_;
  int64_t first = -1, last = -1;
  for (size_t b = 0; b < blocks.size(); ++b) {
    NIBBLE_ASSERT((blocks[b] > 0 || (zeros && blocks[b] == 0)) && blocks[b] < n_blocks);
    if (entries[b] == blocks[b]) continue;
    entries[b] = blocks[b];
    if (first < 0) first = int64_t(b);
    last = int64_t(b);
  }
  if (first >= 0) table.dirty.emplace_back(row * blocks_per_row_ + first, row * blocks_per_row_ + last + 1);
}

void KvPool::set_row(int64_t row, const std::vector<int32_t>& blocks) {
  set_table_row(table_, row, blocks, n_blocks_, false);
}

void KvPool::set_sliding_row(int64_t row, const std::vector<int32_t>& blocks) {
  NIBBLE_ASSERT(!sliding_.empty());
  set_table_row(sliding_table_, row, blocks, n_sliding_blocks_, true);
}

void KvPool::sync() {
  for (Table* t : {&table_, &sliding_table_}) {
    for (auto [begin, end] : t->dirty)
      backend_.copy_to_backend(t->device.data<int32_t>() + begin, t->host.data() + begin,
                               size_t(end - begin) * sizeof(int32_t));
    t->dirty.clear();
  }
}

}  // namespace nibble
