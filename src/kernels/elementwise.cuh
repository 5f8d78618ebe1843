// Element-wise kernels on f32: SwiGLU's silu(gate)·up, residual add, and the embedding lookup that
// widens one stored row (f32/f16/bf16) per token.
#pragma once

#include <cstdint>

#include "core/hash_random.h"
#include "kernels/activation.cuh"
#include "kernels/linear.cuh"
#include "kernels/pdl.cuh"
#include "kernels/pick.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

__global__ void silu_mul_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                int64_t count, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float g = gate[i];
  out[i] = g / (1.f + expf(-g)) * up[i];
}

// gpt-oss's expert activation over gate/up rows interleaved ([rows, 2·inter]: gate_j at 2j,
// up_j at 2j + 1) into out [rows, inter]: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g),
// g = min(gate, limit) (weights.h moe_activation).
__global__ void clamped_swiglu_interleaved_kernel(const float* __restrict__ gate_up, int64_t rows, int64_t inter,
                                                  float alpha, float limit, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * inter) return;
  const float2 gu = reinterpret_cast<const float2*>(gate_up)[i];
  out[i] = clamped_swiglu(gu.x, gu.y, alpha, limit);
}

__global__ void add_kernel(const float* __restrict__ x, int64_t count, float* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] += x[i];
}

// Block (token, slice of kEmbedPerThread · blockDim.x dims): every thread's loads are issued
// before any store, so a row costs one memory round trip after the token id's. (One block a token
// striding over the row put ~12 dependent DRAM trips on the decode step's chain: 6.7 µs for
// gpt-oss's 2880 dims on the H100, the first launch of every step.)
constexpr int kEmbedPerThread = 4;

template <DenseType T>
__global__ void embed_kernel(const void* __restrict__ table, const int32_t* __restrict__ ids,
                             int64_t dim, float* __restrict__ out) {
  NIBBLE_TIMELINE_BLOCK(kEmbed);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  const int64_t t = blockIdx.x;
  const int64_t row = ids[t];
  const int64_t first = int64_t(blockIdx.y) * blockDim.x * kEmbedPerThread + threadIdx.x;
  float v[kEmbedPerThread];
#pragma unroll
  for (int j = 0; j < kEmbedPerThread; ++j) {
    const int64_t i = first + int64_t(j) * blockDim.x;
    v[j] = i < dim ? load_weight<T>(table, row * dim + i) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kEmbedPerThread; ++j) {
    const int64_t i = first + int64_t(j) * blockDim.x;
    if (i < dim) out[t * dim + i] = v[j];
  }
}

// Greedy sampling: the largest of x[r, 0..n) per row r, lowest index on ties (as
// std::max_element), in two launches: kArgmaxSplits blocks per row each reduce a slice (a vocabulary
// of 152K read by one block was a 58 µs chain of dependent loads), then one warp per row merges the
// slices' (value, index) pairs.
constexpr int kArgmaxSplits = 64;

// This thread's best of slice blockIdx.y of row blockIdx.x (kArgmaxSplits slices a row).
__device__ __forceinline__ ArgmaxBest argmax_slice_best(const float* __restrict__ x, int64_t n) {
  const int64_t slice = (n + kArgmaxSplits - 1) / kArgmaxSplits;
  const int64_t begin = blockIdx.y * slice, end = ::min(n, begin + slice);
  const float* row = x + int64_t(blockIdx.x) * n;
  ArgmaxBest best;
#pragma unroll 8
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) best.merge(row[i], int32_t(i));
  return best;
}

__global__ void argmax_partial_kernel(const float* __restrict__ x, int64_t n, float* __restrict__ part_val,
                                      int32_t* __restrict__ part_idx) {
  NIBBLE_TIMELINE_BLOCK(kArgmaxPartial);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  __shared__ ArgmaxBest s_best[32];
  const ArgmaxBest best = block_best(argmax_slice_best(x, n), s_best);
  if (threadIdx.x == 0) {
    part_val[blockIdx.x * kArgmaxSplits + blockIdx.y] = best.val;
    part_idx[blockIdx.x * kArgmaxSplits + blockIdx.y] = best.idx;
  }
}

__global__ void argmax_final_kernel(const float* __restrict__ part_val, const int32_t* __restrict__ part_idx,
                                    int32_t* __restrict__ out) {
  NIBBLE_TIMELINE_BLOCK(kArgmaxFinal);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  const ArgmaxBest best =
      warp_best_of(part_val + blockIdx.x * kArgmaxSplits, part_idx + blockIdx.x * kArgmaxSplits, kArgmaxSplits);
  if (threadIdx.x == 0) out[blockIdx.x] = best_index(best);
}

// Greedy sampling in one launch: argmax_partial_kernel's slices, then the last slice block of a
// row to finish (a counter a row, which it resets) merges the row's slices as argmax_final_kernel
// does and writes out[row]; with next_ids, also the next decode step's inputs (advance_decode:
// next_ids[row] = the pick, positions[row] + 1, and a one-row step's post). Two launches less at
// the end of every greedy decode step (gpt-oss-20b all-MXFP4 tg128 +0.2-0.5% on the H100, a tie for
// Qwen3-30B-A3B INT4: BENCHMARKS.md).
__global__ void argmax_last_block_kernel(const float* __restrict__ x, int64_t n, float* __restrict__ part_val,
                                         int32_t* __restrict__ part_idx, unsigned* __restrict__ counters,
                                         int32_t* __restrict__ out, int32_t* __restrict__ next_ids,
                                         int32_t* __restrict__ positions, DecodePost post) {
  NIBBLE_TIMELINE_BLOCK(kArgmaxPartial);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  __shared__ ArgmaxBest s_best[32];
  const unsigned r = blockIdx.x;
  const GreedyPick p{part_val + r * kArgmaxSplits, part_idx + r * kArgmaxSplits, counters + r, out + r,
                     next_ids ? next_ids + r : nullptr, next_ids ? positions + r : nullptr,
                     gridDim.x == 1 ? post : DecodePost{}};  // a one-row step's pick is posted
  greedy_pick_finish(argmax_slice_best(x, n), p, s_best, blockIdx.y, kArgmaxSplits);
}

// Backend::advance_decode: the next decode step's token ids and positions, one thread a row; with
// post, the pick of a one-row step also goes to the host (decode_post).
__global__ void advance_decode_kernel(const int32_t* __restrict__ picked, int64_t n, int32_t* __restrict__ ids,
                                      int32_t* __restrict__ positions, DecodePost post) {
  pdl_enter();
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < n) {
    const int32_t pick = picked[r];
    ids[r] = pick, positions[r] += 1;
    if (n == 1) decode_post(post, pick);
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
