// gpt-oss's MXFP4 MoE decode with the expert weights streamed through shared memory (sm_90+,
// the ring of kernels/mxfp4_stream.cuh): the same two launches and results as
// kernels/moe_mxfp4.cuh, another way of reading the bytes. Alone on gpt-oss-20b's shapes (H100,
// tools/kernel-bench/moe_mxfp4_bench.cu) gate/up 24.6 -> ~20 µs, down 16.7 -> 13.7 against the
// register kernels. What limits them now is the consumers' instruction issue (Nsight Compute: ~48%
// issue-active, 40% of DRAM bandwidth), not the bytes in flight: 2 stages and 2-3 blocks an SM beat
// 4-8 stages with fewer blocks. In the decode pipeline (the timeline's probe marks, BENCHMARKS.md
// 2026-11-27) a gate/up block's first tile lands 7.2-7.6 µs after its wait, with the end of the
// grid's burst, and its consumers then take ~3 µs a tile: the bursts and the decode do not overlap.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/activation.cuh"
#include "kernels/moe_route.cuh"
#include "kernels/mxfp4_stream.cuh"

namespace nibble::kernels {

// The routing of the block's m tokens in shared memory: read from ids and weights [m, top_k], or
// with logits routed here, warp i taking token i (route_token with kPerLane experts a lane). The
// caller synchronises (the runner's first barrier) before anything reads it. kPerLane is the
// launcher's smallest fit for the model's experts (1 for gpt-oss-20b's 32), 0 when the ids come
// from a routing launch, so that only the kernels that route carry the routing code. With it the
// down kernel once took 15.6 µs a call on the H100 against 10.6: at 102-108 registers a thread its
// 9-warp blocks fit one an SM (a scheduler's quarter of the registers holds 4 such warps), where
// 96 fit two; the launcher now bounds down for two blocks (backend/cuda/ops.cu).
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

// The experts' descriptors in shared memory (kExperts of them, 0: none), copied by one warp
// before the PDL wait (weights: no predecessor wrote them), so that the first copy after the
// routing follows the expert id without another L2 trip. The kernels that route from a folded
// router's sums take it (kMxfp4FoldSums).
template <int kExperts>
struct Mxfp4ExpertTable {
  Mxfp4Device e[kExperts > 0 ? kExperts : 1];

  __device__ __forceinline__ void stage(const Mxfp4Device* __restrict__ experts, int64_t n_experts) {
    if constexpr (kExperts > 0)
      for (int64_t i = threadIdx.x % 32; i < n_experts; i += 32) e[i] = experts[i];
  }
};

// Gate/up: items are (slot, 16-row tile of 2·inter), slot-major; x holds the m = slots / top_k
// tokens' normed rows, written before the router (two launches back), so they are staged before
// the wait; the routing after it (the router's logits come from the previous kernel). The
// epilogue adds the biases and writes the clamped SwiGLU of the tile's 8 (gate, up) pairs to act
// as f16 in the down projection's staged order.
// One token through a router folded into the MXFP4 o GEMV (router_fold.cuh): its row comes
// staged by o, xg (f16, x · γ / 16), the products scaled by 16 / rms.
enum Mxfp4MoeFold : int {
  kMxfp4NoFold = 0,
  // A routing launch after o wrote ids, weights and x_scale (= 16 / rms): gate/up copies xg
  // (written two launches back) before its wait.
  kMxfp4FoldLaunch = 1,
  // No routing launch: gate/up routes from the sums after its wait (o is its predecessor) and
  // copies xg then; down routes from them before its wait (two launches back).
  kMxfp4FoldSums = 2,
};

// What the streamed MoE kernels read ahead of their epilogues (early_reads, a mask), so that an
// item's last step is not a DRAM or L2 round trip after its products: the tiles' biases copied
// with them (Mxfp4StreamTile::bias; gpt-oss's experts have them) and down's output rows read as
// its products start.
enum Mxfp4EarlyReads : unsigned { kMxfp4EarlyBias = 1, kMxfp4EarlyOut = 2, kMxfp4EarlyAll = 3 };

// kFold: Mxfp4MoeFold. With kMxfp4FoldSums, kRoutePerLane sizes the routing (experts a lane) and
// racc / router_bias are the folded router's sums and bias. kClaim: the blocks claim the items past
// their first `stages` (mxfp4_stream's kClaim) from claim[0..1], 0 before the launch and after it.
template <int W, int kMinBlocks = 1, int kRoutePerLane = 0, int kFold = kMxfp4NoFold, bool kClaim = false>
__global__ void __launch_bounds__(32 * (W + 1), kMinBlocks) moe_mxfp4_gate_up_stream_kernel(
    const Mxfp4Device* __restrict__ gate_up, const int32_t* __restrict__ g_ids, const float* __restrict__ logits,
    int64_t n_experts, const float* __restrict__ x, const __half* __restrict__ xg, const float* __restrict__ x_scale,
    __half* __restrict__ act, int64_t slots, int64_t top_k, int64_t inter, int64_t hidden, float alpha, float limit,
    int stages, RouterAcc racc, const float* __restrict__ router_bias, unsigned* __restrict__ claim,
    unsigned early_reads) {
  NIBBLE_TIMELINE_BLOCK(kMoeGateUp);
  const bool stage_bias = early_reads & kMxfp4EarlyBias;
  const int64_t tiles = 2 * inter / 16;
  __half* xs = reinterpret_cast<__half*>(dynamic_smem() + mxfp4_stream_extra_offset(hidden, stages, W));
  if constexpr (kFold == kMxfp4NoFold)
    mxfp4_stage_x(XRows<kGemvMaxM, false>{x, hidden, int(slots / top_k), nullptr, {}}, hidden, xs);
  else if constexpr (kFold == kMxfp4FoldLaunch)
    copy_staged_rows(xg, 1, hidden, mxfp4_x_stride(hidden), xs);
  constexpr bool kSums = kFold == kMxfp4FoldSums;
  __shared__ Mxfp4StreamRouting<kRoutePerLane> routing;
  __shared__ Mxfp4ExpertTable<kSums ? 32 * kRoutePerLane : 0> table;
  __shared__ float s_factor;
  const int warp = threadIdx.x / 32;
  if (kSums && warp == W) table.stage(gate_up, n_experts);
  pdl_wait();
  NIBBLE_TIMELINE_WAITED();
  float factor = 1.f;
  if constexpr (kSums) {
    // The producer warp routes (it issues the first copies once the block's barrier passes) while
    // the consumers copy the row: the two L2 trips overlap. Only that warp reads the sums; the
    // others take the factor from shared memory. (This, the table and the two-unit copy together
    // measured a tie against every warp reading Σh² and the descriptors read from global memory,
    // BENCHMARKS.md.)
    if (warp == W) {
      const float inv =
          route_token_folded<kRoutePerLane>(racc, router_bias, n_experts, top_k, false, routing.ids, nullptr);
      if (threadIdx.x % 32 == 0) s_factor = kRouterFoldRowInvScale * inv;
    } else {
      constexpr int kUnits = 2;  // 16-byte units a thread, loaded before any is stored
      const int units = int(hidden / 8);
      for (int u0 = threadIdx.x; u0 < units; u0 += kUnits * 32 * W) {
        uint4 v[kUnits];
#pragma unroll
        for (int j = 0; j < kUnits; ++j)
          if (u0 + j * 32 * W < units) v[j] = __ldcg(reinterpret_cast<const uint4*>(xg) + u0 + j * 32 * W);
#pragma unroll
        for (int j = 0; j < kUnits; ++j)
          if (u0 + j * 32 * W < units) reinterpret_cast<uint4*>(xs)[u0 + j * 32 * W] = v[j];
      }
    }
  } else {
    routing.load(g_ids, nullptr, logits, n_experts, false, slots / top_k, top_k);
    if constexpr (kFold == kMxfp4FoldLaunch) factor = *x_scale;
  }
  NIBBLE_TIMELINE_MARK();  // thread 0's row copied (folded sums) or the routing read
  const int32_t* ids = routing.ids;
  mxfp4_stream<W, false, false, kPdlGateUp, kClaim>(
      slots * tiles, 1, hidden, stages,
      [&](int64_t it, int) {
        const Mxfp4Device d = kSums ? table.e[ids[it / tiles]] : gate_up[ids[it / tiles]];
        const int64_t row0 = it % tiles * 16;
        return Mxfp4StreamTile{{d.codes, d.scales}, row0, stage_bias ? mxfp4_stageable_bias(d.bias, row0) : nullptr};
      },
      [&](int64_t it, int) {
        const int64_t tok = slots == top_k ? 0 : it / tiles / top_k;  // one token: no division a tile
        return Mxfp4StreamInput{reinterpret_cast<const uint4*>(xs + tok * mxfp4_x_stride(hidden)) + threadIdx.x % 4,
                                kSums ? s_factor : factor};
      },
      [&](int64_t it, const float(&partial)[W][16], const Mxfp4StagedBias& staged, float) {
        const int jj = threadIdx.x % 32;
        if (jj >= 8) return;
        const int64_t slot = it / tiles, j = it % tiles * 8 + jj;
        float gate = 0.f, up = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) gate += partial[w][2 * jj], up += partial[w][2 * jj + 1];
        if (staged.mask & 1u) {
          gate += staged.v[0][2 * jj], up += staged.v[0][2 * jj + 1];
        } else if (const float* bias = kSums ? table.e[ids[slot]].bias : gate_up[ids[slot]].bias) {
          gate += bias[2 * j], up += bias[2 * j + 1];
        }
        act[slot * inter + mxfp4_x_half(j)] = __float2half_rn(clamped_swiglu(gate, up, alpha, limit));
      },
      Mxfp4NoPrologue{},
      [&](int event) {
        if (event > 0) NIBBLE_TIMELINE_MARK_AT(event);  // its wait is stamped above
      },
      claim);
}

// Down: items are (token, 16-row tile of hidden), each the token's top_k slots in turn. The
// routing (or the router's logits, routed here) was written two launches back, so the first
// stages load before the wait.
// out = (accumulate ? out : 0) + Σ_slot weight · (down rows · act + bias).
// kFoldedSums: one token routed from a folded router's sums (racc, router_bias; kRoutePerLane
// experts a lane), before the wait as the ids would be: o wrote them two launches back.
template <int W, int kMinBlocks = 1, int kRoutePerLane = 0, bool kFoldedSums = false>
__global__ void __launch_bounds__(32 * (W + 1), kMinBlocks) moe_mxfp4_down_stream_kernel(
    const Mxfp4Device* __restrict__ down, const int32_t* __restrict__ g_ids, const float* __restrict__ g_weights,
    const float* __restrict__ logits, int64_t n_experts, bool normalize, const __half* __restrict__ act,
    float* __restrict__ out, int64_t m, int64_t top_k, int64_t inter, int64_t hidden, bool accumulate, int stages,
    RouterAcc racc, const float* __restrict__ router_bias, unsigned early_reads) {
  NIBBLE_TIMELINE_BLOCK(kMoeDown);
  const bool stage_bias = early_reads & kMxfp4EarlyBias, preload_out = accumulate && (early_reads & kMxfp4EarlyOut);
  const int64_t tiles = hidden / 16;
  __shared__ Mxfp4StreamRouting<kRoutePerLane> routing;
  __shared__ Mxfp4ExpertTable<kFoldedSums ? 32 * kRoutePerLane : 0> table;
  if constexpr (kFoldedSums) {  // warp 0 routes while the producer copies the table
    if (threadIdx.x < 32)
      route_token_folded<kRoutePerLane>(racc, router_bias, n_experts, top_k, normalize, routing.ids, routing.weights);
    else if (threadIdx.x / 32 == W)
      table.stage(down, n_experts);
  } else {
    routing.load(g_ids, g_weights, logits, n_experts, normalize, m, top_k);
  }
  NIBBLE_TIMELINE_MARK_AT(0);  // the routing in shared memory (this warp's part), before the first copies
  const int32_t* ids = routing.ids;
  const float* weights = routing.weights;
  mxfp4_stream<W, true, true, kPdlDown>(
      m * tiles, int(top_k), inter, stages,
      [&](int64_t it, int l) {
        const int32_t e = ids[it / tiles * top_k + l];
        const Mxfp4Device d = kFoldedSums ? table.e[e] : down[e];
        const int64_t row0 = it % tiles * 16;
        return Mxfp4StreamTile{{d.codes, d.scales}, row0, stage_bias ? mxfp4_stageable_bias(d.bias, row0) : nullptr};
      },
      [&](int64_t it, int l) {
        const int64_t slot = (m == 1 ? 0 : it / tiles) * top_k + l;  // one token: no division a tile
        return Mxfp4StreamInput{reinterpret_cast<const uint4*>(act + slot * inter) + threadIdx.x % 4, weights[slot]};
      },
      [&](int64_t it, const float(&partial)[W][16], const Mxfp4StagedBias& staged, float pre) {
        const int r = threadIdx.x % 32;
        if (r >= 16) return;
        const int64_t tok = it / tiles, row = it % tiles * 16 + r;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) total += partial[w][r];
        for (int64_t l = 0; l < top_k; ++l) {
          const float weight = weights[tok * top_k + l];
          if (l < kMxfp4StagedBiasTiles && (staged.mask >> l & 1u))
            total = fmaf(weight, staged.v[l][r], total);
          else if (const float* bias = kFoldedSums ? table.e[ids[tok * top_k + l]].bias : down[ids[tok * top_k + l]].bias)
            total = fmaf(weight, bias[row], total);
        }
        float* dst = out + tok * hidden + row;
        *dst = (accumulate ? (preload_out ? pre : *dst) : 0.f) + total;
      },
      Mxfp4NoPrologue{},
      [&](int event) {
        if (event == 0)
          NIBBLE_TIMELINE_WAITED();
        else
          NIBBLE_TIMELINE_MARK_AT(event);
      },
      nullptr,
      [&](int64_t it) {  // the output rows this item adds to, read as its products start
        const int r = threadIdx.x % 32;
        return preload_out && r < 16 ? out[it / tiles * hidden + it % tiles * 16 + r] : 0.f;
      });
}

}  // namespace nibble::kernels
