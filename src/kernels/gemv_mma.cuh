// Decode products of INT4 weights (m <= 8 activation rows) on the tensor cores: the attention
// projections and the MoE experts of a decode step.
//
// Why: the CUDA-core GEMV spent ~9.6 instructions per weight (nibble extraction, an int-to-float
// trick, the fma, the x loads), so at batch 1 the INT4 GEMVs were issue-bound at 13-29% of DRAM
// bandwidth (Nsight Compute, BENCHMARKS.md). Here a thread turns two codes into an f16x2 with a
// byte permute (shared by two registers) and one lop3, subtracts (bias + zero) exactly, and one
// mma.m16n8k16 does the multiply-adds of 8 weights per thread; the scale multiplies the f32 sums
// of a group (G >= 128), or each f16x2 (G < 128): under 2 instructions per weight.
//
// The mma is used with the weights as A (16 output rows) and the activation rows as B (M <= 8
// columns, the rest zero). Thread (g, t) loads the words of rows g and g + 8 of its 16-row tile
// straight from global memory, in the warp-interleaved layout every INT4 kernel reads
// (kernels/gemv.cuh): the 16-byte units of lanes t + 4i, i = 0..7, of a group of 4 chunks (1024 k)
// are all its A values for those k. The k order that follows from it is in gemm_layout.h
// (gemv_mma_k); the activations are staged by each block into shared memory as f16 in that
// order, so a step's B fragment is one 8-byte shared load straight into the mma's registers.
//
// Work split: a warp owns one 16-row tile over one group of 4 chunks, so all its weight loads are
// issued at once, before it waits for the previous kernel (PDL), and a wave of blocks has the
// whole matrix in flight. The number of words of the group is a template parameter, so the 64
// steps are straight-line code the compiler can schedule. Warps that share a tile but own
// different groups (split K) meet in shared memory; the sum is in warp order, so results are
// deterministic.
//
// Precision: activations are rounded to f16 (relative 2^-11); q - z is exact in f16, and the
// scale multiplies it in f16 (G < 128, rounded, as the prefill GEMM gemm_int4.cuh does) or the
// word's f32 sums (G >= 128, exact up to f32); the products accumulate in f32. Tested at the
// prefill GEMM's tolerance.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/bulk_copy.cuh"
#include "kernels/gemm_layout.h"
#include "kernels/gemv.cuh"
#include "kernels/int4_weight.cuh"
#include "kernels/mma.cuh"
#include "kernels/moe_route.cuh"
#include "kernels/pdl.cuh"
#include "kernels/router_fold.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

// Scale and zero-point registers a step (jp) of a word and row: register r, half e of the step
// holds nibble 4jp + r + 2e (gemm_layout.h), 32 k apart by r and 64 by e. For G >= 128 all four
// share a group (kMmaGroupScaled): the scale multiplies the step's f32 sums, one f32 a step; for
// G = 64 the halves differ and r does not (one f16x2 a step); for G = 32 one f16x2 a register.
template <int CPG>
constexpr bool kMmaGroupScaled = CPG >= 4;
template <int CPG>
constexpr int kMmaStepSets = CPG >= 2 ? 1 : 2;

// Rows g and g + 8 of a tile, one group of 4 chunks, as thread t of its quad needs them.
template <int CPG>
struct MmaWeights {
  static constexpr int kSets = kMmaStepSets<CPG>;
  uint32_t w[2][8][4];          // [row g / g + 8][i][cc]: word (chunk 4q + cc, lane t + 4i)
  uint32_t s[2][4][2][kSets];   // [row][cc][jp][set]: f16x2 (e = 0, 1); group-scaled [row][cc][0][0] (jp = 0, 1)
  uint32_t z[2][4][2][kSets];   // f16x2 1024 + zero point (e = 0, 1)
};

// Set `set` of step jp of chunk c of a row (scales, zeros: the row's; zeros null: 8).
template <int CPG>
__device__ __forceinline__ void mma_scale_zero(const __half* scales, const uint8_t* zeros, int shift, int64_t c, int jp,
                                               int set, uint32_t& s, uint32_t& z) {
  const int64_t lo = gemv_mma_group(c, jp, set, 0, shift), hi = gemv_mma_group(c, jp, set, 1, shift);
  const uint32_t zlo = zeros ? zeros[lo] : 8u;
  if constexpr (kMmaGroupScaled<CPG>) {  // lo == hi: s is the scale's f16 bits (mma_weights_fill packs two)
    s = __half_as_ushort(scales[lo]);
    z = (0x6400u | zlo) * 0x10001u;
  } else {
    const uint32_t zhi = zeros ? zeros[hi] : 8u;
    s = uint32_t(__half_as_ushort(scales[lo])) | uint32_t(__half_as_ushort(scales[hi])) << 16;
    z = (0x6400u | zlo) | (0x6400u | zhi) << 16;
  }
}

// Words in group q of a row of k: 4, or fewer in a last partial group.
__host__ __device__ constexpr int mma_group_words(int64_t k, int64_t q) {
  return k / 256 - 4 * q >= 4 ? 4 : int(k / 256 - 4 * q);
}

// Calls f(std::integral_constant<int, words>) for words = 1..4.
template <typename F>
__device__ __forceinline__ void with_words(int words, F&& f) {
  switch (words) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// Fills mw from group q of rows g and g + 8 wherever they are: rows.codes(h) is row h's codes (its
// start), rows.scales(h) and rows.zeros(h) its scales and zero points (null: 8). load(p) reads one
// 16-byte unit or one word of codes. Global memory (mma_weights_load) and a shared-memory stage
// (kernels/int4_stream.cuh) lay a tile's rows out alike.
// kPart: WORDS (2 or 1) of the 4 words of a full group, from word w0 (a warp's share of a group
// split among several warps: MmaTile's SUB), one 8- or 4-byte load a lane and step.
template <int CPG, int WORDS, bool kPart = false, typename Rows, typename Load>
__device__ __forceinline__ void mma_weights_fill(const Rows& rows, int shift, int64_t q, Load&& load,
                                                 MmaWeights<CPG>& mw, int w0 = 0) {
  static_assert(!kPart || WORDS == 2 || WORDS == 1);
  const int t = threadIdx.x % 4;
  const int64_t c0 = 4 * q;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint8_t* base = rows.codes(h) + c0 * 128;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (kPart && WORDS == 2) {
        const uint2 v = load(reinterpret_cast<const uint2*>(base) + 2 * (t + 4 * i) + w0 / 2);
        mw.w[h][i][0] = v.x, mw.w[h][i][1] = v.y;
      } else if constexpr (kPart) {
        mw.w[h][i][0] = load(reinterpret_cast<const uint32_t*>(base) + 4 * (t + 4 * i) + w0);
      } else if constexpr (WORDS == 4) {
        const uint4 v = load(reinterpret_cast<const uint4*>(base) + t + 4 * i);
        mw.w[h][i][0] = v.x, mw.w[h][i][1] = v.y, mw.w[h][i][2] = v.z, mw.w[h][i][3] = v.w;
      } else {  // a last partial group: [lane][WORDS]
#pragma unroll
        for (int cc = 0; cc < WORDS; ++cc)
          mw.w[h][i][cc] = load(reinterpret_cast<const uint32_t*>(base) + (t + 4 * i) * WORDS + cc);
      }
    }
#pragma unroll
    for (int cc = 0; cc < WORDS; ++cc)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
#pragma unroll
        for (int set = 0; set < kMmaStepSets<CPG>; ++set)
          mma_scale_zero<CPG>(rows.scales(h), rows.zeros(h), shift, c0 + w0 + cc, jp, set, mw.s[h][cc][jp][set],
                              mw.z[h][cc][jp][set]);
    // Group-scaled, a word's two scales share a register (f16 jp 0 low, jp 1 high): registers are
    // what decides how many blocks an SM holds.
    if constexpr (kMmaGroupScaled<CPG>)
#pragma unroll
      for (int cc = 0; cc < WORDS; ++cc) mw.s[h][cc][0][0] |= mw.s[h][cc][1][0] << 16;
  }
}

// Two rows of an INT4 matrix in global memory, for mma_weights_fill.
struct MmaGlobalRows {
  const Int4Weight& w;
  const int64_t (&rows)[2];
  int64_t k;
  __device__ __forceinline__ const uint8_t* codes(int h) const { return w.codes + rows[h] * (k / 2); }
  __device__ __forceinline__ const __half* scales(int h) const { return w.scales + rows[h] * w.n_groups; }
  __device__ __forceinline__ const uint8_t* zeros(int h) const {
    return w.zeros ? w.zeros + rows[h] * w.n_groups : nullptr;
  }
};

// Issues the loads of group q (chunks 4q .. 4q + WORDS - 1) of rows[0] and rows[1]. When the codes
// are read once a step (kOnce: a GEMV, or the experts of a single token), they are loaded
// evict-first (ld.global.cs), so that the K/V rows decode attention prefetched stay in L2 (Qwen3
// INT4 at depth 8192 +7%, BENCHMARKS.md); the experts of a batch, which several tokens may share,
// are not (evict-first cost 3% at batch 8). A compile-time choice: chosen at run time, the two
// loads cost 3.6% at batch 1. Nor the scales: the warps of a row share their 32-byte sectors, which
// evict-first lost between them (−2% at depth 8192).
template <int CPG, int WORDS, bool kOnce, bool kPart = false>
__device__ __forceinline__ void mma_weights_load(const Int4Weight& w, const int64_t (&rows)[2], int64_t k,
                                                 int64_t q, MmaWeights<CPG>& mw, int w0 = 0) {
  mma_weights_fill<CPG, WORDS, kPart>(MmaGlobalRows{w, rows, k}, int(w.group_shift), q,
                                      [](const auto* p) { return kOnce ? __ldcs(p) : __ldg(p); }, mw, w0);
}

// Independent accumulators: consecutive mma of a warp would otherwise wait on each other's result
// (a ~30-cycle chain per step), and at batch 1 there are too few warps per scheduler to hide it.
constexpr int kMmaChains = 2;

// acc[chain] += A · B over group q (step (i, jp) goes to chain jp). xb: this thread's units of its
// activation column in shared memory (+ t), null when the thread's column is past m.
//
// w0: the first of the group's words mw holds (a warp's share of a split group, MmaTile's SUB).
// A register of weights is a byte permute (per step and row), one lop3 (the nibbles as 1024 + q or
// 64 + q) and one exact subtraction (of 1024 + z or 64 + z); with a group a step (G >= 128) a
// word's products accumulate apart, a chain a step, and the scale multiplies those f32 sums once,
// not every pair of weights (a mul a register before). Word by word, so that only one word's
// partial sums and zero points are live beside the weights.
template <int CPG, int WORDS>
__device__ __forceinline__ void mma_group_dot(const MmaWeights<CPG>& mw, int64_t q, const uint2* xb,
                                              float (&acc)[kMmaChains][4], int w0 = 0) {
  constexpr bool kGroup = kMmaGroupScaled<CPG>;
  constexpr int kSets = kMmaStepSets<CPG>;
  constexpr uint32_t k960 = 0x63806380u;  // f16x2 960: (1024 + z) - 960 = 64 + z
#pragma unroll
  for (int cc = 0; cc < WORDS; ++cc) {
    uint32_t z64[2][2][kSets];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
#pragma unroll
        for (int set = 0; set < kSets; ++set) z64[h][jp][set] = f16x2_sub(mw.z[h][cc][jp][set], k960);
    float part[2][4] = {};
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        uint2 b = make_uint2(0u, 0u);
        if (xb) b = xb[4 * gemv_mma_step(4 * q + w0 + cc, i, jp)];
        uint32_t a[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // a0, a2: row g; a1, a3: row g + 8
          const uint32_t bytes = bytes_to_halves(mw.w[h][i][cc], 2 * jp);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int set = kSets == 1 ? 0 : r;
            const uint32_t v = r == 0 ? f16x2_sub(nibbles_to_f16x2_plus_1024(bytes), mw.z[h][cc][jp][set])
                                      : f16x2_sub(high_nibbles_to_f16x2_plus_64(bytes), z64[h][jp][set]);
            a[2 * r + h] = kGroup ? v : f16x2_mul(v, mw.s[h][cc][jp][set]);
          }
        }
        mma_f16(kGroup ? part[jp] : acc[jp], a, b.x, b.y);
      }
    if constexpr (kGroup) {
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float sc = __half2float(__ushort_as_half(static_cast<unsigned short>(mw.s[h][cc][0][0] >> (16 * jp))));
          acc[jp][2 * h] += sc * part[jp][2 * h];
          acc[jp][2 * h + 1] += sc * part[jp][2 * h + 1];
        }
    }
  }
}

// The chains summed in order: D[rows g, g + 8][columns 2t, 2t + 1] of the tile for thread (g, t),
// as {D[g][2t], D[g][2t + 1], D[g + 8][2t], D[g + 8][2t + 1]}.
__device__ __forceinline__ float4 mma_chains_sum(const float (&acc)[kMmaChains][4]) {
  float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int c = 0; c < kMmaChains; ++c) d.x += acc[c][0], d.y += acc[c][1], d.z += acc[c][2], d.w += acc[c][3];
  return d;
}

// A warp's whole share of one tile: groups kw, kw + KS, ... of rows (tile0 + g, tile0 + g + 8)
// (clamped to n - 1: rows past n are read but never stored). The first group's loads are issued by
// `start` (before pdl_wait), the rest and the products by `finish`. kOnce: the weights are read
// once a step (mma_weights_load).
// SUB > 1: each group split among SUB warps, 4 / SUB words each (k a multiple of 1024, every group
// full): unit u = kw, kw + KS, ... is group u / SUB, words from 4 / SUB · (u mod SUB). A block has
// SUB times the warps for the same tiles, each with a SUB-th of a group's products: at one token
// a Qwen3 o block had one warp a scheduler to issue 64 mma and their dequantising after its row.
template <int CPG, int KS, bool kOnce = true, int SUB = 1>
struct MmaTile {
  static_assert(SUB == 1 || SUB == 2 || SUB == 4);
  static constexpr int kSubWords = 4 / SUB;
  MmaWeights<CPG> mw;
  int64_t rows[2];
  int64_t quads, k;
  int kw;

  __device__ __forceinline__ void start(const Int4Weight& w, int64_t tile0, int64_t n, int64_t k_, int kw_) {
    const int g = threadIdx.x % 32 / 4;
    k = k_, kw = kw_, quads = (k / 256 + 3) / 4;
    rows[0] = tile0 + g < n ? tile0 + g : n - 1;
    rows[1] = tile0 + g + 8 < n ? tile0 + g + 8 : n - 1;
    if constexpr (SUB > 1) {
      if (kw < quads * SUB) mma_weights_load<CPG, kSubWords, kOnce, true>(w, rows, k, kw / SUB, mw, kw % SUB * kSubWords);
    } else {
      if (kw < quads) with_words(mma_group_words(k, kw), [&](auto W) { mma_weights_load<CPG, W.value, kOnce>(w, rows, k, kw, mw); });
    }
  }

  __device__ __forceinline__ void finish(const Int4Weight& w, const uint2* xb, float (&acc)[kMmaChains][4]) {
    if constexpr (SUB > 1) {
      for (int64_t u = kw; u < quads * SUB; u += KS) {
        const int64_t q = u / SUB;
        const int w0 = int(u % SUB) * kSubWords;
        if (u != kw) mma_weights_load<CPG, kSubWords, kOnce, true>(w, rows, k, q, mw, w0);
        mma_group_dot<CPG, kSubWords>(mw, q, xb, acc, w0);
      }
      return;
    }
    for (int64_t q = kw; q < quads; q += KS)
      with_words(mma_group_words(k, q), [&](auto W) {
        if (q != kw) mma_weights_load<CPG, W.value, kOnce>(w, rows, k, q, mw);
        mma_group_dot<CPG, W.value>(mw, q, xb, acc);
      });
  }
};

// Stages rows mi < m of x (RMS-normalised when kNorm: xr.inv must be set) into shared memory as
// f16 in the decode mma order: row mi at xs + mi · xs_stride halves, unit (step, t) = 4 halves
// (gemm_layout.h). Each thread issues kStageVec 16-byte loads (and the norm's) before it converts
// any: one L2 round trip per kStageVec · blockDim · 4 inputs, not one per 4. With the norm, half
// as many per round: the registers are shared with the weights already in flight; a caller with
// registers to spare takes more (kStageVec). (XRows::load, which normalises as it loads, measured
// 3% slower here: the loads must all issue first.)
// kOneRow: m = 1 (decode), so no division by the row's units: with one, ~30 instructions of
// integer division a load stood between the PDL wait and the row's loads.
template <int M, bool kNorm, int kStageVec = kNorm ? 2 : 4, bool kOneRow = false>
__device__ __forceinline__ void mma_stage_x(const XRows<M, kNorm>& xr, int k, __half* xs, int xs_stride) {
  if constexpr (!kOneRow) {
    if (xr.m == 1) return mma_stage_x<M, kNorm, kStageVec, true>(xr, k, xs, xs_stride);
  }
  const int per_row = k / 4, total = kOneRow ? per_row : xr.m * per_row;
  for (int base = threadIdx.x; base < total; base += kStageVec * blockDim.x) {
    float4 v[kStageVec], nw[kStageVec];
#pragma unroll
    for (int j = 0; j < kStageVec; ++j) {
      const int idx = base + j * blockDim.x;
      if (idx < total) {
        const int mi = kOneRow ? 0 : idx / per_row, k0 = 4 * (kOneRow ? idx : idx % per_row);
        if constexpr (kOneRow) {  // decode: the row's loads in one round (load_f4_generic)
          v[j] = load_f4_generic(xr.x + k0);
          if constexpr (kNorm) nw[j] = load_f4_generic(xr.norm + k0);
        } else {
          v[j] = *reinterpret_cast<const float4*>(xr.x + mi * xr.stride + k0);
          if constexpr (kNorm) nw[j] = *reinterpret_cast<const float4*>(xr.norm + k0);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kStageVec; ++j) {
      const int idx = base + j * blockDim.x;
      if (idx >= total) break;
      const int mi = kOneRow ? 0 : idx / per_row, k0 = 4 * (kOneRow ? idx : idx % per_row);
      float f[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
      if constexpr (kNorm) {
        const float inv = xr.inv[mi], w[4] = {nw[j].x, nw[j].y, nw[j].z, nw[j].w};
#pragma unroll
        for (int u = 0; u < 4; ++u) f[u] = f[u] * inv * w[u];
      }
      // k0 .. k0 + 3 are threads t = 0..3 of one step: consecutive units, 4 halves apart.
      __half* dst = xs + mi * xs_stride + gemv_mma_x_half(k0);
#pragma unroll
      for (int u = 0; u < 4; ++u) dst[4 * u] = __float2half_rn(f[u]);
    }
  }
}

// mma_stage_x with the RMS norm when kNorm: a single row (batch-1 decode) in one pass
// (stage_row_one_pass, the same bits), otherwise block_inv_rms and then the staging pass.
constexpr int kMmaOnePassUnits = 4;  // a 2048-wide row over 128 threads

template <int M, bool kNorm>
__device__ __forceinline__ void mma_stage_x_normed(XRows<M, kNorm>& xr, int k, float eps, __half* xs,
                                                   int xs_stride) {
  if constexpr (kNorm) {
    auto put = [&](int k0, float4 u) {
      __half* dst = xs + gemv_mma_x_half(k0);
      dst[0] = __float2half_rn(u.x), dst[4] = __float2half_rn(u.y);
      dst[8] = __float2half_rn(u.z), dst[12] = __float2half_rn(u.w);
    };
    if (xr.m == 1 && stage_row_one_pass<kMmaOnePassUnits, true>(xr.x, xr.norm, k, eps, put)) return;
  }
  block_inv_rms(xr, k, eps);
  mma_stage_x(xr, k, xs, xs_stride);
}

// Halves per staged activation row: 16 more than k, so the rows of different tokens start on
// different banks (a row is a multiple of 512 bytes).
__host__ __device__ constexpr int64_t mma_x_stride(int64_t k) { return k + 16; }

// Shared memory of a block that stages m rows of length k.
__host__ __device__ constexpr int64_t mma_x_bytes(int64_t m, int64_t k) { return 2 * m * mma_x_stride(k); }

// This thread's B units: column g (= lane / 4) of the staged rows, null past m.
__device__ __forceinline__ const uint2* mma_x_units(const __half* xs, int64_t k, int m) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  return g < m ? reinterpret_cast<const uint2*>(xs + g * mma_x_stride(k)) + t : nullptr;
}

// Rows already staged as f16 in mma order by their producer (MoE gate/up's activations for down,
// the folded o projection's row for gate/up), copied into shared memory after the PDL wait by
// bulk copies instead of 16-byte loads and stores a thread: one instruction a row, issued by one
// thread, completed on an mbarrier, so no integer division, register round trip or load rounds
// stand between the wait and the row (BENCHMARKS.md: a 16 KB row staged this way arrived 0.19 µs
// sooner under a weight burst, tools/kernel-bench/param_bench.cu). sm_90+ (elsewhere the 16-byte
// copies). Protocol: thread 0 calls init before the wait and the block synchronises before any
// thread calls wait; thread 0 calls issue after the wait.
struct StagedRowsBulk {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr bool kOn = true;
#else
  static constexpr bool kOn = false;
#endif
  uint64_t* bar;

  __device__ __forceinline__ void init() const {
    mbarrier_init(bar, 1);
    fence_barrier_init();
  }
  // rows rows of `halves` each (a multiple of 8), contiguous from src, to dst rows `stride` halves apart.
  __device__ __forceinline__ void issue(const __half* src, int rows, int64_t halves, int64_t stride,
                                        __half* dst) const {
    mbarrier_arrive_expect(bar, uint32_t(rows * halves * 2));
    for (int r = 0; r < rows; ++r) bulk_load(dst + r * stride, src + r * halves, uint32_t(halves * 2), bar);
  }
  __device__ __forceinline__ void wait() const { mbarrier_wait(bar, 0); }
};

// y[m, n] (+)= norm?(x[m, k]) · Wᵀ (+ b), m <= kGemvMaxM. A block has NTB 16-row tiles × KS warps
// along K; warp (nt, kw) takes groups kw, kw + KS, ... of tile nt (SUB > 1: units of a SUB-th of
// a group, MmaTile).
template <int CPG, bool kNorm, int KS, int NTB, bool kFold = false, int SUB = 1>
__global__ void __launch_bounds__(32 * KS * NTB) gemv_int4_mma_kernel(Int4Weight w, const float* __restrict__ bias,
                                                                      const float* __restrict__ x,
                                                                      float* __restrict__ y, int m, int64_t n,
                                                                      int64_t k, GemvIo io, RouterFold fold) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int nt = warp / KS, kw = warp % KS;
  NIBBLE_TIMELINE_BLOCK(kGemvInt4);
  MmaTile<CPG, KS, true, SUB> tile;
  tile.start(w, (int64_t(blockIdx.x) * NTB + nt) * 16, n, k, kw);  // weights need no predecessor
  // The folded router's rows and norm weights for this block's outputs, before the wait too.
  std::conditional_t<kFold, RouterFoldRows<NTB>, NoRouterFold> fold_rows;
  if constexpr (kFold) fold_rows.load(fold, n, int64_t(blockIdx.x) * NTB * 16);
  // The successor is released once x is staged, so the row's L2 reads do not queue behind the
  // successor's weight loads. With the MoE kernels' places below, +6% a Qwen3 decode step at
  // depth 0 (BENCHMARKS.md). With the router folded in, MoE gate/up is released only as the
  // blocks exit: it has nothing to do before its wait, and its blocks resident beside these cost
  // 2.1% at depth 0 (a tie at 8192 and 16384).
  constexpr int kSite = kFold ? kPdlOFold : kNorm ? kPdlQkv : kPdlO;
  constexpr PdlWhere kWhere = kFold ? kPdlAtExit : kPdlAfterInput;
  pdl_enter_at<kSite, kWhere>();
  NIBBLE_TIMELINE_WAITED();
  TileStore<KS, NTB> store;  // the bias and the residual, fetched before the products
  store.load(bias, y, m, n, io.accumulate, int64_t(blockIdx.x) * NTB);
  if (io.clear && blockIdx.x == 0)  // a folded router's sums, read by the kernels this one waited for
    for (int i = threadIdx.x; i < io.clear_count; i += blockDim.x) io.clear[i] = 0;
  XRows<kGemvMaxM, kNorm> xr{x, k, m, io.norm, {}};
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  // The folded o projection's row (one token, 4096 wide over 128 threads for Qwen3) in one round
  // of loads instead of two: +0.2% a decode step at depths 0 to 16384 (BENCHMARKS.md).
  static_assert(!(kFold && kNorm), "the folded o projection stages an unnormalised row");
  if constexpr (kFold)
    mma_stage_x<kGemvMaxM, kNorm, 8>(xr, int(k), xs, int(mma_x_stride(k)));
  else
    mma_stage_x_normed(xr, int(k), io.eps, xs, int(mma_x_stride(k)));
  NIBBLE_TIMELINE_MARK_AT(1);  // thread 0's share of the row staged
  __syncthreads();
  NIBBLE_TIMELINE_MARK_AT(0);  // the row staged
  pdl_trigger_at<kSite, kWhere>(kPdlAfterInput);
  if (io.staged_out && blockIdx.x == 0) {  // the staged rows for a 4-bit router's gate/up (GemvIo)
    const int units = int(k / 8);
    for (int i = threadIdx.x; i < m * units; i += blockDim.x)
      reinterpret_cast<uint4*>(io.staged_out)[i] =
          reinterpret_cast<const uint4*>(xs + (i / units) * mma_x_stride(k))[i % units];
  }
  float acc[kMmaChains][4] = {};
  tile.finish(w, mma_x_units(xs, k, m), acc);
  NIBBLE_TIMELINE_MARK_AT(2);  // warp 0's products done
  pdl_trigger_at<kSite, kWhere>(kPdlAfterProducts);
  __shared__ float partial[NTB][KS][kGemvMaxM][16];  // [tile][warp along K][token][row]
  const float4 d = mma_chains_sum(acc);
  if (2 * t < m) partial[nt][kw][2 * t][g] = d.x, partial[nt][kw][2 * t][g + 8] = d.z;
  if (2 * t + 1 < m) partial[nt][kw][2 * t + 1][g] = d.y, partial[nt][kw][2 * t + 1][g + 8] = d.w;
  __syncthreads();
  if constexpr (!kFold) {
    store.store(partial, y, m, n);
  } else {
    // The router's share of this block's rows (m = 1: thread j stores row j): γ·h for the
    // logits, h² for the norm (router_fold.cuh).
    __shared__ float s_gh[16 * NTB], s_hh[16 * NTB];
    const int64_t row0 = int64_t(blockIdx.x) * NTB * 16;
    store.store(partial, y, m, n, [&](int r, int, float h) {
      const float gamma = fold_rows.gamma;
      s_gh[r] = gamma * h, s_hh[r] = h * h;
      fold.xg[gemv_mma_x_half(row0 + r)] = __float2half_rn(gamma * h * (1.f / kRouterFoldRowInvScale));
    });
    __syncthreads();
    NIBBLE_TIMELINE_MARK_AT(3);  // the rows stored, before the router's shares
    fold_rows.add(fold, s_gh, s_hh);
  }
}

// y[n] (+)= norm?(x) · Wᵀ (+ b) for one token and many tiles (a 4-bit lm_head: Qwen3's 9,496
// tiles of 16 rows x 2048). gemv_int4_mma_kernel gives each block its tiles once: 4,748 blocks
// for that head, each staging (and normalising) x from L2 after its weights arrive, so an SM's
// DRAM traffic stopped for every block's staging, sums and exit; it read the head at ~1.75 TB/s
// (90 µs a step on an H200, `bench --profile`). Here one wave of blocks strides over the tiles,
// x staged once a block, and each warp issues its next tile's loads as soon as it has done the
// products of the current one.
// A warp owns whole tiles, group by group (8 KB of a tile loaded at once, the next group's or
// tile's loads issued after its products), NTB warps a block, 3 blocks an SM: the fewer and
// larger a warp's loads, and the less its warps wait on each other, the more of the matrix is in
// flight while they do their products (as for the BF16 head, backend/cuda/gemv_dense.cu). In
// isolation (tools/kernel-bench/gemv_int4_bench.cu, H200): 51.0 µs; 57.2 with 2 warps a tile (a
// warp a group) meeting on a named barrier of their own once a round; 67.2 with 4 warps a tile on
// half groups under the block's two barriers (7a5fe23's and bfa5545's trees). In a decode step
// (Qwen3 INT4, 4-bit head): 60.1 -> 54.5 -> 46.3 µs, tg128 +0.8% then +0.6% (BENCHMARKS.md).
// Measured slower: two tiles in flight a warp (one block an SM, or spills), the next tile's words
// one at a time into the freed registers, the streamed ring of int4_stream.cuh, a warp to 2 KB of
// a tile (77 µs), 2 or 8 tiles a block (56-59 µs).
// The same words, products and sums as gemv_int4_mma_kernel's with one warp along K (MmaTile's).
constexpr int kInt4StridedMinBlocks = 2;  // the registers it wants (168: 3 blocks an SM fit)

template <int CPG, bool kNorm, int NTB>
__global__ void __launch_bounds__(32 * NTB, kInt4StridedMinBlocks)
    gemv_int4_mma_strided_kernel(Int4Weight w, const float* __restrict__ bias, const float* __restrict__ x,
                                 float* __restrict__ y, int64_t n, int64_t k, GemvIo io) {
  const int nt = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  NIBBLE_TIMELINE_BLOCK(kGemvInt4);
  const int64_t tiles = (n + 15) / 16, stride = int64_t(gridDim.x) * NTB;
  int64_t base = int64_t(blockIdx.x) * NTB;  // the block's tiles this round: base .. base + NTB - 1
  MmaTile<CPG, 1> tile;
  tile.start(w, (base + nt) * 16, n, k, 0);  // weights need no predecessor (past n: row n - 1, never stored)
  pdl_wait();
  NIBBLE_TIMELINE_WAITED();
  if (io.clear && blockIdx.x == 0)  // a folded router's sums, read by the kernels this one waited for
    for (int i = threadIdx.x; i < io.clear_count; i += blockDim.x) io.clear[i] = 0;
  XRows<1, kNorm> xr{x, k, 1, io.norm, {}};
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  mma_stage_x_normed(xr, int(k), io.eps, xs, int(mma_x_stride(k)));
  __syncthreads();
  NIBBLE_TIMELINE_MARK_AT(1);  // the row staged
  pdl_launch_dependents();  // the head's successor (the pick) has no weights to load: no site to tune
  const uint2* xb = mma_x_units(xs, k, 1);
  // Lanes t = 0 hold rows g and g + 8 of the warp's tile (column 0: the token) and store them.
  for (; base < tiles; base += stride) {
    const int64_t r0 = (base + nt) * 16 + g, r1 = r0 + 8;
    float p0 = 0.f, p1 = 0.f;  // the bias and the residual, fetched before the products
    if (t == 0 && r0 < n) p0 = (io.accumulate ? y[r0] : 0.f) + (bias ? bias[r0] : 0.f);
    if (t == 0 && r1 < n) p1 = (io.accumulate ? y[r1] : 0.f) + (bias ? bias[r1] : 0.f);
    float acc[kMmaChains][4] = {};
    tile.finish(w, xb, acc);
    if (base + stride < tiles) tile.start(w, (base + stride + nt) * 16, n, k, 0);
    const float4 d = mma_chains_sum(acc);
    if (t == 0 && r0 < n) y[r0] = p0 + d.x;
    if (t == 0 && r1 < n) y[r1] = p1 + d.z;
  }
}

// MoE decode, stage 1: for token t and slot s (expert e = ids[t, s], or with logits the s-th
// choice of the router's logits for t), act[t, s] = silu(gate_e · x_t) * (up_e · x_t), x_t
// RMS-normalised first when kNorm. act is written as f16 in the decode mma order of a row of
// `inter` (stage 2 stages it with plain copies). A block has KS warps along K on one 16-row tile
// of gate and KS on the same tile of up. Before the PDL wait the block stages its token's row and
// with ids copies both expert tables (the matrices' descriptors) into shared memory (after the
// wait the first weight load follows the expert id by a shared-memory read, not another L2 trip);
// with logits it reads its expert's descriptor once routed.
// Shared memory: the staged row, then copies of both expert tables.
__host__ __device__ constexpr int64_t moe_gate_up_tables_offset(int64_t hidden) {
  return (mma_x_bytes(1, hidden) + 15) / 16 * 16;
}
__host__ __device__ constexpr int64_t moe_gate_up_smem_bytes(int64_t hidden, int64_t n_experts) {
  return moe_gate_up_tables_offset(hidden) + 2 * n_experts * int64_t(sizeof(Int4Weight));
}

// Two warps along K (hidden 2048), a group of 128 or more: three blocks an SM, so that a Qwen3
// step's 384 blocks are one wave (167 registers a thread; at 191, as a timeline build compiled
// it, a third of them waited ~7 µs a layer for a second wave). Smaller groups hold more scales
// (group 32 would spill 552 bytes a thread under the bound).
template <int CPG, int KS>
constexpr int kMoeGateUpMinBlocks = KS == 2 && CPG >= 4 ? 3 : 1;

// kOnce: one token (m = 1), so each expert is read once (mma_weights_load). kFolded: routed from
// a folded router's sums (racc); its own instantiation, so that the other routing's code stays out
// of each (a larger kernel measured 7% slower a decode step: instruction fetch).
template <int CPG, bool kNorm, int KS, bool kOnce, bool kFolded = false>
__global__ void __launch_bounds__(64 * KS, kMoeGateUpMinBlocks<CPG, KS>) moe_gate_up_int4_mma_kernel(
    const Int4Weight* __restrict__ gate, const Int4Weight* __restrict__ up, int64_t n_experts,
    const int32_t* __restrict__ ids, const float* __restrict__ logits, const __half* __restrict__ xn,
    const float* __restrict__ x, __half* __restrict__ act, int64_t top_k,
    int64_t inter, int64_t hidden, const float* __restrict__ norm, float eps, int replicas, int64_t replica_stride,
    RouterAcc racc) {
  static_assert(sizeof(Int4Weight) % 8 == 0);
  constexpr int kWords = int(sizeof(Int4Weight) / 8);
  NIBBLE_TIMELINE_BLOCK(kMoeGateUp);
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  auto* tables = reinterpret_cast<Int4Weight*>(dynamic_smem() + moe_gate_up_tables_offset(hidden));
  // With logits (routing here, after the wait) the block reads only its expert's descriptor, once
  // it is known: an L2 hit. Copying both tables (12 KB a block through L2) took gate/up's pre-wait
  // part to ~6 µs, and even pulling them into L1 (the 384 blocks' 4 MB of L2 traffic while the
  // router runs) cost 1.2% tg128 against this (BENCHMARKS.md).
  if (!logits && !kFolded) {
    for (int64_t i = threadIdx.x; i < 2 * n_experts * kWords; i += blockDim.x) {  // [gate | up]
      const int64_t per_table = n_experts * kWords;
      const auto* src = reinterpret_cast<const uint64_t*>(i < per_table ? gate : up);
      reinterpret_cast<uint64_t*>(tables)[i] = __ldg(src + i % per_table);
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = warp / KS, kw = warp % KS;  // h: 0 gate, 1 up
  const int64_t slot = blockIdx.y;          // token · top_k + s
  const int64_t tile0 = int64_t(blockIdx.x) * 16;
  // x was last written before the router, the previous kernel, so it is complete when this one
  // starts (pdl.cuh): it is staged (normalised) before the wait, and after it only the expert id
  // stands between the wait and the first weight load. Staged after the wait, it queued behind
  // those weight loads: 6.5 of the kernel's 10.4 µs passed before the products could start
  // (in-kernel timeline, BENCHMARKS.md).
  // With xn the router staged the row already (normalised, f16, in mma order): it is copied after
  // the wait, its loads issued before the routing rounds so that the two L2 trips overlap.
  if (!xn) {
    XRows<1, kNorm> xr{x + (slot / top_k) * hidden, hidden, 1, norm, {}};
    mma_stage_x_normed(xr, int(hidden), eps, xs, int(mma_x_stride(hidden)));
  }
  // Folded (xn is always staged then) on sm_90, the row comes by one bulk copy (StagedRowsBulk):
  // its barrier is initialised here, and the barrier after the routing orders that before any
  // thread waits on it. A compile-time choice: the other path's loads kept beside it spilled.
  constexpr bool kXnByBulk = StagedRowsBulk::kOn && kFolded;
  __shared__ uint64_t xn_bar;
  const StagedRowsBulk xn_bulk{&xn_bar};
  if (kXnByBulk && threadIdx.x == 0) xn_bulk.init();
  NIBBLE_TIMELINE_MARK_AT(0);  // x staged (without xn), before the wait
  // The experts come from the router, the previous kernel. Down is released once the row is in
  // shared memory, so its weight loads do not queue ahead of the routing's logit reads.
  pdl_enter_at<kPdlGateUp, kPdlAfterInput>();
  NIBBLE_TIMELINE_WAITED();
  constexpr int kXnUnits = 2;  // 16-byte units a thread in the first pass
  const int xn_units = int(hidden / 8);
  const uint4* xn_row =
      xn && !kXnByBulk ? reinterpret_cast<const uint4*>(xn + (slot / top_k) * hidden) : nullptr;
  if (kXnByBulk && threadIdx.x == 0) xn_bulk.issue(xn + (slot / top_k) * hidden, 1, hidden, 0, xs);
  uint4 xu[kXnUnits];
#pragma unroll
  for (int j = 0; j < kXnUnits; ++j) {
    const int u = threadIdx.x + j * int(blockDim.x);
    if (xn_row && u < xn_units) xu[j] = __ldcg(xn_row + u);
  }
  // With logits the router left the routing to this kernel: warp 0 picks the slot's expert (s + 1
  // arg-max rounds over the token's logits, copy blockIdx.x mod replicas of them), no routing
  // launch; the other warps take it from shared memory after the barrier they pass anyway.
  // With the folded router, from the logits its sums make; xn is then o's x · γ / 16 (not yet
  // normalised), and the sums' 16 / rms scales the products (s_scale).
  __shared__ int32_t s_expert;
  __shared__ float s_scale;
  if constexpr (kFolded) {
    if (warp == 0) {
      float inv;
      const int32_t e = route_choice_folded(racc, n_experts, slot % top_k, &inv);
      if (lane == 0) s_expert = e, s_scale = inv * kRouterFoldRowInvScale;
    }
  } else if (logits && warp == 0) {
    const float* l = logits + (blockIdx.x % replicas) * replica_stride + (slot / top_k) * n_experts;
    const int32_t e = route_choice_sized(l, n_experts, slot % top_k);
    if (lane == 0) s_expert = e;
  }
  NIBBLE_TIMELINE_MARK_AT(1);  // the expert known
  if (xn_row) {
#pragma unroll
    for (int j = 0; j < kXnUnits; ++j) {
      const int u = threadIdx.x + j * int(blockDim.x);
      if (u < xn_units) reinterpret_cast<uint4*>(xs)[u] = xu[j];
    }
    for (int u = threadIdx.x + kXnUnits * int(blockDim.x); u < xn_units; u += blockDim.x)
      reinterpret_cast<uint4*>(xs)[u] = __ldcg(xn_row + u);
  }
  __syncthreads();  // the tables and the staged row
  if (kXnByBulk) xn_bulk.wait();
  NIBBLE_TIMELINE_MARK_AT(2);  // the row in shared memory, before the first weight load
  pdl_trigger_at<kPdlGateUp, kPdlAfterInput>(kPdlAfterInput);
  const bool routed = kFolded || logits;
  const int32_t e = routed ? s_expert : ids[slot];
  const Int4Weight w = routed ? (h ? up : gate)[e] : tables[h * n_experts + e];
  MmaTile<CPG, KS, kOnce> tile;
  tile.start(w, tile0, inter, hidden, kw);
  float acc[kMmaChains][4] = {};
  tile.finish(w, mma_x_units(xs, hidden, 1), acc);
  pdl_trigger_at<kPdlGateUp, kPdlAfterInput>(kPdlAfterProducts);
  NIBBLE_TIMELINE_MARK_AT(3);  // warp 0's products done
  __shared__ float partial[2][KS][16];
  const float4 d = mma_chains_sum(acc);
  if (t == 0) partial[h][kw][g] = d.x, partial[h][kw][g + 8] = d.z;  // column 0: the token
  __syncthreads();
  if (threadIdx.x < 16 && tile0 + threadIdx.x < inter) {
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int j = 0; j < KS; ++j) gs += partial[0][j][threadIdx.x], us += partial[1][j][threadIdx.x];
    if constexpr (kFolded) gs *= s_scale, us *= s_scale;
    act[slot * inter + gemv_mma_x_half(tile0 + threadIdx.x)] = __float2half_rn(gs / (1.f + expf(-gs)) * us);
  }
}

// MoE decode, stage 2: out[t, :] (+)= Σ_s weight[t, s] · (down_e · act[t, s]). A block has one
// warp per slot (top_k <= kMoeDownSlots) on one 16-row tile of one token, so all slots' weights
// stream at once; the slots' partial sums meet in shared memory and are added in slot order. The
// routing (ids and weights, or with logits the router's logits, which warp 0 routes into shared
// memory) was written two launches back (by the router, before stage 1), so the experts' weights
// load before pdl_wait (see pdl.cuh), and so does the residual it adds to (last written before
// the router).
constexpr int kMoeDownSlots = 8;

// Slot s's expert for MoE down: routed from the token's logits (lane 0 keeps the choice's logit in
// s_logit[s]; slot 0 also the softmax's full sum where the weights are not renormalised over the
// top k, choice 0 holding the maximum) or read from ids.
// kFolded: from the logits a folded router's sums make (racc).
template <bool kFolded>
__device__ __forceinline__ int32_t moe_down_expert(const float* __restrict__ tok_logits, const int32_t* __restrict__ ids,
                                                   const RouterAcc& racc, int64_t n_experts, bool normalize, int s,
                                                   int64_t tok, int64_t top_k, float* s_logit, float* s_sum) {
  auto route = [&](auto&& logit_of) {
    float logit;
    const int32_t e = route_choice_sized_by(logit_of, n_experts, s, &logit);
    if (threadIdx.x % 32 == 0) s_logit[s] = logit;
    if (s == 0 && !normalize) {
      const float sum = route_softmax_sum_by(logit_of, n_experts, logit);
      if (threadIdx.x % 32 == 0) *s_sum = sum;
    }
    return e;
  };
  if constexpr (kFolded) {
    float inv, logit, sum;
    const int32_t e = route_choice_folded(racc, n_experts, s, &inv, &logit, s == 0 && !normalize ? &sum : nullptr);
    if (threadIdx.x % 32 == 0) {
      s_logit[s] = logit;
      if (s == 0 && !normalize) *s_sum = sum;
    }
    return e;
  } else {
    if (!tok_logits) return ids[tok * top_k + s];
    return route([&](int64_t e) { return __ldcg(tok_logits + e); });
  }
}

// Row r of a token's tile: prev + Σ_s weight_s · partial[s][r], the weights from the kept logits
// (softmax over the top k, or over all with s_sum) or given (weights of the token, top_k of them).
__device__ __forceinline__ float moe_down_combine(const float (&partial)[kMoeDownSlots][16], int r, bool routed,
                                                  bool normalize, const float* s_logit, float s_sum,
                                                  const float* __restrict__ weights, int64_t top_k, float prev) {
  float total = 0.f;
  if (routed) {
    const float mx = s_logit[0];
    float sum = 0.f;
    if (normalize)
      for (int64_t j = 0; j < top_k; ++j) sum += expf(s_logit[j] - mx);
    else
      sum = s_sum;
    for (int64_t j = 0; j < top_k; ++j) total += expf(s_logit[j] - mx) / sum * partial[j][r];
  } else {
    for (int64_t j = 0; j < top_k; ++j) total += weights[j] * partial[j][r];
  }
  return prev + total;
}

// Registers a thread: capped at 168 for one token with groups of 128 or more on sm_90 (174
// uncapped; 168 spills nothing there). An SM's registers are four quarters of 16 K, one a
// scheduler, and a warp's must fit in one: this kernel's 8 warps put 2 in each. Beside one MoE
// gate/up block (a warp of 168 a quarter) that leaves 11 K a quarter, which 2 warps of 174 (11.3 K)
// overflow and 2 of 168 fit: capped, a down block becomes resident as the second of an SM's three
// gate/up blocks leaves, not the third, and its weight loads (issued before its wait) start that
// much earlier. Qwen3-30B-A3B INT4 tg128 +0.8% at depth 0, +0.9% at 8192, +1.4% at 16384 with FP8
// KV (H100, BENCHMARKS.md); DecodeResidency.Int4MoeOneToken checks the fit. Elsewhere the cap
// spills (smaller groups hold more scales; sm_80 and sm_120 allocate otherwise, and were not
// measured), so the bound stays the block's 255.
// (Any __maxnreg__, even 255, changes the other architectures' code: they go without.)
template <int CPG, bool kOnce>
constexpr int kMoeDownMaxRegisters = CPG >= 4 && kOnce ? 168 : 255;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define NIBBLE_MOE_DOWN_MAX_REGISTERS(CPG, kOnce) __maxnreg__((kMoeDownMaxRegisters<CPG, kOnce>))
#else
#define NIBBLE_MOE_DOWN_MAX_REGISTERS(CPG, kOnce)
#endif

template <int CPG, bool kOnce, bool kFolded = false>
__global__ void __launch_bounds__(32 * kMoeDownSlots) NIBBLE_MOE_DOWN_MAX_REGISTERS(CPG, kOnce)
    moe_down_int4_mma_kernel(
    const Int4Weight* __restrict__ down, const int32_t* __restrict__ ids, const float* __restrict__ weights,
    const float* __restrict__ logits, int64_t n_experts, bool normalize, const __half* __restrict__ act,
    float* __restrict__ out, int64_t top_k, int64_t inter, int64_t hidden, bool accumulate, int replicas,
    int64_t replica_stride, RouterAcc racc) {
  const int s = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t tok = blockIdx.y, tile0 = int64_t(blockIdx.x) * 16;
  NIBBLE_TIMELINE_BLOCK(kMoeDown);
  // With logits, warp s picks its own slot's expert (route_choice) and starts its loads, keeping
  // the choice's logit for the weights at the end (choice 0 holds the maximum; renormalised over
  // the top k the softmax's full sum cancels, otherwise warp 0 makes it).
  __shared__ float s_logit[kMoeDownSlots], s_sum;
  const float* tok_logits = logits ? logits + (blockIdx.x % replicas) * replica_stride + tok * n_experts : nullptr;
  MmaTile<CPG, 1, kOnce> tile;
  Int4Weight wd{};
  // The slots' activation rows are already f16 in mma order: bulk copies on sm_90
  // (StagedRowsBulk), 16-byte copies elsewhere. The bulk copy's barrier is initialised, and the
  // block synchronised on it, before the routing, so that each warp goes on to the wait as soon as
  // its own slot's loads are out: after the routing, warps 0-6 and thread 0's copy of the rows
  // waited there for slot 7's eight arg-max rounds. Qwen3-30B-A3B INT4 tg128 on an H200
  // (BENCHMARKS.md): +1.25% at depth 0, +1.5% with the 4-bit head, +0.8% at 8192 and at 16384 with
  // FP8 KV; with the barrier first, slot 7 routing in one round instead gains nothing more.
  __shared__ uint64_t act_bar;
  const StagedRowsBulk act_bulk{&act_bar};
  if constexpr (StagedRowsBulk::kOn) {
    if (threadIdx.x == 0) act_bulk.init();
    __syncthreads();
  }
  if (s < top_k) {
    wd = down[moe_down_expert<kFolded>(tok_logits, ids, racc, n_experts, normalize, s, tok, top_k, s_logit, &s_sum)];
    NIBBLE_TIMELINE_MARK_AT(1);  // warp 0's expert and descriptor known (before the wait)
    tile.start(wd, tile0, hidden, inter, 0);
  }
  // The residual this adds to was last written before the router, two launches back.
  const bool mine = threadIdx.x < 16 && tile0 + threadIdx.x < hidden;
  const float prev = accumulate && mine ? out[tok * hidden + tile0 + threadIdx.x] : 0.f;
  pdl_enter_at<kPdlDown, kPdlAfterInput>();  // the next q/k/v's weight loads after the act copy
  NIBBLE_TIMELINE_WAITED();
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  if constexpr (StagedRowsBulk::kOn) {
    if (threadIdx.x == 0) act_bulk.issue(act + tok * top_k * inter, int(top_k), inter, mma_x_stride(inter), xs);
    act_bulk.wait();
  } else {
    copy_staged_rows(act + tok * top_k * inter, int(top_k), inter, mma_x_stride(inter), xs);
    __syncthreads();
  }
  NIBBLE_TIMELINE_MARK_AT(0);  // the activations staged
  pdl_trigger_at<kPdlDown, kPdlAfterInput>(kPdlAfterInput);
  float acc[kMmaChains][4] = {};
  if (s < top_k) tile.finish(wd, mma_x_units(xs + s * mma_x_stride(inter), inter, 1), acc);
  NIBBLE_TIMELINE_MARK_AT(2);  // warp 0's products done
  pdl_trigger_at<kPdlDown, kPdlAfterInput>(kPdlAfterProducts);
  __shared__ float partial[kMoeDownSlots][16];
  const float4 d = mma_chains_sum(acc);
  if (t == 0 && s < top_k) partial[s][g] = d.x, partial[s][g + 8] = d.z;
  __syncthreads();
  if (mine)
    out[tok * hidden + tile0 + threadIdx.x] =
        moe_down_combine(partial, int(threadIdx.x), kFolded || tok_logits != nullptr, normalize, s_logit,
                         s_sum, weights ? weights + tok * top_k : nullptr, top_k, prev);
}

}  // namespace nibble::kernels
