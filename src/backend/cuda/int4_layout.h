// Conversion of nibble's row-major INT4 (the CPU layout) into the warp-interleaved layout the
// CUDA decode kernels read (documented in kernels/gemv.cuh). Host code, run once at upload.
#pragma once

#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace nibble::cuda {

// Whether a [n, k] INT4 weight with this group size can use the interleaved layout.
inline bool int4_interleavable(int64_t k, int64_t group_size) {
  return k % 256 == 0 && group_size % 32 == 0;
}

struct Int4Interleaved {
  std::vector<uint8_t> codes;  // [n][k/2], interleaved
  std::vector<uint8_t> zeros;  // empty when every zero point is 8 (symmetric)
};

Int4Interleaved interleave_int4(const Int4View& row_major, int64_t n, int64_t k);

}  // namespace nibble::cuda
