// Tensor-core GEMM for dense BF16/F16 weights with m > 8 rows (MoE router, dense MLPs, a full
// lm_head): y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias), x f32 row-major, W row-major. k % 8 == 0 (rows
// of whole 16-byte vectors); any m, n.
//
// Near-f32 results: the router's logits decide which experts run, so a GEMM that rounds x to 16
// bits would flip near-tied choices against the f32 reference. W is exact in its own type; x is
// split as a_hi = T(x), a_lo = T(x - a_hi) and both halves go through the mma (two mmas per tile,
// products exact in the f32 accumulator). What is lost is x - a_hi - a_lo: relative 2^-18 for bf16
// (8 + 8 significant bits), 2^-22 for f16 (f16 also needs |x| < 65504 and loses a_lo to
// subnormals below 2^-14 · 2^11 in magnitude, an absolute error under 2^-24).
// The tensor cores' own f32 accumulation is not IEEE round-to-nearest (it truncates), an error
// that grows with k: modelled, about 1e-5 relative at k = 4096. So each stage (32 k, 4 mmas) is
// summed into fresh tensor-core accumulators and those are added to the running sums with f32
// FADDs, which keeps the total near 3e-6 at any k.
//
// Pipeline: stages of 32 k. W by 16-byte cp.async, kStages deep, zero-filled past k; x through
// registers one stage ahead (it needs the split, so it cannot be copied raw), stored as the hi and lo
// tiles ([row][32 k], swizzled: dense_unit_swizzle in gemm_layout.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/gemm_layout.h"
#include "kernels/mma.cuh"

namespace nibble::kernels {

template <typename T>
struct SplitMma;
template <>
struct SplitMma<__half> {
  // hi/lo halves of (a0, a1) as f16x2.
  __device__ static void split(float a0, float a1, uint32_t& hi, uint32_t& lo) {
    const __half2 h = __floats2half2_rn(a0, a1);
    const float2 hf = __half22float2(h);
    const __half2 l = __floats2half2_rn(a0 - hf.x, a1 - hf.y);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = *reinterpret_cast<const uint32_t*>(&l);
  }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_f16(d, a, b0, b1); }
};
template <>
struct SplitMma<__nv_bfloat16> {
  __device__ static void split(float a0, float a1, uint32_t& hi, uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a0, a1);
    const float2 hf = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(a0 - hf.x, a1 - hf.y);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = *reinterpret_cast<const uint32_t*>(&l);
  }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { mma_bf16(d, a, b0, b1); }
};

template <int BM_, int BN_, int WARPS_M, int WARPS_N, int MIN_BLOCKS>
struct DenseGemmTile {
  static constexpr int kBM = BM_, kBN = BN_, kWarpsM = WARPS_M, kWarpsN = WARPS_N, kMinBlocks = MIN_BLOCKS;
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int kWarpM = BM_ / WARPS_M, kWarpN = BN_ / WARPS_N;
  static constexpr int kMTiles = kWarpM / 16, kNTiles = kWarpN / 8;
  static constexpr int kBK = 32, kStages = 4;
  static constexpr int kAVecs = BM_ * (kBK / 4) / kThreads;  // float4 per thread per stage
  static constexpr int kWVecs = BN_ * (kBK / 8) / kThreads;  // 16-byte copies per thread per stage
  static constexpr int kABytes = BM_ * kBK * 2;              // one of hi/lo, one stage
  static constexpr int kWBytes = BN_ * kBK * 2;
  static constexpr int kSmemBytes = 2 * 2 * kABytes + kStages * kWBytes;
  static_assert(kNTiles % 2 == 0, "B fragments are loaded two n-tiles per ldmatrix.x4");
  static_assert(kAVecs * kThreads == BM_ * kBK / 4 && kWVecs * kThreads == BN_ * kBK / 8);
};

template <class Tile, typename T>
__global__ void __launch_bounds__(Tile::kThreads, Tile::kMinBlocks)
    gemm_dense_split_kernel(const T* __restrict__ w, const float* __restrict__ bias, const float* __restrict__ x,
                            float* __restrict__ y, int64_t m, int64_t n, int64_t k) {
  constexpr int BM = Tile::kBM, BN = Tile::kBN, kBK = Tile::kBK, kThreads = Tile::kThreads;
  constexpr int kMT = Tile::kMTiles, kNT = Tile::kNTiles, kStages = Tile::kStages;
  uint8_t* smem = dynamic_smem();
  uint8_t* a_smem = smem;  // [2 buffers][hi, lo][BM][64 bytes]
  uint8_t* w_smem = smem + 4 * Tile::kABytes;  // [kStages][BN][64 bytes]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / Tile::kWarpsN, warp_n = warp % Tile::kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * BM, col0 = int64_t(blockIdx.y) * BN;
  const int n_stages = int((k + kBK - 1) / kBK);

  auto issue_w = [&](int s) {
    uint8_t* dst = w_smem + (s % kStages) * Tile::kWBytes;
#pragma unroll
    for (int it = 0; it < Tile::kWVecs; ++it) {
      const int idx = tid + it * kThreads, r = idx / 4, u = idx % 4;
      const int64_t col = col0 + r < n ? col0 + r : n - 1, kk = int64_t(s) * kBK + 8 * u;
      cp_async_16_zfill(smem_addr(dst + r * 64 + dense_unit_swizzle(r, u) * 16), w + col * k + (kk < k ? kk : 0),
                        kk < k);
    }
  };
  float4 a_regs[Tile::kAVecs];
  auto load_a = [&](int s) {
#pragma unroll
    for (int it = 0; it < Tile::kAVecs; ++it) {
      const int idx = tid + it * kThreads, r = idx / 8, q = idx % 8;
      const int64_t row = row0 + r < m ? row0 + r : m - 1, kk = int64_t(s) * kBK + 4 * q;
      a_regs[it] = kk < k ? *reinterpret_cast<const float4*>(x + row * k + kk) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  auto store_a = [&](int buf) {
#pragma unroll
    for (int it = 0; it < Tile::kAVecs; ++it) {
      const int idx = tid + it * kThreads, r = idx / 8, q = idx % 8;
      uint2 hi, lo;
      SplitMma<T>::split(a_regs[it].x, a_regs[it].y, hi.x, lo.x);
      SplitMma<T>::split(a_regs[it].z, a_regs[it].w, hi.y, lo.y);
      const int offset = r * 64 + dense_unit_swizzle(r, q / 2) * 16 + (q % 2) * 8;
      *reinterpret_cast<uint2*>(a_smem + (2 * buf) * Tile::kABytes + offset) = hi;
      *reinterpret_cast<uint2*>(a_smem + (2 * buf + 1) * Tile::kABytes + offset) = lo;
    }
  };

  float acc[kMT][kNT][4] = {};
  auto compute = [&](int s) {
    float part[kMT][kNT][4] = {};
    const uint32_t a_hi = smem_addr(a_smem + (2 * (s % 2)) * Tile::kABytes), a_lo = a_hi + Tile::kABytes;
    const uint32_t ws = smem_addr(w_smem + (s % kStages) * Tile::kWBytes);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t ah[kMT][4], al[kMT][4], b[kNT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int row = warp_m * Tile::kWarpM + mt * 16 + ldsm_a_row(lane);
        const uint32_t offset = row * 64 + dense_unit_swizzle(row, 2 * ks + ldsm_a_khalf(lane)) * 16;
        ldmatrix_x4(ah[mt], a_hi + offset);
        ldmatrix_x4(al[mt], a_lo + offset);
      }
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {  // matrices: (nt, k 0-7), (nt, k 8-15), (nt+1, ...), (nt+1, ...)
        const int row = warp_n * Tile::kWarpN + nt * 8 + ldsm_b_row(lane);
        uint32_t r[4];
        ldmatrix_x4(r, ws + row * 64 + dense_unit_swizzle(row, 2 * ks + ldsm_b_khalf(lane)) * 16);
        b[nt][0] = r[0], b[nt][1] = r[1], b[nt + 1][0] = r[2], b[nt + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          SplitMma<T>::mma(part[mt][nt], al[mt], b[nt][0], b[nt][1]);
          SplitMma<T>::mma(part[mt][nt], ah[mt], b[nt][0], b[nt][1]);
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] += part[mt][nt][i];
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_stages) issue_w(s);
    cp_async_commit();
  }
  load_a(0);
  store_a(0);
  cp_async_wait<kStages - 2>();
  __syncthreads();
  for (int s = 0; s < n_stages; ++s) {
    if (s + kStages - 1 < n_stages) issue_w(s + kStages - 1);
    cp_async_commit();
    const bool next = s + 1 < n_stages;
    if (next) load_a(s + 1);
    compute(s);
    if (next) store_a((s + 1) % 2);
    cp_async_wait<kStages - 2>();
    __syncthreads();
  }

  const bool vec2 = n % 2 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + warp_m * Tile::kWarpM + mt * 16 + g + 8 * half;
      if (row >= m) continue;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int64_t col = col0 + warp_n * Tile::kWarpN + nt * 8 + 2 * t;
        float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
        if (bias) {
          if (col < n) v0 += bias[col];
          if (col + 1 < n) v1 += bias[col + 1];
        }
        store_pair(y + row * n, col, n, vec2, v0, v1);
      }
    }
}

// x f32 -> the split's two 16-bit halves (hi = T(x), lo = T(x - hi)) as separate arrays, for a
// library GEMM run once on each (backend/cuda/cublaslt.h). One thread per 4 values (count % 4 == 0).
template <typename T>
__global__ void split_16bit_kernel(const float* __restrict__ x, int64_t count, uint2* __restrict__ hi,
                                   uint2* __restrict__ lo) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count / 4) return;
  const float4 v = reinterpret_cast<const float4*>(x)[i];
  uint2 h, l;
  SplitMma<T>::split(v.x, v.y, h.x, l.x);
  SplitMma<T>::split(v.z, v.w, h.y, l.y);
  hi[i] = h;
  lo[i] = l;
}

}  // namespace nibble::kernels
