// INT4 decode products with the weights streamed through shared memory (sm_90+): a ring of
// stages that one producer warp a block fills with bulk copies of whole 16-row tiles
// (kernels/bulk_copy.cuh), and consumer warps that multiply them as they land with the register
// GEMV's own products (kernels/gemv_mma.cuh: MmaWeights filled from the stage, mma_group_dot).
// The INT4 counterpart of kernels/mxfp4_stream.cuh, and the consumer of INT4 tiles that the
// persistent decode step (docs/persistent-decode.md) is built from; as a launch of its own it
// serves one token's GEMV when switched on (ops.cu: NIBBLE_INT4_STREAM=1), which is how OpsTest checks it
// against the CPU reference.
//
// A stage is one 16-row tile over all of K: its 16 code rows, each copied into a padded row, then
// its scales and zero points (kernels/int4_stream_layout.h: the offsets and why, proved on the CPU).
//
// Split: a lane's 16-byte unit holds a word of each of 4 chunks, so a warp owns whole groups of
// 1024 k (`quads`); a tile keeps min(quads, W) warps busy and the W consumer warps take
// W / that many landed tiles at once (Qwen3-30B-A3B: k = 2048 two warps a tile, four tiles at
// once; k = 4096 two tiles; k = 768, one partial group, eight). A tile's warps' sums meet in
// shared memory in warp order (deterministic), and one thread a row writes it.
//
// Needs n % 16 == 0, k % 256 == 0 and 16-byte aligned codes, scales and zero points (the
// launcher checks). Batch 1: the token's row is B column 0.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/bulk_copy.cuh"
#include "kernels/gemv_mma.cuh"
#include "kernels/int4_stream_layout.h"
#include "kernels/pdl.cuh"

namespace nibble::kernels {

// The normed row is staged in one pass of at most this many float4 units a thread (k <= 9216 for
// the launcher's 288 threads).
constexpr int kInt4StreamStageUnits = 8;

// Dynamic shared memory: int4_stream_x_offset's, then the staged activation row.
__host__ __device__ constexpr int64_t int4_stream_smem(int64_t k, int64_t n_groups, bool zeros, int stages, int warps) {
  return int4_stream_x_offset(k, n_groups, zeros, stages, warps) + mma_x_bytes(1, k);
}

// The producer warp's copies of rows tile0 .. tile0 + 15 of w into a stage, completed on `full`.
__device__ __forceinline__ void int4_stream_copy_tile(uint8_t* stage, const Int4Weight& w, int64_t tile0, int64_t k,
                                                      uint64_t* full, uint64_t policy) {
  const int lane = threadIdx.x % 32;
  const uint32_t code_bytes = uint32_t(k / 2), scale_bytes = uint32_t(32 * w.n_groups),
                 zero_bytes = w.zeros ? uint32_t(16 * w.n_groups) : 0u;
  if (lane == 0) mbarrier_arrive_expect(full, 16 * code_bytes + scale_bytes + zero_bytes);
  __syncwarp();
  if (lane < 16)
    bulk_load(stage + lane * int4_stream_row_stride(k), w.codes + (tile0 + lane) * (k / 2), code_bytes, full, policy);
  else if (lane == 16)
    bulk_load(stage + int4_stream_scales_offset(k), w.scales + tile0 * w.n_groups, scale_bytes, full, policy);
  else if (lane == 17 && w.zeros)
    bulk_load(stage + int4_stream_zeros_offset(k, w.n_groups), w.zeros + tile0 * w.n_groups, zero_bytes, full, policy);
}

// Rows g and g + 8 of a staged tile, for mma_weights_fill.
struct Int4StageRows {
  const uint8_t* stage;
  int64_t k, n_groups;
  bool zeros_present;
  __device__ __forceinline__ int row(int h) const { return int(threadIdx.x % 32 / 4) + 8 * h; }
  __device__ __forceinline__ const uint8_t* codes(int h) const { return stage + row(h) * int4_stream_row_stride(k); }
  __device__ __forceinline__ const __half* scales(int h) const {
    return reinterpret_cast<const __half*>(stage + int4_stream_scales_offset(k)) + row(h) * n_groups;
  }
  __device__ __forceinline__ const uint8_t* zeros(int h) const {
    return zeros_present ? stage + int4_stream_zeros_offset(k, n_groups) + row(h) * n_groups : nullptr;
  }
};

// acc += rows g and g + 8 of a staged tile times the staged row, over groups q0, q0 + step, ...
// (this warp's share); xb: this thread's units of its B column, null past the token's column.
template <int CPG>
__device__ __forceinline__ void int4_stage_dot(const Int4StageRows& rows, int shift, int q0, int step,
                                               const uint2* xb, float (&acc)[kMmaChains][4]) {
  const int quads = int4_stream_quads(rows.k);
  for (int q = q0; q < quads; q += step)
    with_words(mma_group_words(rows.k, q), [&](auto W) {
      MmaWeights<CPG> mw;
      mma_weights_fill<CPG, W.value>(rows, shift, q, [](const auto* p) { return *p; }, mw);
      mma_group_dot<CPG, W.value>(mw, q, xb, acc);
    });
}

// y[n] (+)= norm?(x[k]) · Wᵀ (+ b) for one token over the ring. Warps 0..W-1 consume, warp W
// produces; the block's tiles are blockIdx.x, + gridDim.x, ... The weights need no predecessor, so
// the first `stages` tiles are copied before the PDL wait; after it every thread helps stage x
// (normalised when kNorm), and the successor is released once it is staged (pdl.cuh).
template <int CPG, int W, bool kNorm>
__global__ void __launch_bounds__(32 * (W + 1), 1) gemv_int4_stream_kernel(Int4Weight w, const float* __restrict__ bias,
                                                                           const float* __restrict__ x,
                                                                           float* __restrict__ y, int64_t n, int64_t k,
                                                                           GemvIo io, int stages) {
  uint8_t* smem = dynamic_smem();
  const bool has_zeros = w.zeros != nullptr;
  const int64_t stage_bytes = int4_stream_stage_bytes(k, w.n_groups, has_zeros);
  auto* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  uint64_t* empty = full + stages;
  auto* partial = reinterpret_cast<float*>(empty + stages);  // [batch][tile warps][16]
  __half* xs = reinterpret_cast<__half*>(smem + int4_stream_x_offset(k, w.n_groups, has_zeros, stages, W));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_warps = int4_stream_tile_warps(k, W), batch = int4_stream_batch(k, W);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], uint32_t(tile_warps));
    fence_barrier_init();
  }
  __syncthreads();
  const int64_t tiles = n / 16;
  const int64_t mine = tiles > blockIdx.x ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto tile0 = [&](int64_t j) { return 16 * (blockIdx.x + j * gridDim.x); };
  const uint64_t policy = warp == W ? l2_evict_first_policy() : 0;
  const int64_t early = mine < stages ? mine : stages;
  if (warp == W)
    for (int64_t j = 0; j < early; ++j) int4_stream_copy_tile(smem + j * stage_bytes, w, tile0(j), k, &full[j], policy);
  pdl_wait();
  if constexpr (kNorm) {
    // One pass: the launcher keeps k within kInt4StreamStageUnits float4 units a thread. (Its own
    // instantiation, so the static shared memory of the MoE kernels' staging is not shared.)
    stage_row_one_pass<kInt4StreamStageUnits>(x, io.norm, k, io.eps, [&](int k0, float4 u) {
      __half* dst = xs + gemv_mma_x_half(k0);
      dst[0] = __float2half_rn(u.x), dst[4] = __float2half_rn(u.y);
      dst[8] = __float2half_rn(u.z), dst[12] = __float2half_rn(u.w);
    });
  } else {
    XRows<1, false> xr{x, k, 1, nullptr, {}};
    mma_stage_x(xr, int(k), xs, int(mma_x_stride(k)));
  }
  __syncthreads();
  pdl_launch_dependents();
  if (warp == W) {
    for (int64_t j = early; j < mine; ++j) {
      const int s = int(j % stages);
      mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
      int4_stream_copy_tile(smem + s * stage_bytes, w, tile0(j), k, &full[s], policy);
    }
    return;
  }
  const int g = lane / 4, t = lane % 4;
  const int slot = warp / tile_warps, q0 = warp % tile_warps;  // slot >= batch: idle warps
  const uint2* xb = mma_x_units(xs, k, 1);
  for (int64_t b = 0; b < mine; b += batch) {
    const int64_t j = b + slot;
    if (slot < batch && j < mine) {
      const int s = int(j % stages);
      mbarrier_wait(&full[s], uint32_t((j / stages) & 1));
      float acc[kMmaChains][4] = {};
      int4_stage_dot<CPG>(Int4StageRows{smem + s * stage_bytes, k, w.n_groups, has_zeros}, int(w.group_shift), q0,
                          tile_warps, xb, acc);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty[s]);
      const float4 d = mma_chains_sum(acc);
      if (t == 0) partial[(slot * tile_warps + q0) * 16 + g] = d.x, partial[(slot * tile_warps + q0) * 16 + g + 8] = d.z;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(32 * W) : "memory");  // the consumers: the batch's sums are in
    if (threadIdx.x < 16 * batch && b + threadIdx.x / 16 < mine) {
      const int r = int(threadIdx.x % 16), sl = int(threadIdx.x / 16);
      const int64_t row = tile0(b + sl) + r;
      float total = bias ? bias[row] : 0.f;
      for (int i = 0; i < tile_warps; ++i) total += partial[(sl * tile_warps + i) * 16 + r];
      y[row] = io.accumulate ? y[row] + total : total;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(32 * W) : "memory");  // the sums are read before the next batch
  }
}

}  // namespace nibble::kernels
