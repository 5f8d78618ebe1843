// The KV memory a server shares among its sequences (vLLM's paged KV cache): per layer, K and V
// pools of n_blocks blocks in the backend's memory, and a block table with one row per running
// sequence (row r = the pool blocks holding that sequence's positions, in order). Which blocks a
// sequence gets is runtime/block_pool's business; this class holds the memory and keeps the
// device's copy of the table in step with the host's, uploading only the entries that changed.
//
// Block 0 is never handed out (BlockPool reserves it) and the last table row is all zeros: the
// padding tokens of a recorded batch step write their K/V there and nowhere else.
//
// Sliding-window layers (gpt-oss's) can have a pool of their own, n_sliding_blocks long, with its
// own table: a sequence holds there only the blocks its window still reaches (the engine drops
// the others, their entries become 0), so a long context costs them a window, not its length.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/kv_pages.h"
#include "core/status.h"

namespace nibble {

class KvPool {
 public:
  // sliding[i]: layer i keeps its K/V in the sliding pool (empty, or n_sliding_blocks 0: no
  // layer does).
  KvPool(Backend& backend, int64_t n_layers, int64_t n_blocks, int64_t n_head_kv, int64_t head_dim, DType dtype,
         int block_size_log2, int64_t n_rows, int64_t blocks_per_row, std::vector<bool> sliding = {},
         int64_t n_sliding_blocks = 0);
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  int64_t n_blocks() const { return n_blocks_; }
  int64_t n_sliding_blocks() const { return n_sliding_blocks_; }  // 0: no sliding pool
  int64_t block_size() const { return int64_t(1) << block_size_log2_; }
  int block_size_log2() const { return block_size_log2_; }
  int64_t n_rows() const { return n_rows_; }              // sequence rows (the padding row is extra)
  int64_t padding_row() const { return n_rows_; }
  int64_t blocks_per_row() const { return blocks_per_row_; }
  int64_t max_tokens_per_row() const { return blocks_per_row_ << block_size_log2_; }
  DType dtype() const { return dtype_; }
  // Unique for the process's life (part of the keys of the steps recorded over this pool).
  uint64_t id() const { return id_; }
  static int64_t bytes_per_block(int64_t n_layers, int64_t n_head_kv, int64_t head_dim, DType dtype,
                                 int block_size_log2) {
    return 2 * n_layers * (int64_t(1) << block_size_log2) * n_head_kv * head_dim * int64_t(dtype_size_bytes(dtype));
  }

  // Layer i's pages for a step whose token t uses table row seq_rows[t] (device memory).
  KvPages layer(int64_t i, const int32_t* seq_rows) const {
    return {k_[size_t(i)].data(), v_[size_t(i)].data(), dtype_, table_of(i).data<int32_t>(), block_size_log2_,
            seq_rows, blocks_per_row_};
  }
  // Layer i's pages for one sequence in row `row` (no per-token rows).
  KvPages row_layer(int64_t i, int64_t row) const {
    return {k_[size_t(i)].data(), v_[size_t(i)].data(), dtype_, table_of(i).data<int32_t>() + row * blocks_per_row_,
            block_size_log2_};
  }
  // Row r of the table := blocks (at most blocks_per_row); entries past them keep old values
  // (never read: a sequence attends only to its own positions). Uploaded by sync().
  void set_row(int64_t row, const std::vector<int32_t>& blocks);
  // The same for the sliding pool's table; 0 entries are blocks the window has left.
  void set_sliding_row(int64_t row, const std::vector<int32_t>& blocks);
  // Copies the changed entries of the table to the backend (before a step).
  void sync();

 private:
  // A block table, its host copy and the [begin, end) entry ranges to upload.
  struct Table {
    Buffer device;
    std::vector<int32_t> host;
    std::vector<std::pair<int64_t, int64_t>> dirty;
  };
  const Buffer& table_of(int64_t layer) const {
    return !sliding_.empty() && sliding_[size_t(layer)] ? sliding_table_.device : table_.device;
  }
  void set_table_row(Table& table, int64_t row, const std::vector<int32_t>& blocks, int64_t n_blocks, bool zeros);

  Backend& backend_;
  uint64_t id_;
  int64_t n_blocks_, n_sliding_blocks_, n_rows_, blocks_per_row_;
  DType dtype_;
  int block_size_log2_;
  std::vector<bool> sliding_;
  std::vector<Buffer> k_, v_;
  Table table_, sliding_table_;
};

}  // namespace nibble
