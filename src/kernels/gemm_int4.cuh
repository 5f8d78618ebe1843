// W4A16 tensor-core GEMM for prefill (m > 8 activation rows): y[m, n] = x[m, k] · Wᵀ (+ bias), x f32
// row-major, W INT4 in the warp-interleaved layout of the decode kernels (kernels/gemv.cuh; there
// is only that copy in memory), f16 scales and u8 zeros [n][n_groups] (zeros null: symmetric, 8).
// K % 256 == 0; group size a power of two >= 32 or the whole K. The same core serves the grouped
// MoE GEMMs (mode kMoeGateUp / kMoeDown): A rows gathered through an expert-sorted order, the
// expert picked per tile from a device-side table.
//
// The k order (gemm_layout.h) makes the fixed weight layout mma-friendly: the K loop runs over
// stages (chunk c, half h) of 128 k, 8 mma steps each (one per nibble j). Per block and stage:
//  - W: each column's 16 words (c, lane 16h + 4σ + t) go to shared memory by 4-byte cp.async
//    (the 16-byte unit of the layout holds 4 chunks of one lane, so a 128-k stage only owns one
//    word of it; cp.async.ca keeps the unit in L1 for the 3 sibling stages). kWStages deep, so
//    the weight stream, which is the DRAM traffic, runs 3 stages ahead.
//  - A: x is f32, so it cannot be copied raw: each thread loads its 8-float units of stage s+1 into
//    registers while the warps compute stage s (register double buffering, in A_PARTS parts that
//    each overlap a part of the steps), converts them to f16, puts them in mma order (one 16-byte
//    store per unit) and stores them into the other buffer.
//  - scales/zeros: per chunk, each column's (scale², (1024 + zero)²) f16 pairs for the 8 steps,
//    staged the same way into a double buffer (one chunk = two stages).
// Each thread stages one A row and one W column for the whole K loop (one pointer each). Per half
// stage a thread reads its 4 words per n-tile (one 16-byte load) and pairs them with two prmt;
// per step it builds the two B registers with one lop3 each (f16 bits 0x6400 | q = 1024 + q, no
// conversion instruction), an exact subtraction of 1024 + z and one multiply by the f16 scale.
//
// Scale before the mma (rather than per-group partial sums scaled in f32 afterwards): one set of
// accumulators (registers decide occupancy here) and no per-group FFMA pass, which for 32-wide
// groups would be 4 FFMA per mma, more issue slots than the dequantisation itself. The price is one
// f16 rounding of (q - z)·s, relative 2^-11 at most, the same order as the unavoidable f16
// rounding of the activations; tests/ops/gemm_test.cpp derives the tolerance from both.
//
// Tiles (Int4GemmTile): BM x BN per block, warps WARPS_M x WARPS_N, each warp (BM/WARPS_M) x
// (BN/WARPS_N) as 16x8 mma tiles. Rows past m and columns past n read a clamped valid row/column
// and are not stored, so m and n are arbitrary.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/gemm_layout.h"
#include "kernels/int4_weight.cuh"
#include "kernels/mma.cuh"

namespace nibble::kernels {

enum class GemmInt4Mode {
  kPlain,      // y[m, n] = x · Wᵀ + bias
  kMoeGateUp,  // y[p, n] = silu(x[token(p)] · gateᵀ) · (x[token(p)] · upᵀ) for sorted rows p of a tile
  kMoeDown,    // y[p, n] = x[p] · downᵀ
};


struct GemmInt4Params {
  const float* x;
  float* y;
  const float* bias;   // kPlain only; may be null
  int64_t m, n, k;     // MoE: m = sorted rows (tokens · top_k), n = output columns
  Int4Weight w;          // kPlain
  // MoE: the tile table made by moe_group_scan_kernel (kernels/moe_prefill.cuh).
  const Int4Weight* expert_a;  // gate (kMoeGateUp) or down (kMoeDown), per expert
  const Int4Weight* expert_b;  // up (kMoeGateUp)
  const int2* tiles;         // (expert, first sorted row) per tile
  const int32_t* n_tiles;
  const int32_t* offsets;       // [n_experts + 1]: expert e owns sorted rows offsets[e]..offsets[e+1]
  const int32_t* sorted_token;  // kMoeGateUp: the token of each sorted row
};

template <int BM_, int BN_, int WARPS_M, int WARPS_N, int MIN_BLOCKS, int A_PARTS>
struct Int4GemmTile {
  static constexpr int kBM = BM_, kBN = BN_, kWarpsM = WARPS_M, kWarpsN = WARPS_N, kMinBlocks = MIN_BLOCKS;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int kWarpM = BM_ / WARPS_M, kWarpN = BN_ / WARPS_N;
  static constexpr int kMTiles = kWarpM / 16, kNTiles = kWarpN / 8;
  static constexpr int kWStages = 4;
  // A: a stage row is 16 units of 8 floats, kAUnits per thread. They are loaded in A_PARTS parts,
  // each in flight (8 registers a unit) during 8 / A_PARTS of the stage's mma steps: fewer parts
  // hide more latency, more parts cost fewer registers.
  static constexpr int kThreadsPerRow = kThreads / BM_;  // A staging: threads sharing a row
  static constexpr int kAUnits = 16 / kThreadsPerRow;
  static constexpr int kASplit = A_PARTS;
  static constexpr int kAUnitsPerPart = kAUnits / kASplit;
  static constexpr int kABytes = BM_ * 256;            // one A stage: [BM][128] f16
  static constexpr int kWBytes = BN_ * 64;             // one W stage: [BN][16] words
  static constexpr int kSZBytes = BN_ * 8 * 8;         // one chunk: [8 steps][BN] (scale², (1024+z)²)
  static constexpr int kSmemBytes = 2 * kABytes + kWStages * kWBytes + 2 * kSZBytes;
  static_assert(kThreads == 2 * BN_, "W staging gives each thread half a column");
  static_assert(kThreadsPerRow * BM_ == kThreads && 16 % kThreadsPerRow == 0, "A staging: whole rows per thread group");
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "a warp covers whole mma tiles (and gate/up pairs)");
  static_assert(kAUnits % kASplit == 0 && 8 % kASplit == 0);
};

template <class Tile, GemmInt4Mode Mode>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks) gemm_int4_kernel(GemmInt4Params p) {
  constexpr int BM = Tile::kBM, BN = Tile::kBN;
  constexpr int kMT = Tile::kMTiles, kNT = Tile::kNTiles, kWStages = Tile::kWStages;
  constexpr int kASplit = Tile::kASplit, kStepsPerPart = kGemmStepsPerStage / kASplit;
  constexpr int kThreadsPerRow = Tile::kThreadsPerRow;
  // Gate and up share a block: W rows [0, BN/2) are gate columns, [BN/2, BN) the same up columns,
  // and a warp's first kNT/2 n-tiles are gate, the rest up, so one thread holds both factors of
  // each output it writes.
  constexpr bool kDual = Mode == GemmInt4Mode::kMoeGateUp;
  constexpr int kOutCols = kDual ? BN / 2 : BN;

  uint8_t* smem = dynamic_smem();
  uint8_t* a_smem = smem;
  uint32_t* w_smem = reinterpret_cast<uint32_t*>(smem + 2 * Tile::kABytes);
  uint2* sz_smem = reinterpret_cast<uint2*>(smem + 2 * Tile::kABytes + kWStages * Tile::kWBytes);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / Tile::kWarpsN, warp_n = warp % Tile::kWarpsN;
  const int g = lane / 4, t = lane % 4;

  int64_t row0, row_end;
  Int4Weight wa, wb;
  if constexpr (Mode == GemmInt4Mode::kPlain) {
    row0 = int64_t(blockIdx.x) * BM;
    row_end = p.m;
    wa = wb = p.w;
  } else {
    if (int(blockIdx.x) >= *p.n_tiles) return;  // the grid is sized for the worst case
    const int2 tile = p.tiles[blockIdx.x];
    row0 = tile.y;
    row_end = p.offsets[tile.x + 1];
    wa = p.expert_a[tile.x];
    wb = kDual ? p.expert_b[tile.x] : wa;
  }
  const int rows_valid = int(row_end - row0 < BM ? row_end - row0 : BM);
  const int64_t n = p.n, k = p.k, col0 = int64_t(blockIdx.y) * kOutCols;
  const int shift = int(wa.group_shift), chunks = int(k / 256);

  // Staging roles, fixed for the whole K loop so each thread keeps one row pointer per operand:
  // A row a_r (gathered for MoE; rows past the end clamp to the last valid one, their outputs are
  // never stored) and W row w_r with its words of t = 2·w_half, 2·w_half + 1 and the (scale, zero)
  // pairs of steps 4·w_half .. 4·w_half + 3.
  const int a_r = tid / kThreadsPerRow;
  const float* a_src;
  {
    const int64_t row = row0 + (a_r < rows_valid ? a_r : rows_valid - 1);
    a_src = p.x + (Mode == GemmInt4Mode::kMoeGateUp ? int64_t(p.sorted_token[row]) : row) * k;
  }
  const int w_r = tid / 2, w_half = tid % 2;
  const uint8_t* w_src;
  const __half* sz_scales;
  const uint8_t* sz_zeros;
  {
    const bool second = kDual && w_r >= BN / 2;  // an up column
    const Int4Weight& w = second ? wb : wa;
    int64_t col = col0 + (second ? w_r - BN / 2 : w_r);
    col = col < n ? col : n - 1;
    w_src = w.codes + col * (k / 2);
    sz_scales = w.scales + col * w.n_groups;
    sz_zeros = w.zeros ? w.zeros + col * w.n_groups : nullptr;
  }

  auto issue_w = [&](int s) {
    const int c = s / 2, c0 = c / 4 * 4, words = chunks - c0 < 4 ? chunks - c0 : 4;
    const uint8_t* src = w_src + (c0 * 128 + (c - c0) * 4);  // int4_word_offset(chunks, c, lane) - lane·4·words
    uint32_t* dst = w_smem + (s % kWStages) * BN * 16 + w_r * 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int tw = 2 * w_half + i / 4, sigma = i % 4;
      cp_async_4(smem_addr(dst + gemm_w_word(w_r, tw, sigma)), src + gemm_b_word_lane(s % 2, sigma, tw) * 4 * words);
    }
  };

  float4 a_regs[Tile::kAUnitsPerPart][2];
  auto load_a = [&](int s, int part) {
    const float* src = a_src + (256 * (s / 2) + 16 * (s % 2));
#pragma unroll
    for (int i = 0; i < Tile::kAUnitsPerPart; ++i) {
      const int u = gemm_a_stage_unit(tid, kThreadsPerRow, part * Tile::kAUnitsPerPart + i);  // 2j + kh
      const float4* v = reinterpret_cast<const float4*>(src + 32 * (u / 2) + 8 * (u % 2));
      a_regs[i][0] = v[0];
      a_regs[i][1] = v[1];
    }
  };
  auto store_a = [&](int buf, int part) {
    uint8_t* dst = a_smem + buf * Tile::kABytes + a_r * 256;
#pragma unroll
    for (int i = 0; i < Tile::kAUnitsPerPart; ++i) {
      const int u = gemm_a_stage_unit(tid, kThreadsPerRow, part * Tile::kAUnitsPerPart + i);
      // Input e of the unit goes to half gemm_a_kappa(kh, e) % 8: pairs (0, 4), (1, 5), (2, 6), (3, 7).
      const float4 lo = a_regs[i][0], hi = a_regs[i][1];
      *reinterpret_cast<uint4*>(dst + gemm_a_unit_swizzle(a_r, u) * 16) =
          make_uint4(pack_f16x2(lo.x, hi.x), pack_f16x2(lo.y, hi.y), pack_f16x2(lo.z, hi.z), pack_f16x2(lo.w, hi.w));
    }
  };

  uint32_t sz_regs[4];  // scale bits | zero << 16
  auto load_sz = [&](int c) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int group = (256 * c + 32 * (4 * w_half + jj)) >> shift;
      sz_regs[jj] = __half_as_ushort(sz_scales[group]) | (sz_zeros ? uint32_t(sz_zeros[group]) : 8u) << 16;
    }
  };
  auto store_sz = [&](int buf) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const uint32_t v = sz_regs[jj];
      sz_smem[(buf * 8 + 4 * w_half + jj) * BN + w_r] =
          make_uint2((v & 0xFFFFu) * 0x10001u, (0x6400u | v >> 16) * 0x10001u);
    }
  };

  auto w_row_of = [&](int nt) {  // this thread's W row (B column g) of n-tile nt
    if constexpr (kDual)
      return (nt < kNT / 2 ? 0 : BN / 2) + warp_n * (Tile::kWarpN / 2) + (nt % (kNT / 2)) * 8 + g;
    else
      return warp_n * Tile::kWarpN + nt * 8 + g;
  };

  // ldmatrix addresses: the rows a thread points at (lane % 16 of each 16-row tile) share row % 8,
  // so the swizzle is one per-thread constant: unit (2j + lane / 16) ^ f = ((lane / 16) ^ f) ^ 2j
  // for j < 4 (and + 8 units for j >= 4), an XOR with an immediate per step.
  const uint32_t a_lane_offset = (warp_m * Tile::kWarpM + ldsm_a_row(lane)) * 256 +
                                 gemm_a_unit_swizzle(ldsm_a_row(lane), ldsm_a_khalf(lane)) * 16;  // kWarpM % 16 == 0

  float acc[kMT][kNT][4] = {};
  // Per n-tile, nibbles 4h'..4h'+3 (h' = j / 4: one half of the steps at a time) of words σ = 0, 1
  // and of σ = 2, 3, paired up so one lop3 gives a B register (gemm_layout.h).
  uint32_t wx[kNT][2];
  auto compute = [&](int s, int part) {
    const uint32_t a_base = smem_addr(a_smem + (s % 2) * Tile::kABytes);
    const uint32_t* ws = w_smem + (s % kWStages) * BN * 16;
    const uint2* sz = sz_smem + (s / 2 % 2) * 8 * BN;
#pragma unroll
    for (int jj = 0; jj < kStepsPerPart; ++jj) {
      const int j = part * kStepsPerPart + jj;
      if (j % 4 == 0) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const int row = w_row_of(nt);
          const uint4 v = *reinterpret_cast<const uint4*>(ws + row * 16 + gemm_w_word(row, t, 0));
          const uint32_t sel = j < 4 ? 0x5410 : 0x7632;
          wx[nt][0] = __byte_perm(v.x, v.y, sel);
          wx[nt][1] = __byte_perm(v.z, v.w, sel);
        }
      }
      uint32_t af[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
        ldmatrix_x4(af[mt], a_base + ((a_lane_offset ^ (32 * (j % 4))) + 128 * (j / 4) + 16 * 256 * mt));
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint2 q = sz[j * BN + w_row_of(nt)];
        const int shift_j = 4 * (j % 4);
        const uint32_t b0 = f16x2_sub_mul(nibbles_to_f16x2_plus_1024(wx[nt][0] >> shift_j), q.y, q.x);
        const uint32_t b1 = f16x2_sub_mul(nibbles_to_f16x2_plus_1024(wx[nt][1] >> shift_j), q.y, q.x);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) mma_f16(acc[mt][nt], af[mt], b0, b1);
      }
    }
  };

  // Pipeline: W kWStages - 1 stages ahead by cp.async (one commit group per stage, empty past the
  // end so the wait count stays fixed); A and the scales one stage ahead through registers.
  const int n_stages = int(2 * chunks);
#pragma unroll
  for (int s = 0; s < kWStages - 1; ++s) {
    if (s < n_stages) issue_w(s);
    cp_async_commit();
  }
#pragma unroll
  for (int part = 0; part < kASplit; ++part) {
    load_a(0, part);
    store_a(0, part);
  }
  load_sz(0);
  store_sz(0);
  cp_async_wait<kWStages - 2>();
  __syncthreads();

  for (int s = 0; s < n_stages; ++s) {
    if (s + kWStages - 1 < n_stages) issue_w(s + kWStages - 1);
    cp_async_commit();
    const bool next = s + 1 < n_stages, next_sz = next && (s + 1) % 2 == 0;
#pragma unroll
    for (int part = 0; part < kASplit; ++part) {
      if (next) load_a(s + 1, part);
      if (part == 0 && next_sz) load_sz((s + 1) / 2);
      compute(s, part);
      if (next) store_a((s + 1) % 2, part);
    }
    if (next_sz) store_sz((s + 1) / 2 % 2);
    cp_async_wait<kWStages - 2>();
    __syncthreads();
  }

  // Epilogue straight from the accumulators: thread (g, t) holds rows g, g + 8 and columns 2t, 2t + 1
  // of each 16x8 tile; a warp's stores cover 32 contiguous bytes per row.
  const bool vec2 = n % 2 == 0 && reinterpret_cast<uintptr_t>(p.y) % 8 == 0;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * Tile::kWarpM + mt * 16 + g + 8 * half;
      if (r >= rows_valid) continue;
      float* y_row = p.y + (row0 + r) * n;
      if constexpr (kDual) {
#pragma unroll
        for (int nt = 0; nt < kNT / 2; ++nt) {
          const int64_t col = col0 + warp_n * (Tile::kWarpN / 2) + nt * 8 + 2 * t;
          float v[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float gate = acc[mt][nt][2 * half + e], up = acc[mt][nt + kNT / 2][2 * half + e];
            v[e] = gate / (1.f + expf(-gate)) * up;
          }
          store_pair(y_row, col, n, vec2, v[0], v[1]);
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const int64_t col = col0 + warp_n * Tile::kWarpN + nt * 8 + 2 * t;
          float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
          if (p.bias) {
            if (col < n) v0 += p.bias[col];
            if (col + 1 < n) v1 += p.bias[col + 1];
          }
          store_pair(y_row, col, n, vec2, v0, v1);
        }
      }
    }
}

}  // namespace nibble::kernels
