// RMSNorm and RoPE on f32 rows. rms_norm: one block per row, block-wide sum of squares. rope:
// one thread per (token, head, pair) of the half-split (NeoX) rotation, angle = (pos0+t)·inv_freq.
#pragma once

#include <cstdint>

#include "kernels/linear.cuh"

namespace nibble::kernels {

__global__ void rms_norm_block_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                      float* __restrict__ y, int64_t dim, float eps) {
  __shared__ float partial[32];
  const float* xr = x + int64_t(blockIdx.x) * dim;
  float* yr = y + int64_t(blockIdx.x) * dim;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / float(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * (w ? w[i] : 1.f);
}

__global__ void rope_neox_kernel(float* __restrict__ x, const float* __restrict__ inv_freq,
                                 float attention_factor, int64_t m, int64_t n_head, int64_t head_dim,
                                 int64_t pos0) {
  const int64_t half = head_dim / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= m * n_head * half) return;
  const int64_t i = idx % half, th = idx / half, t = th / n_head;
  // Same f32 angle as the CPU reference and transformers; sincosf keeps full range reduction.
  float s, c;
  sincosf(float(pos0 + t) * inv_freq[i], &s, &c);
  c *= attention_factor;
  s *= attention_factor;
  float* v = x + th * head_dim;
  const float a = v[i], b = v[i + half];
  v[i] = a * c - b * s;
  v[i + half] = b * c + a * s;
}

}  // namespace nibble::kernels
