// MoE prefill without host round trips: the routing (ids [m, top_k]) is grouped by expert on the
// GPU, the grouped GEMMs (gemm_int4.cuh, modes kMoeGateUp / kMoeDown) run over an expert-sorted
// order of the (token, slot) pairs, and a combine kernel adds each token's slots back.
//
// Sorted order: expert by expert; within an expert, ascending token (a token picks an expert at
// most once). It is computed with integers only, so it is deterministic:
//   mark:  bit t of mask[t / 32][e] is set when token t chose expert e (atomicOr on words:
//          the result does not depend on the order);
//   scan:  one thread per expert counts its tokens word by word, keeping the running count before
//          each word (prefix[w][e]); block-wide scans give offsets[e] (first sorted row of expert
//          e) and each expert's first tile; tiles are (expert, first row) for every BM rows;
//   place: pair (t, s) with expert e sits at offsets[e] + prefix[t / 32][e] + (bits of mask[t/32][e]
//          below t % 32).
// Masks and prefixes are [word][expert], so the scan's threads read consecutive addresses.
#pragma once

#include <cstdint>

namespace nibble::kernels {

constexpr int kMoeGroupThreads = 512;  // one thread per expert: kMoeMaxExperts

__global__ void moe_group_mark_kernel(const int32_t* __restrict__ ids, int64_t pairs, int64_t top_k,
                                      int64_t n_experts, uint32_t* __restrict__ mask) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const int64_t token = i / top_k;
  atomicOr(&mask[(token / 32) * n_experts + ids[i]], 1u << (token % 32));
}

// Exclusive prefix sum over the block (blockDim.x a multiple of 32, at most 1024); total = the sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int& total) {
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  int inclusive = v;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int s = lane < n_warps ? warp_sums[lane] : 0;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, s, offset);
      if (lane >= offset) s += other;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const int result = inclusive - v + (warp > 0 ? warp_sums[warp - 1] : 0);
  total = warp_sums[n_warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return result;
}

__global__ void __launch_bounds__(kMoeGroupThreads) moe_group_scan_kernel(
    const uint32_t* __restrict__ mask, int64_t words, int64_t n_experts, int bm, int32_t* __restrict__ prefix,
    int32_t* __restrict__ offsets, int2* __restrict__ tiles, int32_t* __restrict__ n_tiles) {
  const int e = threadIdx.x;
  int count = 0;
  if (e < n_experts)
    for (int64_t w = 0; w < words; ++w) {
      prefix[w * n_experts + e] = count;
      count += __popc(mask[w * n_experts + e]);
    }
  int total_rows, total_tiles;
  const int first_row = block_exclusive_scan(count, total_rows);
  const int tiles_e = (count + bm - 1) / bm;
  const int first_tile = block_exclusive_scan(tiles_e, total_tiles);
  if (e < n_experts) offsets[e] = first_row;
  for (int i = 0; i < tiles_e; ++i) tiles[first_tile + i] = make_int2(e, first_row + i * bm);
  if (e == 0) {
    offsets[n_experts] = total_rows;
    *n_tiles = total_tiles;
  }
}

__global__ void moe_group_place_kernel(const int32_t* __restrict__ ids, int64_t pairs, int64_t top_k,
                                       int64_t n_experts, const uint32_t* __restrict__ mask,
                                       const int32_t* __restrict__ prefix, const int32_t* __restrict__ offsets,
                                       int32_t* __restrict__ sorted_token, int32_t* __restrict__ pair_row) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const int64_t token = i / top_k, e = ids[i], w = (token / 32) * n_experts + e;
  const uint32_t below = mask[w] & ((1u << (token % 32)) - 1u);
  const int32_t row = offsets[e] + prefix[w] + __popc(below);
  sorted_token[row] = int32_t(token);
  pair_row[i] = row;
}

// out[t] = Σ_s weight[t, s] · down[pair_row[t, s]], slots in order: no atomics, deterministic.
// One thread per 4 columns (hidden % 4 == 0).
__global__ void moe_combine_kernel(const float* __restrict__ down, const int32_t* __restrict__ pair_row,
                                   const float* __restrict__ weights, int64_t m, int64_t top_k, int64_t hidden,
                                   float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, quads = hidden / 4;
  if (i >= m * quads) return;
  const int64_t token = i / quads, q = i % quads;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t s = 0; s < top_k; ++s) {
    const float wt = weights[token * top_k + s];
    const float4 v = reinterpret_cast<const float4*>(down + int64_t(pair_row[token * top_k + s]) * hidden)[q];
    acc.x += wt * v.x, acc.y += wt * v.y, acc.z += wt * v.z, acc.w += wt * v.w;
  }
  reinterpret_cast<float4*>(out)[i] = acc;
}

}  // namespace nibble::kernels
