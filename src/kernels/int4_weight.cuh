// One INT4 matrix in the warp-interleaved layout (documented in kernels/gemv.cuh), as every INT4
// kernel takes it: the decode GEMVs, the MoE decode kernels and the tensor-core GEMMs.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace nibble::kernels {

struct Int4Weight {
  const uint8_t* codes;
  const __half* scales;
  const uint8_t* zeros;  // null: symmetric, zero point 8
  int64_t group_shift;   // log2(G); 30 when one group spans K
  int64_t n_groups;
};

}  // namespace nibble::kernels
