// The launchers' conversion of the host-side Int4Device (launch.h) to the kernels' Int4Weight:
// the same fields, the scales typed as __half.
#pragma once

#include "backend/cuda/launch.h"
#include "kernels/int4_weight.cuh"

namespace nibble::cuda {

static_assert(sizeof(Int4Device) == sizeof(kernels::Int4Weight));

inline kernels::Int4Weight to_kernel(const Int4Device& w) {
  return {w.codes, reinterpret_cast<const __half*>(w.scales), w.zeros, w.group_shift, w.n_groups};
}

}  // namespace nibble::cuda
