// Decode products of MXFP4 weights (m <= 8 activation rows) on the tensor cores: gpt-oss's experts,
// and q/k/v, o and the lm_head when they are quantized at load. The INT4 kernels' scheme
// (kernels/gemv_mma.cuh): the weights are the mma's A (16 output rows), the activation rows its B
// (M <= 8 columns, the rest zero), A straight from global memory into registers, B from shared
// memory where the block staged x as f16.
//
// Layout (made at upload, backend/cuda: Mxfp4Layout::kDecode). Per row the k/32 blocks of 16
// bytes go in groups of 4 (128 k, 64 bytes; a last group may hold 1..3); word w of block b of a
// group of r blocks is stored at byte 4 · (r · w + b) of the group. Thread t of a quad loads word t
// of each block of a group with one 16-byte load; the quad reads 64 contiguous bytes. Scales: a
// row's scales padded to 4 per group, so a group's are one 32-bit word, and biased (mxfp4_decode_scale).
//
// An mma step takes all 16 of its k from one block: the word of thread t holds codes 8t .. 8t + 7
// of the block; its pairs (p, p + 4) of codes become f16x2 values, pairs 0 and 1 the first step's
// A, pairs 2 and 3 the second's. So the block's scale multiplies the two steps' sums afterwards,
// in f32: no range limit on the E8M0 scale, and the weights themselves are exact in f16.
// E2M1 to f16 bits: the 3 magnitude bits at f16 bits 11..9 and the sign at 15 give exactly
// value · 2^-14 (exponent field 0..3 and the top mantissa bit: normal and subnormal alike), so
// the scale applied is 2^(e - 127 + 14). The activations are staged so that a thread's B values
// of a block are one 16-byte shared load (mxfp4_x_half).
// The bits of each word are also rearranged at upload (mxfp4_encode_word) so that the four f16x2
// of a word cost 11 integer operations instead of ~20 (a microbenchmark on the H100: +40% words
// decoded per second; in the MoE kernels, whose limit was occupancy, 4%: BENCHMARKS.md).
//
// Precision: the activations are rounded to f16 (relative 2^-11), products and sums in f32: the
// INT4 mma kernels' tolerance.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/gemm_layout.h"
#include "kernels/gemv.cuh"
#include "kernels/mma.cuh"
#include "kernels/mxfp4.cuh"
#include "kernels/pdl.cuh"
#include "kernels/router_fold.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

// Rows g and g + 8 of a tile, one group, as thread t of its quad holds them.
struct Mxfp4Group {
  uint32_t w[2][4];  // [row][block]: word t of the block
  uint32_t s[2];     // the group's 4 scales of each row
};

// Group q of rows g and g + 8 of a tile: codes + row · k/2 and the row's scale words (row_codes,
// row_scales, computed once a tile). A whole group (q < k / 128) is one 16-byte load a row; the
// last group of a k that is not a multiple of 128 holds r < 4 blocks, word w of block b at 4 (r·w + b).
__device__ __forceinline__ void mxfp4_group_load(const uint8_t* const (&row_codes)[2],
                                                 const uint32_t* const (&row_scales)[2], int64_t k, int q, bool whole,
                                                 Mxfp4Group& gr) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint8_t* base = row_codes[h] + 64 * q;
    if (whole) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(base) + t);  // evict-first, as gemv_mma.cuh
      gr.w[h][0] = v.x, gr.w[h][1] = v.y, gr.w[h][2] = v.z, gr.w[h][3] = v.w;
    } else {
      const int r = mxfp4_group_blocks(k, q);
#pragma unroll
      for (int b = 0; b < 4; ++b) gr.w[h][b] = b < r ? __ldcs(reinterpret_cast<const uint32_t*>(base) + r * t + b) : 0u;
    }
    gr.s[h] = __ldcs(row_scales[h] + q);
  }
}

// acc += the group's products. xb: this thread's 16-byte units of its column's staged row (+ t).
// kWhole: a whole group (4 blocks), no per-block bounds; otherwise `blocks` of them.
template <bool kWhole = false>
__device__ __forceinline__ void mxfp4_group_dot(const Mxfp4Group& gr, int q, int blocks, const uint4* xb,
                                                float (&acc)[4]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    if (!kWhole && b >= blocks) break;
    const uint4 xv = xb[4 * (4 * q + b)];  // a block is 32 halves: 4 units
    uint32_t a[2][4];                  // [step]: a0, a1 row g / g + 8 of the low pair, a2, a3 of the high
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t pairs[4];
      mxfp4_decode_word(gr.w[h][b], pairs);
#pragma unroll
      for (int p = 0; p < 4; ++p) a[p / 2][2 * (p % 2) + h] = pairs[p];
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_f16(d, a[0], xv.x, xv.y);
    mma_f16(d, a[1], xv.z, xv.w);
    const float s0 = mxfp4_group_scale(gr.s[0], b), s1 = mxfp4_group_scale(gr.s[1], b);
    acc[0] = fmaf(d[0], s0, acc[0]), acc[1] = fmaf(d[1], s0, acc[1]);
    acc[2] = fmaf(d[2], s1, acc[2]), acc[3] = fmaf(d[3], s1, acc[3]);
  }
}

// A warp's share of one tile: groups kw, kw + KS, ... of rows tile0 + g, tile0 + g + 8 (clamped
// to n - 1: rows past n are read, never stored), B groups a batch. The first batch is loaded by
// `start` (before pdl_wait), the rest by `finish`. kDouble: each batch's loads are issued before
// the products of the previous one. With B = 4 that doubled the registers and spilled (MoE down
// 25 µs a call against 18, gate/up 46 against 26); with B = 2 it holds what the single-buffered
// 4-group batch holds and was faster alone (gate/up 24.5, down 16.6 µs: the MoE kernels' default,
// backend/cuda/ops.cu), as for the GEMV over an lm_head; the GEMV's projections keep 4 groups
// single-buffered.
constexpr int kMxfp4Batch = 4;

template <bool kDouble, int B = kMxfp4Batch>
struct Mxfp4Tile {
  Mxfp4Group gr[B];
  const uint8_t* row_codes[2];  // rows g and g + 8 of the tile (clamped to n - 1)
  const uint32_t* row_scales[2];
  int64_t k, groups;
  int kw, ks, whole;

  __device__ __forceinline__ void load_batch(int64_t q0, Mxfp4Group (&dst)[B]) {
#pragma unroll
    for (int i = 0; i < B; ++i) {
      const int q = int(q0) + i * ks;
      if (q < groups) mxfp4_group_load(row_codes, row_scales, k, q, q < whole, dst[i]);
    }
  }

  __device__ __forceinline__ void start(const Mxfp4Weight& w, int64_t tile0, int64_t n, int64_t k_, int kw_,
                                        int ks_) {
    const int g = threadIdx.x % 32 / 4;
    k = k_, kw = kw_, ks = ks_, groups = mxfp4_groups(k_), whole = int(k_ / 128);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = tile0 + g + 8 * h < n ? tile0 + g + 8 * h : n - 1;
      row_codes[h] = w.codes + row * (k_ / 2);
      row_scales[h] = reinterpret_cast<const uint32_t*>(w.scales + row * mxfp4_scale_stride(k_));
    }
    load_batch(kw, gr);
  }

  __device__ __forceinline__ void finish(const uint4* xb, float (&acc)[4]) {
    const int64_t step = int64_t(ks) * B;
    for (int64_t q0 = kw; q0 < groups; q0 += step) {
      Mxfp4Group next[B];
      if constexpr (kDouble) {
        if (q0 + step < groups) load_batch(q0 + step, next);
      } else {
        if (q0 != kw) load_batch(q0, gr);
      }
#pragma unroll
      for (int i = 0; i < B; ++i) {
        const int q = int(q0) + i * ks;
        if (q < whole)
          mxfp4_group_dot<true>(gr[i], q, 4, xb, acc);
        else if (q < groups)
          mxfp4_group_dot(gr[i], q, mxfp4_group_blocks(k, q), xb, acc);
      }
      if constexpr (kDouble) {
        if (q0 + step < groups)
#pragma unroll
          for (int i = 0; i < B; ++i) gr[i] = next[i];
      }
    }
  }
};

// Stages rows mi < m of x (RMS-normalised when kNorm: xr.inv must be set) into shared memory as
// f16 in mxfp4_x_half order, row mi at xs + mi · mxfp4_x_stride(k): 8 inputs a thread, whose
// permuted halves are one 16-byte unit of the staged row.
template <int M, bool kNorm>
__device__ __forceinline__ void mxfp4_stage_x(const XRows<M, kNorm>& xr, int64_t k, __half* xs) {
  const int per_row = int(k / 8), total = xr.m * per_row;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int mi = idx / per_row;
    const int64_t k0 = 8 * int64_t(idx % per_row);
    float f[8];
    xr.template load<8>(mi, k0, f);
    *reinterpret_cast<uint4*>(xs + mi * mxfp4_x_stride(k) + k0) = mxfp4_staged_unit(f);
  }
}

// One token's row normalised and staged in one pass over x when it fits kMxfp4OnePassUnits float4s
// a thread (stage_row_one_pass: x and the norm's weights read together, one L2 round trip), else
// block_inv_rms and mxfp4_stage_x (two). The two passes took 4.25 µs from the PDL wait to the
// staged row in gpt-oss's q/k/v GEMV (2880 wide, 128 threads; in-kernel timeline, H100).
constexpr int kMxfp4OnePassUnits = 6;  // a 2880-wide row over 128 threads
template <int M, bool kNorm>
__device__ __forceinline__ void mxfp4_stage_x_normed(XRows<M, kNorm>& xr, int64_t k, float eps, __half* xs) {
  if constexpr (kNorm) {
    auto put = [&](int k0, float4 u) {
      xs[mxfp4_x_half(k0)] = __float2half_rn(u.x), xs[mxfp4_x_half(k0 + 1)] = __float2half_rn(u.y);
      xs[mxfp4_x_half(k0 + 2)] = __float2half_rn(u.z), xs[mxfp4_x_half(k0 + 3)] = __float2half_rn(u.w);
    };
    if (xr.m == 1 && stage_row_one_pass<kMxfp4OnePassUnits>(xr.x, xr.norm, k, eps, put)) return;
  }
  block_inv_rms(xr, k, eps);
  mxfp4_stage_x(xr, k, xs);
}

// This thread's B units: column g (= lane / 4) of the staged rows. Columns past m read row m - 1
// (their sums are never stored; each output column of an mma depends on its B column only), so the
// inner loop has no predicated loads.
__device__ __forceinline__ const uint4* mxfp4_x_units(const __half* xs, int64_t k, int m) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  return reinterpret_cast<const uint4*>(xs + (g < m ? g : m - 1) * mxfp4_x_stride(k)) + t;
}

// y[m, n] (+)= norm?(x[m, k]) · Wᵀ (+ b), m <= kGemvMaxM. A block has NTB 16-row tiles × KS warps
// along K; warp (nt, kw) takes groups kw, kw + KS, ... of tile nt. Blocks stride over the tiles when
// the grid is smaller than n / (16 · NTB) (an lm_head: x is staged once a block, not once for every
// 16 · NTB rows), the next tile's first batch loaded before the block sums the current one.
// kBatch: groups a warp loads at once; when it covers all of a warp's groups (q/k/v's 23 over 4
// warps: 6), every weight load is issued before the PDL wait and none waits on DRAM after it.
// kFold: one token through an o projection with the MoE router folded in (router_fold.cuh): a
// grid of one block a tile; kMxfp4FoldSelfRouted: its successor is MoE gate/up routing from the
// sums (no routing launch), released at the wait (kernels/moe_mxfp4_stream.cuh).
constexpr int kMxfp4FoldSelfRouted = 2;
template <bool kNorm, int KS, int NTB, bool kDouble, int kBatch = kDouble ? 2 : kMxfp4Batch, int kFold = 0>
__global__ void __launch_bounds__(32 * KS * NTB) gemv_mxfp4_mma_kernel(Mxfp4Weight w, const float* __restrict__ bias,
                                                                       const float* __restrict__ x,
                                                                       float* __restrict__ y, int m, int64_t n,
                                                                       int64_t k, GemvIo io, RouterFold fold) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int nt = warp / KS, kw = warp % KS;
  const int64_t tiles = (n + 15) / 16, stride = int64_t(gridDim.x) * NTB;
  NIBBLE_TIMELINE_BLOCK(kGemvInt4);
  Mxfp4Tile<kDouble, kBatch> tile;
  int64_t base = int64_t(blockIdx.x) * NTB;
  if (base + nt < tiles) tile.start(w, (base + nt) * 16, n, k, kw, KS);  // weights need no predecessor
  std::conditional_t<kFold != 0, RouterFoldRows<NTB>, NoRouterFold> fold_rows;  // before the wait too
  if constexpr (kFold != 0) fold_rows.load(fold, n, base * 16);
  // The successor is released once x is staged, so the row's L2 reads do not queue behind its
  // weight loads (+1.1% a gpt-oss-20b decode step, +2.1% at depth 16384; BENCHMARKS.md). With the
  // router folded in, the routing launch is released as the blocks exit (measured best of the
  // four places, as for Qwen3's fold), and gate/up routing for itself after the products (its
  // blocks' launch then overlaps o's tail: gpt-oss-20b +0.4-0.9% against the exit, +0.3% against
  // the wait; 120b's routing launch lost 0.4-0.8% released earlier).
  constexpr int kSite = kFold ? kPdlOFold : kNorm ? kPdlQkv : kPdlO;
  constexpr PdlWhere kWhere = kFold == kMxfp4FoldSelfRouted ? kPdlAfterProducts
                              : kFold                       ? kPdlAtExit
                                                            : kPdlAfterInput;
  pdl_enter_at<kSite, kWhere>();
  NIBBLE_TIMELINE_WAITED();
  if (io.clear && blockIdx.x == 0)  // a folded router's sums, read by the kernels this one waited for
    for (int i = threadIdx.x; i < io.clear_count; i += blockDim.x) io.clear[i] = 0;
  TileStore<KS, NTB> store;
  store.load(bias, y, m, n, io.accumulate, base);
  XRows<kGemvMaxM, kNorm> xr{x, k, m, io.norm, {}};
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  mxfp4_stage_x_normed(xr, k, io.eps, xs);
  __syncthreads();
  NIBBLE_TIMELINE_MARK();
  pdl_trigger_at<kSite, kWhere>(kPdlAfterInput);
  __shared__ float partial[NTB][KS][kGemvMaxM][16];  // [tile][warp along K][token][row]
  for (;;) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (base + nt < tiles) tile.finish(mxfp4_x_units(xs, k, m), acc);
    pdl_trigger_at<kSite, kWhere>(kPdlAfterProducts);
    const int64_t next = base + stride;
    if (next + nt < tiles) tile.start(w, (next + nt) * 16, n, k, kw, KS);
    if (2 * t < m) partial[nt][kw][2 * t][g] = acc[0], partial[nt][kw][2 * t][g + 8] = acc[2];
    if (2 * t + 1 < m) partial[nt][kw][2 * t + 1][g] = acc[1], partial[nt][kw][2 * t + 1][g + 8] = acc[3];
    __syncthreads();
    if constexpr (kFold != 0) {
      // The router's share of this block's rows (m = 1: thread j stores row j).
      __shared__ float s_gh[16 * NTB], s_hh[16 * NTB];
      store.store(partial, y, m, n, [&](int r, int, float h) {
        const float gamma = fold_rows.gamma;
        s_gh[r] = gamma * h, s_hh[r] = h * h;
        fold.xg[mxfp4_x_half(base * 16 + r)] = __float2half_rn(gamma * h * (1.f / kRouterFoldRowInvScale));
      });
      __syncthreads();
      fold_rows.add(fold, s_gh, s_hh);
      return;
    }
    store.store(partial, y, m, n);
    if (next >= tiles) break;
    base = next;
    store.load(bias, y, m, n, io.accumulate, base);
    __syncthreads();  // partial is rewritten by the next tile
  }
}

// Checkpoint (row-major) MXFP4 -> the decode layout (words moved and their bits rearranged, scales
// biased by 14): one thread per 4-byte word of codes, then one per padded scale slot.
__global__ void mxfp4_relayout_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                      uint8_t* __restrict__ out_codes, uint8_t* __restrict__ out_scales, int64_t n,
                                      int64_t k) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t words = k / 8, stride = mxfp4_scale_stride(k);
  if (idx < n * words) {
    const int64_t row = idx / words, byte = 4 * (idx % words);
    *reinterpret_cast<uint32_t*>(out_codes + row * (k / 2) + mxfp4_decode_byte(k, byte)) =
        mxfp4_encode_word(*reinterpret_cast<const uint32_t*>(codes + row * (k / 2) + byte));
  }
  if (idx < n * stride) {
    const int64_t row = idx / stride, slot = idx % stride;
    out_scales[idx] = mxfp4_decode_scale(slot < k / 32 ? scales[row * (k / 32) + slot] : uint8_t(127));
  }
}

// Decode-layout MXFP4 -> BF16 rows [n][k] (exact: 3 significant bits and an 8-bit exponent), for
// the tensor-core GEMM of prefill shapes. One thread per word: 8 codes.
__global__ void mxfp4_dequant_bf16_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                                          __nv_bfloat16* __restrict__ out, int64_t n, int64_t k) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, words = k / 8;
  if (idx >= n * words) return;
  const int64_t row = idx / words, byte = 4 * (idx % words);
  const uint32_t v = *reinterpret_cast<const uint32_t*>(codes + row * (k / 2) + mxfp4_decode_byte(k, byte));
  const float scale = __uint_as_float(uint32_t(scales[row * mxfp4_scale_stride(k) + byte / 16]) << 23);
  uint32_t pairs[4];
  mxfp4_decode_word(v, pairs);
  alignas(16) __nv_bfloat16 vals[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // code j: pair j % 4, low half for j < 4
    const uint16_t h = uint16_t(pairs[j % 4] >> (j < 4 ? 0 : 16));
    vals[j] = __float2bfloat16(__half2float(__ushort_as_half(h)) * scale);
  }
  *reinterpret_cast<uint4*>(out + row * k + 2 * byte) = *reinterpret_cast<const uint4*>(vals);
}

}  // namespace nibble::kernels
