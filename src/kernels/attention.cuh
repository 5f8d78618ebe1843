// Causal GQA attention over a contiguous f32 KV cache [ctx, n_head_kv, head_dim]. One warp per
// (token, q head) streams its context with an online softmax (running max and sum), each lane
// holding head_dim/32 output dimensions, so any context length works without scratch memory.
// This is the exact first version; split-K flash-decoding replaces it for speed.
#pragma once

#include <cstdint>

#include "kernels/linear.cuh"

namespace nibble::kernels {

constexpr int64_t kAttentionMaxHeadDim = 256;

__global__ void attention_online_warp_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                             const float* __restrict__ v, float* __restrict__ out,
                                             int64_t m, int64_t pos0, int64_t n_head, int64_t n_head_kv,
                                             int64_t head_dim, float scale) {
  const int64_t pair = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= m * n_head) return;
  const int64_t t = pair / n_head, h = pair % n_head, kv = h / (n_head / n_head_kv);
  const float* qh = q + pair * head_dim;
  constexpr int kPerLane = kAttentionMaxHeadDim / 32;
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = d < head_dim ? qh[d] : 0.f;
    acc[j] = 0.f;
  }
  float running_max = -INFINITY, running_sum = 0.f;
  const int64_t n_ctx = pos0 + t + 1;
  for (int64_t pos = 0; pos < n_ctx; ++pos) {
    const float* kp = k + (pos * n_head_kv + kv) * head_dim;
    const float* vp = v + (pos * n_head_kv + kv) * head_dim;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < head_dim) dot += qv[j] * kp[d];
    }
    const float score = warp_sum(dot) * scale;
    const float new_max = fmaxf(running_max, score);
    const float correction = expf(running_max - new_max), p = expf(score - new_max);
    running_sum = running_sum * correction + p;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < head_dim) acc[j] = acc[j] * correction + p * vp[d];
    }
    running_max = new_max;
  }
  float* oh = out + pair * head_dim;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < head_dim) oh[d] = acc[j] / running_sum;
  }
}

}  // namespace nibble::kernels
