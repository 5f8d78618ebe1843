// y[m, n] = x[m, k] · W[n, k]ᵀ (+ b) for f32 activations and W in f32, f16, bf16, nibble's
// row-major INT4 (codes [n][k/2], two per byte, low nibble first; f32 scales and u8 zeros
// [n][n_groups]) or MXFP4 (E2M1 codes [n][k/2] the same way, E8M0 scales [n][k/32]). One warp
// per output row: lanes stride along K so each weight row is read once, coalesced, and reused for every activation row (up to kMaxRows per pass). This is the simple,
// exact first version the tuned kernels are measured against; it does not use tensor cores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace nibble::kernels {

constexpr int kLinearMaxRows = 8;  // activation rows accumulated per pass over a weight row

enum class DenseType { kF32, kF16, kBF16 };

template <DenseType T>
__device__ __forceinline__ float load_weight(const void* w, int64_t i) {
  if constexpr (T == DenseType::kF32) return static_cast<const float*>(w)[i];
  if constexpr (T == DenseType::kF16) return __half2float(static_cast<const __half*>(w)[i]);
  if constexpr (T == DenseType::kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(w)[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Lane 0 writes y[m0 + r, row] = the warp's sum of acc[r] + bias, for the rows below m.
__device__ __forceinline__ void store_warp_rows(const float (&acc)[kLinearMaxRows], int64_t m0, int64_t m,
                                                int64_t row, int64_t n, float bias, float* __restrict__ y) {
#pragma unroll
  for (int r = 0; r < kLinearMaxRows; ++r) {
    const float s = warp_sum(acc[r]);
    if (threadIdx.x % 32 == 0 && m0 + r < m) y[(m0 + r) * n + row] = s + bias;
  }
}

template <DenseType T>
__global__ void linear_dense_warp_row_kernel(const void* __restrict__ w, const float* __restrict__ bias,
                                             const float* __restrict__ x, float* __restrict__ y,
                                             int64_t m, int64_t n, int64_t k) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const float b = bias ? bias[row] : 0.f;
  for (int64_t m0 = 0; m0 < m; m0 += kLinearMaxRows) {
    float acc[kLinearMaxRows] = {};
    for (int64_t i = lane; i < k; i += 32) {
      const float wv = load_weight<T>(w, row * k + i);
#pragma unroll
      for (int r = 0; r < kLinearMaxRows; ++r)
        if (m0 + r < m) acc[r] += wv * x[(m0 + r) * k + i];
    }
    store_warp_rows(acc, m0, m, row, n, b, y);
  }
}

static __global__ void linear_int4_warp_row_kernel(const uint8_t* __restrict__ codes,
                                                   const __half* __restrict__ scales,
                                                   const uint8_t* __restrict__ zeros,
                                                   const float* __restrict__ bias, const float* __restrict__ x,
                                                   float* __restrict__ y, int64_t m, int64_t n, int64_t k,
                                                   int64_t group_size, int64_t n_groups) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t row_bytes = (k + 1) / 2;
  const float b = bias ? bias[row] : 0.f;
  for (int64_t m0 = 0; m0 < m; m0 += kLinearMaxRows) {
    float acc[kLinearMaxRows] = {};
    for (int64_t byte = lane; byte < row_bytes; byte += 32) {
      const uint8_t packed = codes[row * row_bytes + byte];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t i = 2 * byte + half;
        if (i >= k) break;
        const int64_t g = i / group_size;
        const int zero = zeros ? int(zeros[row * n_groups + g]) : 8;
        const float wv = float(int((packed >> (4 * half)) & 0xF) - zero) *
                         __half2float(scales[row * n_groups + g]);
#pragma unroll
        for (int r = 0; r < kLinearMaxRows; ++r)
          if (m0 + r < m) acc[r] += wv * x[(m0 + r) * k + i];
      }
    }
    store_warp_rows(acc, m0, m, row, n, b, y);
  }
}

}  // namespace nibble::kernels
