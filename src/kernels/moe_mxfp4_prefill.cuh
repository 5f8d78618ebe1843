// gpt-oss's MoE block for prefill (more tokens than the decode kernels take) with MXFP4 experts and
// the routing on the device: the (token, slot) pairs are grouped by expert (kernels/moe_prefill.cuh,
// shared with the INT4 path), then two grouped GEMMs on the tensor cores and the weighted combine:
//   gate/up: act[p] = SwiGLU_clamped(x[token(p)] · gate_upᵀ + b) for each sorted row p, as f16 in
//            the staged order (mxfp4_x_half) that the down GEMM copies without conversion;
//   down:    y[p] = act[p] · downᵀ + b, f32, summed per token by moe_combine_kernel in slot order.
//
// The decode kernels' scheme (kernels/gemv_mxfp4.cuh) with more tokens: the weights are the mma's
// A (16 rows a tile), the tokens its B columns (8 a tile), a 32-k block's two mma steps summed with
// C = 0 and scaled into the f32 accumulators by the block's E8M0 scale (no range limit, weights
// exact in f16). A block owns WARPS x MT weight tiles and one tile of BN = 8·NT sorted rows of one
// expert; each warp MT weight tiles and all BN rows, so every dequantised A fragment serves NT mma
// pairs and every B fragment MT. Both operands go to shared memory by cp.async, STAGES groups
// (128 k) ahead: the weight rows raw in the decode layout (a partial last group re-spaced to the
// full one by 4-byte copies, so the compute has one form), the rows of x (or act) as staged f16.
// Weights are read once per row tile of BN pairs, from L2 for all but the first: blockIdx.x runs
// over the row tiles, so the tiles of one expert and one weight block run side by side.
//
// Scales folded into the weights (kFoldScale, the default where a matrix set allows it): the f32
// scaling above costs 4 FMAs per 16x8 tile and block plus a fresh accumulator, the decode kernels'
// price for an unlimited scale range. Where every scale of the experts lies in 2^-23 .. 2^1 (E8M0
// 104 .. 128; gpt-oss's are in there), an E2M1 value times its scale is exact in f16 (subnormals
// included), so each A fragment is multiplied by its block's scale as f16 (one mul per two
// weights, shared by the NT tiles) and the mmas accumulate in place over all of K. The launcher
// checks the range on the device once per expert set (mxfp4_scales_outside_kernel).
//
// Gate/up rows are interleaved in the checkpoint (row 2j gate j, 2j + 1 up j); the A rows are
// loaded from any row we like, so a tile's mma rows 0..7 are the gate rows of 8 features and rows
// 8..15 their up rows: the thread holding gate (row g) also holds up (row g + 8) of the same
// feature and tokens, and the SwiGLU needs no exchange.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/activation.cuh"
#include "kernels/gemm_layout.h"
#include "kernels/mma.cuh"
#include "kernels/mxfp4.cuh"

namespace nibble::kernels {

// x f32 [rows][k] -> f16 [rows][k] in the staged order (mxfp4_x_half), the gate/up GEMM's input.
// One thread per 8 inputs (k % 8 == 0).
__global__ void mxfp4_stage_rows_kernel(const float* __restrict__ x, int64_t rows, int64_t k,
                                        __half* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * k / 8) return;
  const float4 lo = reinterpret_cast<const float4*>(x)[2 * i], hi = reinterpret_cast<const float4*>(x)[2 * i + 1];
  const float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  reinterpret_cast<uint4*>(out)[i] = mxfp4_staged_unit(f);
}

struct Mxfp4MoeGemmParams {
  const __half* x;             // staged rows, row stride k: gate/up the tokens (gathered), down act
  const Mxfp4Device* experts;  // gate_up [2n][k] or down [n][k], per expert
  const int2* tiles;           // (expert, first sorted row) per row tile (moe_group_scan_kernel)
  const int32_t* n_tiles;
  const int32_t* offsets;       // [n_experts + 1]: expert e owns sorted rows offsets[e] .. offsets[e + 1]
  const int32_t* sorted_token;  // gate/up: the token of each sorted row
  int64_t n, k;                 // output features (gate/up: inter), inputs
  __half* act;                  // gate/up: [pairs][n], staged order
  float* y;                     // down: [pairs][n]
  float alpha, limit;           // gate/up: the clamped SwiGLU
};

// The decode layout's biased scale bytes (mxfp4_decode_scale: E8M0 + 14) that kFoldScale takes.
constexpr uint8_t kMxfp4FoldScaleMin = 104 + 14, kMxfp4FoldScaleMax = 128 + 14;

// Sets *outside when a scale byte of [count] lies outside the folding range (padding slots hold
// 127 + 14, inside it).
__global__ void mxfp4_scales_outside_kernel(const uint8_t* __restrict__ scales, int64_t count,
                                            unsigned* __restrict__ outside) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count && (scales[i] < kMxfp4FoldScaleMin || scales[i] > kMxfp4FoldScaleMax)) *outside = 1u;
}

template <bool kGateUp_, int WARPS, int MT, int NT, int STAGES, int MIN_BLOCKS>
struct Mxfp4MoeTile {
  static constexpr bool kGateUp = kGateUp_;
  static constexpr int kWarps = WARPS, kMT = MT, kNT = NT, kStages = STAGES, kMinBlocks = MIN_BLOCKS;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kRows = 16 * WARPS * MT;           // A rows a block
  static constexpr int kFeatures = kGateUp ? kRows / 2 : kRows;  // outputs a block
  static constexpr int kBN = 8 * NT;                      // sorted rows a tile
  static constexpr int kXStride = 320;                    // bytes per staged row of a group: 256 + 64 (banks)
  static constexpr int kWBytes = kRows * 64, kSBytes = kRows * 4, kXBytes = kBN * kXStride;
  static constexpr int kStageBytes = kWBytes + kSBytes + kXBytes;
  static constexpr int kSmemBytes = STAGES * kStageBytes;
};

template <class Tile, bool kFoldScale>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks) gemm_mxfp4_moe_kernel(Mxfp4MoeGemmParams p) {
  constexpr int MT = Tile::kMT, NT = Tile::kNT, BN = Tile::kBN, R = Tile::kRows, STAGES = Tile::kStages;
  constexpr bool kGateUp = Tile::kGateUp;
  if (int(blockIdx.x) >= *p.n_tiles) return;  // the grid is sized for the worst case
  const int2 tile = p.tiles[blockIdx.x];
  const int64_t row0 = tile.y;
  const int rows_valid = int(min(int64_t(BN), int64_t(p.offsets[tile.x + 1]) - row0));
  const Mxfp4Device ex = p.experts[tile.x];
  const int64_t k = p.k, groups = mxfp4_groups(k), f0 = int64_t(blockIdx.y) * Tile::kFeatures;
  const int64_t n_rows = kGateUp ? 2 * p.n : p.n;  // rows of the weight matrix

  uint8_t* smem = dynamic_smem();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  // The weight row behind A row r of the block: (warp tile r / 16, mma row r % 16).
  auto weight_row = [&](int r) {
    int64_t row;
    if constexpr (kGateUp)
      row = 2 * (f0 + (r / 16) * 8 + r % 8) + (r % 16) / 8;
    else
      row = f0 + r;
    return row < n_rows ? row : n_rows - 1;  // rows past the end are read, never stored
  };
  auto x_row = [&](int i) {
    const int64_t row = row0 + (i < rows_valid ? i : rows_valid - 1);
    return kGateUp ? int64_t(p.sorted_token[row]) : row;
  };

  const int64_t code_stride = k / 2, scale_stride = mxfp4_scale_stride(k);
  auto issue = [&](int64_t q) {
    uint8_t* st = smem + int(q % STAGES) * Tile::kStageBytes;
    const int r = mxfp4_group_blocks(k, q);
    // Weights: a row's group is 4r words; a partial one (r < 4, the last) is re-spaced word by word.
    if (r == 4) {
      for (int u = tid; u < R * 4; u += Tile::kThreads)
        cp_async_16_zfill(smem_addr(st + 16 * u), ex.codes + weight_row(u / 4) * code_stride + 64 * q + 16 * (u % 4),
                          true);
    } else {
      for (int u = tid; u < R * 4 * r; u += Tile::kThreads) {
        const int row = u / (4 * r), w = u % (4 * r) / r, b = u % r;
        cp_async_4(smem_addr(st + 64 * row + 4 * (4 * w + b)),
                   ex.codes + weight_row(row) * code_stride + 64 * q + 4 * (r * w + b));
      }
    }
    for (int u = tid; u < R; u += Tile::kThreads)
      cp_async_4(smem_addr(st + Tile::kWBytes + 4 * u), ex.scales + weight_row(u) * scale_stride + 4 * q);
    // Activations: 4r units of 16 bytes a row.
    uint8_t* xs = st + Tile::kWBytes + Tile::kSBytes;
    for (int u = tid; u < BN * 4 * r; u += Tile::kThreads) {
      const int i = u / (4 * r), c = u % (4 * r);
      cp_async_16_zfill(smem_addr(xs + i * Tile::kXStride + 16 * c), p.x + x_row(i) * k + 128 * q + 8 * c, true);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

  auto compute = [&](int64_t q) {
    const uint8_t* st = smem + int(q % STAGES) * Tile::kStageBytes;
    const uint8_t* xs = st + Tile::kWBytes + Tile::kSBytes;
    const int r = mxfp4_group_blocks(k, q);
    uint4 wv[MT][2];
    uint32_t sv[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = (warp * MT + mt) * 16 + g + 8 * h;
        wv[mt][h] = *reinterpret_cast<const uint4*>(st + 64 * row + 16 * t);
        sv[mt][h] = *reinterpret_cast<const uint32_t*>(st + Tile::kWBytes + 4 * row);
      }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      if (b >= r) break;
      uint4 xv[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        xv[nt] = *reinterpret_cast<const uint4*>(xs + (nt * 8 + g) * Tile::kXStride + 16 * (4 * b + t));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[2][4];  // [step]: a0, a1 row g / g + 8 of the low pair, a2, a3 of the high
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t word = b == 0 ? wv[mt][h].x : b == 1 ? wv[mt][h].y : b == 2 ? wv[mt][h].z : wv[mt][h].w;
          uint32_t pairs[4];
          mxfp4_decode_word(word, pairs);
#pragma unroll
          for (int pp = 0; pp < 4; ++pp) a[pp / 2][2 * (pp % 2) + h] = pairs[pp];
        }
        if constexpr (kFoldScale) {
          // value · 2^-14 times 2^(e - 127 + 14) as f16: exponent field (byte - 127) + 15.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t field = ((sv[mt][h] >> (8 * b)) & 0xFFu) - 112u, s2 = (field << 10) | (field << 26);
#pragma unroll
            for (int st = 0; st < 2; ++st)
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                uint32_t& v = a[st][2 * r + h];
                asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(v) : "r"(s2));
              }
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            mma_f16(acc[mt][nt], a[0], xv[nt].x, xv[nt].y);
            mma_f16(acc[mt][nt], a[1], xv[nt].z, xv[nt].w);
          }
        } else {
          const float s0 = mxfp4_group_scale(sv[mt][0], b), s1 = mxfp4_group_scale(sv[mt][1], b);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma_f16(d, a[0], xv[nt].x, xv[nt].y);
            mma_f16(d, a[1], xv[nt].z, xv[nt].w);
            acc[mt][nt][0] = fmaf(d[0], s0, acc[mt][nt][0]), acc[mt][nt][1] = fmaf(d[1], s0, acc[mt][nt][1]);
            acc[mt][nt][2] = fmaf(d[2], s1, acc[mt][nt][2]), acc[mt][nt][3] = fmaf(d[3], s1, acc[mt][nt][3]);
          }
        }
      }
    }
  };

  // Pipeline: STAGES - 1 groups in flight (one commit group each, empty past the end so the wait
  // count stays fixed); the stage refilled at q was last read at q - 1, before this q's barrier.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < groups) issue(s);
    cp_async_commit();
  }
  for (int64_t q = 0; q < groups; ++q) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (q + STAGES - 1 < groups) issue(q + STAGES - 1);
    cp_async_commit();
    compute(q);
  }

  // Epilogue. Thread (g, t) holds, per warp tile and n-tile, mma rows g and g + 8 of sorted rows
  // 2t, 2t + 1 of the n-tile.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int tile_r = (warp * MT + mt) * 16;
    if constexpr (kGateUp) {
      const int64_t f = f0 + tile_r / 2 + g;  // rows g (gate) and g + 8 (up) of feature f
      if (f >= p.n) continue;
      const float bg = ex.bias ? ex.bias[2 * f] : 0.f, bu = ex.bias ? ex.bias[2 * f + 1] : 0.f;
      const int64_t col = mxfp4_x_half(f);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = nt * 8 + 2 * t + e;
          if (i < rows_valid)
            p.act[(row0 + i) * p.n + col] =
                __float2half_rn(clamped_swiglu(acc[mt][nt][e] + bg, acc[mt][nt][2 + e] + bu, p.alpha, p.limit));
        }
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t f = f0 + tile_r + g + 8 * h;
        if (f >= p.n) continue;
        const float bias = ex.bias ? ex.bias[f] : 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = nt * 8 + 2 * t + e;
            if (i < rows_valid) p.y[(row0 + i) * p.n + f] = acc[mt][nt][2 * h + e] + bias;
          }
      }
    }
  }
}

}  // namespace nibble::kernels
