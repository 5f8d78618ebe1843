// RMSNorm and RoPE on f32 rows. rms_norm: one block per row, block-wide sum of squares. rope:
// one thread per (token, head, pair) of the half-split (NeoX) rotation, angle = (pos0+t)·inv_freq.
#pragma once

#include <cstdint>

#include "kernels/kv_access.cuh"
#include "kernels/linear.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

// With `delta`, the residual add comes first: x += delta (written back), then the norm of x.
// A decode step's rows are single blocks on one SM, so the block is wide (1024 threads) and each
// thread holds its few elements in registers between the two passes.
constexpr int kNormMaxPerThread = 8;  // dim <= 8192 with 1024 threads

__global__ void rms_norm_block_kernel(const float* __restrict__ x_in, const float* __restrict__ delta,
                                      float* __restrict__ x_out, const float* __restrict__ w,
                                      float* __restrict__ y, int64_t dim, float eps) {
  NIBBLE_TIMELINE_BLOCK(kRmsNorm);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  __shared__ float partial[32];
  const int64_t base = int64_t(blockIdx.x) * dim;
  float v[kNormMaxPerThread];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kNormMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    v[j] = 0.f;
    if (i < dim) {
      v[j] = x_in[base + i] + (delta ? delta[base + i] : 0.f);
      if (delta) x_out[base + i] = v[j];
    }
    ss += v[j] * v[j];
  }
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
#pragma unroll
  for (int j = 0; j < kNormMaxPerThread; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    if (i < dim) y[base + i] = v[j] * inv * (w ? w[i] : 1.f);
  }
}

// The attention prologue in one launch: block (token, head) over q heads then kv heads. One warp
// per head vector: RMSNorm over head_dim (optional), RoPE (half-split) at the token's position,
// then q is written back in place and k/v go to their pool row (backend/kv_pages.h), rounded to
// the cache element type T.
template <typename T>
__global__ void qk_norm_rope_kv_write_kernel(const float* q_in, float* q_out, int64_t q_stride,
                                             const float* __restrict__ k_new, const float* __restrict__ v_new,
                                             int64_t kv_stride, const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm, float eps,
                                             const float* __restrict__ inv_freq, float attention_factor,
                                             const int32_t* __restrict__ positions, int64_t n_head,
                                             int64_t n_head_kv, int64_t head_dim, T* __restrict__ k_cache,
                                             T* __restrict__ v_cache, const int32_t* __restrict__ tables,
                                             const int32_t* __restrict__ seq_rows, int64_t table_stride,
                                             int block_size_log2) {
  constexpr int kMaxPerLane = 8;  // head_dim <= 256
  NIBBLE_TIMELINE_BLOCK(kQkNormRope);
  const int64_t t = blockIdx.x, h = int64_t(blockIdx.y) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool active = h < n_head + n_head_kv, is_q = h < n_head;
  const float* norm = is_q ? q_norm : k_norm;
  const int64_t half = head_dim / 2;
  // Before the PDL wait, all that does not come from the projection: the position and its pool
  // row (step inputs, see pdl.cuh), the norm weights and the rotation. After it, the head's
  // values are one load away from their stores.
  const int64_t pos = positions[t];
  const int64_t row =
      is_q || !active ? 0 : kv_pool_row(kv_token_table(tables, seq_rows, table_stride, t), block_size_log2, pos);
  // Lane holds pairs (i, i + half) for i = lane + 32 j, so the rotation needs no exchange.
  float w0[kMaxPerLane], w1[kMaxPerLane], cs[kMaxPerLane], sn[kMaxPerLane];
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int64_t i = lane + 32 * j;
    if (!active || i >= half) break;
    w0[j] = norm ? norm[i] : 1.f;
    w1[j] = norm ? norm[i + half] : 1.f;
    // Same f32 angle as the CPU reference and transformers; sincosf keeps full range reduction.
    sincosf(float(pos) * inv_freq[i], &sn[j], &cs[j]);
    cs[j] *= attention_factor;
    sn[j] *= attention_factor;
  }
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  if (!active) return;
  // q_in and q_out may be one buffer: each warp reads its head vector whole before writing it.
  const float* src = is_q ? q_in + t * q_stride + h * head_dim : k_new + t * kv_stride + (h - n_head) * head_dim;
  float* q_dst = q_out + (t * n_head + h) * head_dim;
  T* k_dst = k_cache + (row * n_head_kv + (h - n_head)) * head_dim;
  float a[kMaxPerLane], b[kMaxPerLane], vv[2 * kMaxPerLane];
  const float* vs = v_new + t * kv_stride + (h - n_head) * head_dim;
#pragma unroll
  for (int j = 0; j < 2 * kMaxPerLane; ++j)  // V rows are copied as they are, loaded with the head
    if (!is_q && lane + 32 * j < head_dim) vv[j] = vs[lane + 32 * j];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int64_t i = lane + 32 * j;
    a[j] = i < half ? src[i] : 0.f;
    b[j] = i < half ? src[i + half] : 0.f;
    ss += a[j] * a[j] + b[j] * b[j];
  }
  const float inv = norm ? rsqrtf(warp_sum(ss) / float(head_dim) + eps) : 1.f;
#pragma unroll
  for (int j = 0; j < kMaxPerLane; ++j) {
    const int64_t i = lane + 32 * j;
    if (i >= half) break;
    const float x0 = a[j] * inv * w0[j], x1 = b[j] * inv * w1[j];
    const float y0 = x0 * cs[j] - x1 * sn[j], y1 = x1 * cs[j] + x0 * sn[j];
    if (is_q) {
      q_dst[i] = y0;
      q_dst[i + half] = y1;
    } else {
      kv_store(k_dst + i, y0);
      kv_store(k_dst + i + half, y1);
    }
  }
  if (!is_q) {
    T* vd = v_cache + (row * n_head_kv + (h - n_head)) * head_dim;
#pragma unroll
    for (int j = 0; j < 2 * kMaxPerLane; ++j)
      if (lane + 32 * j < head_dim) kv_store(vd + lane + 32 * j, vv[j]);
  }
}


}  // namespace nibble::kernels
