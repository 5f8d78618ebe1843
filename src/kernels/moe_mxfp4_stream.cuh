// gpt-oss's MXFP4 MoE decode with the expert weights streamed through shared memory (sm_90+):
// the same two launches and results as kernels/moe_mxfp4.cuh, another way of reading the bytes.
//
// Why: the register kernels hold a warp's next groups in registers, and each warp streams only
// ~12 KB, so its loads, its E2M1 decode and its products take turns. Here one producer warp a
// block issues bulk copies (kernels/bulk_copy.cuh) of whole 16-row tiles into a ring of
// shared-memory stages, and the consumer warps decode and multiply each stage when it lands: no
// register holds a load in flight, and the inner loop is only the decode and the mma steps (the
// same as the register kernels', kernels/gemv_mxfp4.cuh: whole groups without per-block bounds,
// the token's row for every B column, so no lane's load is predicated). Alone on gpt-oss-20b's
// shapes (H100, tools/kernel-bench/moe_mxfp4_bench.cu) gate/up 24.6 -> ~20 µs, down 16.7 -> 13.7.
// What limits them now is the consumers' instruction issue (Nsight Compute: ~48% issue-active,
// 40% of DRAM bandwidth), not the bytes in flight: 2 stages and 2-3 blocks an SM beat 4-8 stages
// with fewer blocks.
//
// A stage is one 16-row tile of one expert matrix over all of K: 16 row copies (k/2 bytes each,
// into rows padded so that the 8 rows a warp's 16-byte loads touch fall in distinct banks) and
// one copy of the tile's 16 scale rows. The consumer warps split the tile's groups of 128 k;
// their partial sums meet in shared memory, summed by whichever warp finishes the tile last.
//
// Work: items (one output tile each) go to blocks round-robin; an item is L tiles in sequence
// (gate/up: 1, the slot's expert; down: top_k, one per slot, weighted and summed in registers).
// Needs n % 16 == 0 and 16-byte aligned codes and scales (the launcher checks; the register
// kernels take the rest).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/activation.cuh"
#include "kernels/bulk_copy.cuh"
#include "kernels/gemv_mxfp4.cuh"
#include "kernels/moe_route.cuh"

namespace nibble::kernels {

// A staged code row: k/2 bytes padded to 64 mod 128, so rows g and g + 1 start half a bank cycle
// apart and a warp's 16-byte loads of 8 rows are conflict-free.
__host__ __device__ constexpr int64_t mxfp4_stream_row_stride(int64_t k) { return k / 2 + (192 - (k / 2) % 128) % 128; }
__host__ __device__ constexpr int64_t mxfp4_stream_stage_bytes(int64_t k) {
  return 16 * mxfp4_stream_row_stride(k) + 16 * mxfp4_scale_stride(k);
}
// Dynamic shared memory: the ring, its two barriers a stage, the consumers' partial sums of
// stages + 2 items (W × 16 floats and a counter each), then `extra` bytes (16-aligned).
__host__ __device__ constexpr int64_t mxfp4_stream_extra_offset(int64_t k, int stages, int warps) {
  return stages * (mxfp4_stream_stage_bytes(k) + 16) + (stages + 2) * (64 * warps + 16);
}
__host__ __device__ constexpr int64_t mxfp4_stream_smem(int64_t k, int stages, int warps, int64_t extra) {
  return mxfp4_stream_extra_offset(k, stages, warps) + extra;
}

// One block (32 k) of rows g and g + 8 of a staged tile: the two words' E2M1 pairs as the mma's A,
// x's 16-byte unit as B (every column the token's row: only column 0 is kept), the block's scales
// applied to the sums. acc[0]: row g, acc[1]: row g + 8.
__device__ __forceinline__ void mxfp4_block_dot(uint32_t w0, uint32_t w1, uint32_t s0, uint32_t s1, uint4 xv,
                                                float (&acc)[2]) {
  uint32_t p0[4], p1[4];
  mxfp4_decode_word(w0, p0);
  mxfp4_decode_word(w1, p1);
  const uint32_t a0[4] = {p0[0], p1[0], p0[1], p1[1]}, a1[4] = {p0[2], p1[2], p0[3], p1[3]};
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  mma_f16(d, a0, xv.x, xv.y);
  mma_f16(d, a1, xv.z, xv.w);
  acc[0] = fmaf(d[0], __uint_as_float(s0), acc[0]);
  acc[1] = fmaf(d[2], __uint_as_float(s1), acc[1]);
}

// acc += this warp's groups (kw, kw + W, ...) of a staged tile, rows g and g + 8; x: the token's
// staged row (+ t), in shared memory or (kGlobalX) global. Whole groups of 4 blocks take a loop
// without per-block bounds; a last partial group (k % 128 != 0) the general one.
template <int W, bool kGlobalX>
__device__ __forceinline__ void mxfp4_stage_dot(const uint8_t* stage, int64_t k, int kw, const uint4* x,
                                                float (&acc)[2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int stride = int(mxfp4_stream_row_stride(k)), sstride = int(mxfp4_scale_stride(k));
  const int whole = int(k / 128), groups = int(mxfp4_groups(k));
  const uint8_t* row0 = stage + g * stride + 16 * t;
  const uint8_t* row1 = row0 + 8 * stride;
  const uint32_t* sc0 = reinterpret_cast<const uint32_t*>(stage + 16 * stride + g * sstride);
  const uint32_t* sc1 = reinterpret_cast<const uint32_t*>(stage + 16 * stride + (g + 8) * sstride);
  auto load_x = [&](int unit) { return kGlobalX ? __ldg(x + 4 * unit) : x[4 * unit]; };
  for (int q = kw; q < whole; q += W) {
    const uint4 v0 = *reinterpret_cast<const uint4*>(row0 + 64 * q);
    const uint4 v1 = *reinterpret_cast<const uint4*>(row1 + 64 * q);
    const uint32_t s0 = sc0[q], s1 = sc1[q];
    const uint32_t w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int b = 0; b < 4; ++b)
      mxfp4_block_dot(w0[b], w1[b], __float_as_uint(mxfp4_group_scale(s0, b)),
                      __float_as_uint(mxfp4_group_scale(s1, b)), load_x(4 * q + b), acc);
  }
  if (whole < groups && whole % W == kw) {  // the partial group: r < 4 blocks, words at 4 (r·t + b)
    const int q = whole, r = mxfp4_group_blocks(k, q);
    const uint8_t* base0 = row0 - 16 * t + 64 * q;
    const uint8_t* base1 = base0 + 8 * stride;
    for (int b = 0; b < r; ++b)
      mxfp4_block_dot(*reinterpret_cast<const uint32_t*>(base0 + 4 * (r * t + b)),
                      *reinterpret_cast<const uint32_t*>(base1 + 4 * (r * t + b)),
                      __float_as_uint(mxfp4_group_scale(sc0[q], b)), __float_as_uint(mxfp4_group_scale(sc1[q], b)),
                      load_x(4 * q + b), acc);
  }
}

struct Mxfp4StreamTile {  // what the producer copies: rows tile0 .. tile0 + 15 of w
  Mxfp4Weight w;
  int64_t tile0;
};
struct Mxfp4StreamInput {  // what a consumer multiplies a stage by
  const uint4* x;          // the token's staged row, + t: every lane's B column is the token
  float factor;            // the tile's weight in the item's sum
};

// The block's share of `items` (items blockIdx.x, + gridDim.x, ...), each `L` tiles through the
// ring of `stages`. Warps 0..W-1 consume, warp W produces. Every thread of the block calls it
// after staging what it needs before the PDL wait; the producer issues the first `stages` tiles
// before its wait when kEarly (source may then read only what was written two launches back).
//   source(item, l) -> Mxfp4StreamTile   (producer)
//   input(item, l) -> Mxfp4StreamInput   (consumers, after the wait)
//   epilogue(item, partial)              (the item's last consumer warp; partial[w][row]: warp w's sum)
template <int W, bool kEarly, bool kGlobalX, typename Source, typename Input, typename Epilogue>
__device__ __forceinline__ void mxfp4_stream(int64_t items, int L, int64_t k, int stages, Source&& source,
                                             Input&& input, Epilogue&& epilogue) {
  uint8_t* ring = dynamic_smem();
  const int64_t stage_bytes = mxfp4_stream_stage_bytes(k), stride = mxfp4_stream_row_stride(k);
  const int64_t scale_bytes = 16 * mxfp4_scale_stride(k);
  auto* full = reinterpret_cast<uint64_t*>(ring + stages * stage_bytes);
  uint64_t* empty = full + stages;
  auto* sums = reinterpret_cast<float(*)[W][16]>(empty + stages);
  auto* counts = reinterpret_cast<uint32_t*>(sums + stages + 2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], W);
    for (int s = 0; s < stages + 2; ++s) counts[4 * s] = 0;
    fence_barrier_init();
  }
  __syncthreads();  // the barriers, and whatever the caller staged
  const int64_t mine = items > blockIdx.x ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0, total = mine * L;

  if (warp == W) {  // producer
    const uint64_t policy = l2_evict_first_policy();
    if (!kEarly) pdl_enter();
    int64_t j = 0;
    for (int64_t it = blockIdx.x; it < items; it += gridDim.x)
      for (int l = 0; l < L; ++l, ++j) {
        const int s = int(j % stages);
        if (kEarly && j == stages) pdl_enter();
        if (j >= stages) mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
        const Mxfp4StreamTile src = source(it, l);
        if (lane == 0) mbarrier_arrive_expect(&full[s], uint32_t(16 * (k / 2) + scale_bytes));
        __syncwarp();
        uint8_t* stage = ring + s * stage_bytes;
        if (lane < 16)
          bulk_load(stage + lane * stride, src.w.codes + (src.tile0 + lane) * (k / 2), uint32_t(k / 2), &full[s],
                    policy);
        else if (lane == 16)
          bulk_load(stage + 16 * stride, src.w.scales + src.tile0 * mxfp4_scale_stride(k), uint32_t(scale_bytes),
                    &full[s], policy);
      }
    if (kEarly && total <= stages) pdl_enter();
    return;
  }

  pdl_enter();
  const int g = lane / 4, t = lane % 4;
  int64_t j = 0, n = 0;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x, ++n) {
    float acc[2] = {0.f, 0.f};
    for (int l = 0; l < L; ++l, ++j) {
      const int s = int(j % stages);
      const Mxfp4StreamInput in = input(it, l);
      mbarrier_wait(&full[s], uint32_t((j / stages) & 1));
      float a[2] = {0.f, 0.f};
      mxfp4_stage_dot<W, kGlobalX>(ring + s * stage_bytes, k, warp, in.x, a);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty[s]);
      acc[0] = fmaf(in.factor, a[0], acc[0]), acc[1] = fmaf(in.factor, a[1], acc[1]);
    }
    // Column 0 (the token) is in the lanes with t == 0. The last warp to finish the item sums it,
    // so no warp waits for the others. The ring keeps the fastest warp within `stages` tiles of
    // the slowest, so stages + 2 slots never hold two live items.
    float(&partial)[W][16] = sums[n % (stages + 2)];
    if (t == 0) partial[warp][g] = acc[0], partial[warp][g + 8] = acc[1];
    __threadfence_block();
    __syncwarp();
    uint32_t arrived = 0;
    if (lane == 0) arrived = atomicAdd(&counts[4 * (n % (stages + 2))], 1u);  // W more each use
    if (__shfl_sync(~0u, arrived, 0) % W == W - 1) {
      __threadfence_block();
      epilogue(it, partial);
    }
  }
}

// The routing of the block's m tokens in shared memory: read from ids and weights [m, top_k], or
// with logits routed here, warp i taking token i (route_token with kPerLane experts a lane). The
// caller synchronises (the runner's first barrier) before anything reads it. kPerLane is the
// launcher's smallest fit for the model's experts (1 for gpt-oss-20b's 32), 0 when the ids come
// from a routing launch, so that only the kernels that route carry route_token: with it compiled
// in (16 experts a lane, 108 registers) the down kernel took 15.6 µs a call on the H100 even where
// the ids came from a routing launch, and 10.6 without it (96 registers); routing for itself (1 a
// lane, 102 registers) it took 15.7, which is why the routing launch is the default for these
// kernels (backend/cuda/cuda_backend.cpp, BENCHMARKS.md). Both fit 2 blocks an SM by registers;
// what the routing code costs inside the kernel was not found.
template <int kPerLane>
struct Mxfp4StreamRouting {
  int32_t ids[kGemvMaxM * 8];
  float weights[kGemvMaxM * 8];

  __device__ __forceinline__ void load(const int32_t* __restrict__ g_ids, const float* __restrict__ g_weights,
                                       const float* __restrict__ logits, int64_t n_experts, bool normalize, int64_t m,
                                       int64_t top_k) {
    if constexpr (kPerLane > 0) {
      for (int64_t tok = threadIdx.x / 32; tok < m; tok += blockDim.x / 32)
        route_token<false, kPerLane>(logits + tok * n_experts, n_experts, top_k, normalize, ids + tok * top_k,
                                     weights + tok * top_k);
    } else {
      for (int64_t i = threadIdx.x; i < m * top_k; i += blockDim.x)
        ids[i] = g_ids[i], weights[i] = g_weights ? g_weights[i] : 0.f;
    }
  }
};

// Gate/up: items are (slot, 16-row tile of 2·inter), slot-major; x holds the m = slots / top_k
// tokens' normed rows, written before the router (two launches back), so they are staged before
// the wait; the routing after it (the router's logits come from the previous kernel). The
// epilogue adds the biases and writes the clamped SwiGLU of the tile's 8 (gate, up) pairs to act
// as f16 in the down projection's staged order.
template <int W, int kMinBlocks = 1, int kRoutePerLane = 0>
__global__ void __launch_bounds__(32 * (W + 1), kMinBlocks) moe_mxfp4_gate_up_stream_kernel(
    const Mxfp4Device* __restrict__ gate_up, const int32_t* __restrict__ g_ids, const float* __restrict__ logits,
    int64_t n_experts, const float* __restrict__ x, __half* __restrict__ act, int64_t slots, int64_t top_k,
    int64_t inter, int64_t hidden, float alpha, float limit, int stages) {
  NIBBLE_TIMELINE_BLOCK(kMoeGateUp);
  const int64_t tiles = 2 * inter / 16;
  __half* xs = reinterpret_cast<__half*>(dynamic_smem() + mxfp4_stream_extra_offset(hidden, stages, W));
  mxfp4_stage_x(XRows<kGemvMaxM, false>{x, hidden, int(slots / top_k), nullptr, {}}, hidden, xs);
  NIBBLE_TIMELINE_MARK();
  __shared__ Mxfp4StreamRouting<kRoutePerLane> routing;
  pdl_wait();
  routing.load(g_ids, nullptr, logits, n_experts, false, slots / top_k, top_k);
  const int32_t* ids = routing.ids;
  mxfp4_stream<W, false, false>(
      slots * tiles, 1, hidden, stages,
      [&](int64_t it, int) {
        const Mxfp4Device d = gate_up[ids[it / tiles]];
        return Mxfp4StreamTile{{d.codes, d.scales}, it % tiles * 16};
      },
      [&](int64_t it, int) {
        const int64_t tok = it / tiles / top_k;
        return Mxfp4StreamInput{reinterpret_cast<const uint4*>(xs + tok * mxfp4_x_stride(hidden)) + threadIdx.x % 4,
                                1.f};
      },
      [&](int64_t it, const float(&partial)[W][16]) {
        const int jj = threadIdx.x % 32;
        if (jj >= 8) return;
        const int64_t slot = it / tiles, j = it % tiles * 8 + jj;
        float gate = 0.f, up = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) gate += partial[w][2 * jj], up += partial[w][2 * jj + 1];
        const float* bias = gate_up[ids[slot]].bias;
        if (bias) gate += bias[2 * j], up += bias[2 * j + 1];
        act[slot * inter + mxfp4_x_half(j)] = __float2half_rn(clamped_swiglu(gate, up, alpha, limit));
      });
}

// Down: items are (token, 16-row tile of hidden), each the token's top_k slots in turn. The
// routing (or the router's logits, routed here) was written two launches back, so the first
// stages load before the wait.
// out = (accumulate ? out : 0) + Σ_slot weight · (down rows · act + bias).
template <int W, int kMinBlocks = 1, int kRoutePerLane = 0>
__global__ void __launch_bounds__(32 * (W + 1), kMinBlocks) moe_mxfp4_down_stream_kernel(
    const Mxfp4Device* __restrict__ down, const int32_t* __restrict__ g_ids, const float* __restrict__ g_weights,
    const float* __restrict__ logits, int64_t n_experts, bool normalize, const __half* __restrict__ act,
    float* __restrict__ out, int64_t m, int64_t top_k, int64_t inter, int64_t hidden, bool accumulate, int stages) {
  NIBBLE_TIMELINE_BLOCK(kMoeDown);
  const int64_t tiles = hidden / 16;
  __shared__ Mxfp4StreamRouting<kRoutePerLane> routing;
  routing.load(g_ids, g_weights, logits, n_experts, normalize, m, top_k);
  NIBBLE_TIMELINE_MARK_AT(0);  // the routing in shared memory (this warp's part), before the first copies
  const int32_t* ids = routing.ids;
  const float* weights = routing.weights;
  mxfp4_stream<W, true, true>(
      m * tiles, int(top_k), inter, stages,
      [&](int64_t it, int l) {
        const Mxfp4Device d = down[ids[it / tiles * top_k + l]];
        return Mxfp4StreamTile{{d.codes, d.scales}, it % tiles * 16};
      },
      [&](int64_t it, int l) {
        const int64_t slot = it / tiles * top_k + l;
        return Mxfp4StreamInput{reinterpret_cast<const uint4*>(act + slot * inter) + threadIdx.x % 4, weights[slot]};
      },
      [&](int64_t it, const float(&partial)[W][16]) {
        const int r = threadIdx.x % 32;
        if (r >= 16) return;
        const int64_t tok = it / tiles, row = it % tiles * 16 + r;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) total += partial[w][r];
        for (int64_t l = 0; l < top_k; ++l) {
          const float* bias = down[ids[tok * top_k + l]].bias;
          if (bias) total = fmaf(weights[tok * top_k + l], bias[row], total);
        }
        float* dst = out + tok * hidden + row;
        *dst = (accumulate ? *dst : 0.f) + total;
      });
}

}  // namespace nibble::kernels
