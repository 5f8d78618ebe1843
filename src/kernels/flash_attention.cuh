// Causal prefill attention on the tensor cores, FlashAttention-2 style (launcher:
// backend/cuda/flash_attention.cu). Semantics of CpuBackend::attention: q [m, n_head, HD] f32,
// the paged K/V cache (backend/kv_pages.h, rows [n_head_kv, HD] of T = f32, f16 or FP8 E4M3), token t
// attends sequence positions 0..positions[t] (with a sliding window, only the last `window` of
// them), q head h reads kv head h / group, an optional sink logit per q head joins each softmax's
// denominator (gpt-oss), out [m, n_head, HD] f32.
//
// Block = 8 warps = 128 mma rows that all read one kv head: row r is (token r / group, q head
// r % group of the kv head's group), tokens blockIdx.x · (128 / group) onwards. Packing the GQA
// group's heads as rows lets every staged K/V tile serve the whole group (32 q / 4 kv heads: 16
// tokens x 8 heads per block, each K/V row read from global once per 16 tokens instead of once per
// token as in the decode kernel). Each warp owns 16 rows: S = Q·Kᵀ for a tile of kFlashBN = 32
// positions is 4 accumulator n-tiles (16 registers), O is 16 x HD f32 (HD / 2 = 64 registers for
// HD = 128), Q stays in registers as f16 A fragments (HD / 4 = 32 registers).
//
// Loop over K/V tiles from the block's first window position (0 without a window) up to its causal
// limit (max position of its rows + 1), both computed on the device; positions need not be
// ascending for correctness. Positions outside [first, limit) load as zeros: with a window, the
// older rows of a ring cache (runtime/kv_cache.h) may already hold newer positions. Each thread loads its share of
// tile i + 1 into registers (4 elements per load, in flight while tile i is computed: f32 K/V
// must be converted for the mma anyway) and stores it as f16 into the
// other of two shared stages (2 x (K + V) x 32 x HD x 2 B = 32 KB for HD = 128: no opt-in, one
// __syncthreads per tile; the stage written at tile i + 1 was last read at tile i - 1, before the
// barrier of tile i). A warp whose rows are all before the tile skips its math (causal
// diagonal), and so does one whose rows' windows all start after it. Shared rows are HD f16 = HD / 8 16-byte units, unit u of row r stored at u ^ (r % 8),
// so the 8 row addresses of each ldmatrix phase hit distinct banks.
//
// Online softmax in registers: the thread of lane l holds rows l / 4 and l / 4 + 8 of its warp
// tile, 2 columns per n-tile; the row max is reduced over the 4 threads of a quad (shuffles),
// the row sum stays per thread until the end. Scores are scaled by scale·log2(e) and exponentiated
// with exp2. P (f16) is the A operand of P·V straight from the S accumulator layout (the C
// fragment of n-tiles 2kk, 2kk+1 is the A fragment of k-step kk); V's B fragments come from
// ldmatrix.trans of the position-major tile. Rows past m (or past 128 / group tokens) get
// position -1: everything masked, nothing stored. The sink enters at the end, as the decode
// kernels' (sink_factor_log2 in kernels/mma.cuh): out = O · 2^(m - m') / (l · 2^(m - m') +
// 2^(sink - m')), m' = max(m, sink), all in the scaled log2 units of the scores.
#pragma once

#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/kv_access.cuh"
#include "kernels/mma.cuh"

namespace nibble::kernels {

constexpr int kFlashWarps = 8;
constexpr int kFlashThreads = 32 * kFlashWarps;
constexpr int kFlashRows = 16 * kFlashWarps;  // (token, head) rows per block
constexpr int kFlashBN = 32;                   // positions per K/V tile
constexpr int kFlashMaxGroup = 8;

template <int HD>
struct FlashTile {
  static_assert(HD % 32 == 0 && HD <= 128);
  static constexpr int kUnits = HD / 8;                       // 16-byte units per f16 row
  static constexpr int kTileBytes = kFlashBN * HD * 2;        // one f16 K (or V) tile
  static constexpr int kStageBytes = 2 * kTileBytes;          // K then V
  static constexpr int kSmemBytes = 2 * kStageBytes + 64;     // two stages + the warps' maxima and minima
  static constexpr int kLoads = kFlashBN * HD / 4 / kFlashThreads;  // 4-element loads of K (and of V) per thread
  static_assert(kLoads * 4 * kFlashThreads == kFlashBN * HD);
};

// Byte offset of 16-byte unit `unit` of row `row` in a tile (XOR swizzle within groups of 8 units).
__device__ __forceinline__ uint32_t flash_offset(int row, int unit, int units) {
  return uint32_t((row * units + (unit ^ (row & 7))) * 16);
}

// grid (ceil(m / (kFlashRows / group)), n_head_kv), kFlashThreads threads, FlashTile<HD>::kSmemBytes
// of dynamic shared memory. q, k, v 16-byte aligned (float4 / float2 accesses).
template <int HD, typename T>
__global__ void __launch_bounds__(kFlashThreads, 1)
    flash_attention_prefill_kernel(const float* __restrict__ q, const T* __restrict__ k,
                                   const T* __restrict__ v, const int32_t* __restrict__ block_table,
                                   int block_size_log2, float* __restrict__ out,
                                   const int32_t* __restrict__ positions, int m, int n_head, int n_head_kv,
                                   int group, float scale_log2, const float* __restrict__ sinks, int window) {
  using Tile = FlashTile<HD>;
  constexpr float kInf = __builtin_huge_valf();
  uint8_t* smem = dynamic_smem();
  int* warp_max = reinterpret_cast<int*>(smem + 2 * Tile::kStageBytes);
  int* warp_min = warp_max + kFlashWarps;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  const int tokens = kFlashRows / group;
  const int kv = int(blockIdx.y);
  const int64_t t_base = int64_t(blockIdx.x) * tokens;

  // This thread's two rows: g and g + 8 of the warp tile; row_lo: the first position each sees.
  int row_pos[2], row_lo[2], row_head[2];
  const float* qrow[2];
  float* orow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h, tl = r / group, hg = r % group;
    const int64_t t = t_base + tl;
    const bool valid = tl < tokens && t < m;
    const int64_t off = (t * n_head + int64_t(kv) * group + hg) * HD;
    row_pos[h] = valid ? positions[t] : -1;
    row_lo[h] = valid && window > 0 ? max(0, row_pos[h] - window + 1) : valid ? 0 : INT_MAX;
    row_head[h] = kv * group + hg;
    qrow[h] = valid ? q + off : nullptr;
    orow[h] = valid ? out + off : nullptr;
  }
  // Causal and window limits: the warp's (uniform, for skipping math) and the block's (tiles to stage).
  int wmax = max(row_pos[0], row_pos[1]), wmin = min(row_lo[0], row_lo[1]);
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, o));
    wmin = min(wmin, __shfl_xor_sync(0xffffffffu, wmin, o));
  }
  if (lane == 0) warp_max[warp] = wmax, warp_min[warp] = wmin;

  // Q as f16 A fragments: a[r] = Q[row g + 8(r % 2)][16s + 8(r / 2) + 2·t4 + e].
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int s = 0; s < HD / 16; ++s)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float* row = qrow[r % 2];
      const float2 x = row ? *reinterpret_cast<const float2*>(row + 16 * s + 8 * (r / 2) + 2 * t4)
                           : make_float2(0.f, 0.f);
      qf[s][r] = pack_f16x2(x.x, x.y);
    }
  __syncthreads();
  int block_max = warp_max[0], block_min = warp_min[0];
#pragma unroll
  for (int w = 1; w < kFlashWarps; ++w) block_max = max(block_max, warp_max[w]), block_min = min(block_min, warp_min[w]);
  // Cache rows the block reads: [lo_ctx, n_ctx); other rows of its tiles are zero-filled.
  const int n_ctx = block_max + 1, lo_ctx = block_min < n_ctx ? block_min : 0;
  const int first_tile = lo_ctx / kFlashBN, n_tiles = (n_ctx + kFlashBN - 1) / kFlashBN;

  // Four consecutive elements of a row per load, kept as loaded and converted to f16 only when
  // stored to shared memory (the next iteration): an E4M3 or f32 conversion on arrival would wait
  // for the load right there and serialise the next tile's fetch with this tile's math (E4M3
  // prefill at depth 8192 ran 24% slower than f16 that way).
  using Raw = std::conditional_t<sizeof(T) == 1, uint32_t, std::conditional_t<sizeof(T) == 2, uint2, float4>>;
  Raw pre_k[Tile::kLoads], pre_v[Tile::kLoads];
  auto load4 = [](const T* p) { return *reinterpret_cast<const Raw*>(p); };
  auto to_f16 = [](const Raw& r) {
    if constexpr (sizeof(T) == 1)
      return make_uint2(e4m3x2_to_f16x2(uint16_t(r)), e4m3x2_to_f16x2(uint16_t(r >> 16)));
    else if constexpr (sizeof(T) == 2)
      return r;
    else
      return make_uint2(pack_f16x2(r.x, r.y), pack_f16x2(r.z, r.w));
  };
  auto load_tile = [&](int n0) {
#pragma unroll
    for (int c = 0; c < Tile::kLoads; ++c) {
      const int f = int(threadIdx.x) + c * kFlashThreads, row = f / (HD / 4), c4 = f % (HD / 4), j = n0 + row;
      if (j >= lo_ctx && j < n_ctx) {
        const int64_t off = (kv_pool_row(block_table, block_size_log2, j) * n_head_kv + kv) * HD + 4 * c4;
        pre_k[c] = load4(k + off);
        pre_v[c] = load4(v + off);
      } else {
        pre_k[c] = Raw{};
        pre_v[c] = Raw{};
      }
    }
  };
  auto store_tile = [&](int stage) {
    uint8_t* kb = smem + stage * Tile::kStageBytes;
#pragma unroll
    for (int c = 0; c < Tile::kLoads; ++c) {
      const int f = int(threadIdx.x) + c * kFlashThreads, row = f / (HD / 4), c4 = f % (HD / 4);
      const uint32_t off = flash_offset(row, c4 / 2, Tile::kUnits) + 8 * (c4 % 2);
      *reinterpret_cast<uint2*>(kb + off) = to_f16(pre_k[c]);
      *reinterpret_cast<uint2*>(kb + Tile::kTileBytes + off) = to_f16(pre_v[c]);
    }
  };

  float o[HD / 8][4];
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float row_m[2] = {-kInf, -kInf}, row_l[2] = {0.f, 0.f};

  // ldmatrix lane roles. K (non-trans, n-major B tiles): matrix i = n-tile i / 2, k half i % 2.
  // V (trans, k-major): matrix i = positions 8(i % 2).., dims 8(i / 2)..
  const int k_row = lane / 16 * 8 + lane % 8, k_half = lane / 8 % 2;
  const int v_row = lane / 8 % 2 * 8 + lane % 8, v_half = lane / 16;

  if (first_tile < n_tiles) load_tile(first_tile * kFlashBN);
  for (int it = first_tile; it < n_tiles; ++it) {
    const int stage = (it - first_tile) & 1, n0 = it * kFlashBN;
    store_tile(stage);
    __syncthreads();
    if (it + 1 < n_tiles) load_tile(n0 + kFlashBN);
    // Every row of this warp is before the tile, or its window starts after it (warp-uniform).
    if (n0 > wmax || n0 + kFlashBN <= wmin) continue;

    const uint32_t kbase = smem_addr(smem + stage * Tile::kStageBytes), vbase = kbase + Tile::kTileBytes;
    float s[kFlashBN / 8][4];
#pragma unroll
    for (int nt = 0; nt < kFlashBN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks)
#pragma unroll
      for (int np = 0; np < kFlashBN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, kbase + flash_offset(16 * np + k_row, 2 * ks + k_half, Tile::kUnits));
        mma_f16(s[2 * np], qf[ks], b[0], b[1]);
        mma_f16(s[2 * np + 1], qf[ks], b[2], b[3]);
      }

    // Mask (position j after the row's position or before its window), scale, online softmax.
    float mx[2] = {-kInf, -kInf};
#pragma unroll
    for (int nt = 0; nt < kFlashBN / 8; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int j = n0 + 8 * nt + 2 * t4 + c % 2;
        const float x = j <= row_pos[c / 2] && j >= row_lo[c / 2] ? s[nt][c] * scale_log2 : -kInf;
        s[nt][c] = x;
        mx[c / 2] = fmaxf(mx[c / 2], x);
      }
    online_softmax_tile(s, mx, row_m, row_l, o);

    // O += P·V, P from the accumulators: k-step kk covers n-tiles 2kk (k 0..7) and 2kk + 1 (8..15).
#pragma unroll
    for (int kk = 0; kk < kFlashBN / 16; ++kk) {
      const uint32_t a[4] = {pack_f16x2(s[2 * kk][0], s[2 * kk][1]), pack_f16x2(s[2 * kk][2], s[2 * kk][3]),
                             pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vbase + flash_offset(16 * kk + v_row, 2 * dp + v_half, Tile::kUnits));
        mma_f16(o[2 * dp], a, b[0], b[1]);
        mma_f16(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  // O / l (l summed over the quad); rows of position >= 0 always have l >= 1. With a sink, the
  // denominator's extra term (see the top).
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(row_l[h]);
    const float sink = sinks ? sinks[row_head[h]] * 1.4426950408889634f : -__builtin_huge_valf();
    inv[h] = orow[h] ? sink_factor_log2(row_m[h], l, sink) : 0.f;  // a row not stored: nothing
  }
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) {
    const int col = 8 * d + 2 * t4;
    if (orow[0]) *reinterpret_cast<float2*>(orow[0] + col) = make_float2(o[d][0] * inv[0], o[d][1] * inv[0]);
    if (orow[1]) *reinterpret_cast<float2*>(orow[1] + col) = make_float2(o[d][2] * inv[1], o[d][3] * inv[1]);
  }
}

}  // namespace nibble::kernels
