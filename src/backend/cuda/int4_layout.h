// Conversion of nibble's row-major INT4 (the CPU layout) into the warp-interleaved layout the
// CUDA decode kernels read (documented in kernels/gemv.cuh). Host code, run once at upload.
#pragma once

#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace nibble::cuda {

// Whether a [n, k] INT4 weight with this group size can use the interleaved layout: K in chunks of
// 256, and groups a power of two of at least 32 or one group per row.
inline bool int4_interleavable(int64_t k, int64_t group_size) {
  return k % 256 == 0 && (group_size >= k || (group_size >= 32 && (group_size & (group_size - 1)) == 0));
}

inline int64_t int4_group_shift(int64_t k, int64_t group_size) {
  if (group_size >= k) return 30;
  int64_t shift = 0;
  while ((int64_t(1) << shift) < group_size) ++shift;
  return shift;
}

struct Int4Interleaved {
  std::vector<uint8_t> codes;  // [n][k/2], interleaved
  std::vector<uint8_t> zeros;  // empty when every zero point is 8 (symmetric)
};

Int4Interleaved interleave_int4(const Int4View& row_major, int64_t n, int64_t k);

}  // namespace nibble::cuda
