// One layer of a paged key/value cache as the attention ops see it (vLLM's layout): K and V are
// pools of blocks of `block_size` positions, each position one row [n_head_kv, head_dim] of
// `dtype` (F16 by default, F32 for exact reference runs). Position p of the sequence lives in pool
// row block_table[p / block_size] · block_size + p % block_size, so a sequence's blocks can sit
// anywhere in the pool and blocks can be shared between sequences (prefix caching). block_table is
// in the backend's memory: a recorded decode step replays with whatever the table holds.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace nibble {

struct KvPages {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::F16;
  const int32_t* block_table = nullptr;
  int block_size_log2 = 4;  // block_size = 1 << block_size_log2: a shift and a mask per lookup
  // A step over several sequences (a server's batch): block_table holds one row of table_stride
  // entries per sequence and token t reads row seq_rows[t] (in the backend's memory, a step input
  // like the positions). Null: every token reads the one table at block_table.
  const int32_t* seq_rows = nullptr;
  int64_t table_stride = 0;

  int64_t block_size() const { return int64_t(1) << block_size_log2; }
};

// The pool row of sequence position p (host and device code).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t kv_pool_row(const int32_t* block_table, int block_size_log2, int64_t p) {
  return (int64_t(block_table[p >> block_size_log2]) << block_size_log2) | (p & ((int64_t(1) << block_size_log2) - 1));
}

// The block table token t reads (host and device code).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline const int32_t* kv_token_table(const int32_t* block_table, const int32_t* seq_rows, int64_t table_stride,
                                     int64_t t) {
  return seq_rows ? block_table + int64_t(seq_rows[t]) * table_stride : block_table;
}

}  // namespace nibble
