// Element-wise kernels on f32: SwiGLU's silu(gate)·up, residual add, and the embedding lookup that
// widens one stored row (f32/f16/bf16) per token.
#pragma once

#include <cstdint>

#include "core/hash_random.h"
#include "kernels/linear.cuh"
#include "kernels/pdl.cuh"

namespace nibble::kernels {

__global__ void silu_mul_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                int64_t count, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float g = gate[i];
  out[i] = g / (1.f + expf(-g)) * up[i];
}

__global__ void add_kernel(const float* __restrict__ x, int64_t count, float* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] += x[i];
}

template <DenseType T>
__global__ void embed_kernel(const void* __restrict__ table, const int32_t* __restrict__ ids,
                             int64_t dim, float* __restrict__ out) {
  pdl_enter();
  const int64_t t = blockIdx.x;
  const int64_t row = ids[t];
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = load_weight<T>(table, row * dim + i);
}

// kind: 0 = f32, 1 = bf16, 2 = u8 integers lo..hi, 3 = f16; values as the CPU backend's fill_random.
__global__ void fill_random_kernel(void* __restrict__ dst, int kind, int64_t count, float lo, float hi,
                                   uint64_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float u = hash_uniform(seed, uint64_t(i));
    if (kind == 2)
      static_cast<uint8_t*>(dst)[i] = uint8_t(fminf(hi, lo + floorf(u * (hi - lo + 1))));
    else if (kind == 3)
      static_cast<__half*>(dst)[i] = __float2half_rn(lo + u * (hi - lo));
    else if (kind == 1)
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(lo + u * (hi - lo));
    else
      static_cast<float*>(dst)[i] = lo + u * (hi - lo);
  }
}

}  // namespace nibble::kernels
