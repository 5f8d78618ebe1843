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

// Greedy sampling: block r finds the largest of x[r, 0..n), lowest index on ties (as
// std::max_element). Each thread scans a stride, then warp and block reductions of (value, index).
__global__ void argmax_kernel(const float* __restrict__ x, int64_t n, int32_t* __restrict__ out) {
  pdl_enter();
  __shared__ float s_val[32];
  __shared__ int32_t s_idx[32];
  const float* row = x + int64_t(blockIdx.x) * n;
  float best = -INFINITY;
  int32_t best_i = INT32_MAX;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    if (v > best || (v == best && int32_t(i) < best_i)) best = v, best_i = int32_t(i);
  }
  auto merge = [&](float v, int32_t i) {
    if (v > best || (v == best && i < best_i)) best = v, best_i = i;
  };
  for (int o = 16; o > 0; o >>= 1) merge(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_i, o));
  if (threadIdx.x % 32 == 0) s_val[threadIdx.x / 32] = best, s_idx[threadIdx.x / 32] = best_i;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = threadIdx.x < blockDim.x / 32 ? s_val[threadIdx.x] : -INFINITY;
    best_i = threadIdx.x < blockDim.x / 32 ? s_idx[threadIdx.x] : INT32_MAX;
    for (int o = 16; o > 0; o >>= 1) merge(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_i, o));
    // All -inf (or NaN) rows: index 0, as std::max_element returns the first element.
    if (threadIdx.x == 0) out[blockIdx.x] = best_i == INT32_MAX ? 0 : best_i;
  }
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
