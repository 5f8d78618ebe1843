// Decode products of BF16 weights (m <= 8 activation rows) on the tensor cores: gpt-oss's q/k/v
// and o projections as shipped, and other dense 16-bit layers of decode shapes.
//
// Why: the CUDA-core GEMV (gemv.cuh) read gpt-oss-20b's q/k/v (5120 x 2880) and o (2880 x 4096)
// at 1.34 and 1.48 TB/s, 40-45% of DRAM peak (Nsight Compute, BENCHMARKS.md): a warp had two
// rows' 16-byte loads in flight at a time, interleaved with its activation loads. Here a thread
// issues kDenseMmaUnits 16-byte loads of its row back to back (one batch, the first before the
// PDL wait), and one mma.m16n8k16 does the multiply-adds of 8 weights a thread, whatever m is.
//
// The mma is used with the activation rows as A (tokens 0..7 are its rows g, rows 8..15 zero)
// and the weights as B (8 output rows: an 8-row tile, finer than the 16 of the INT4 kernels, so
// gpt-oss's 2880-row o projection makes 360 tiles for the 132 SMs). Thread (g, t) loads row g of
// the tile, 8 consecutive k from k0 = 32j + 8t (pair j): mma row κ = 2t, 2t + 1, 2t + 8, 2t + 9 of
// the pair's first step is k0 .. k0 + 3, of its second k0 + 4 .. k0 + 7. A's column κ is held by
// the threads of the same t, so the thread's A values of both steps are x[g][k0 .. k0 + 7]: one
// 16-byte shared load of the row staged in natural order, no permutation of the weights.
//
// Precision: the activations are split into bf16 hi = bf16(x) and lo = bf16(x - hi) (near f32,
// as the prefill GEMMs do), each multiplied exactly by the bf16 weight, the sums in f32: the
// exact kernel's tolerance (tests/ops/backend_ops_test.cpp, 1e-5).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/gemv.cuh"
#include "kernels/mma.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

// 16-byte units (8 k) of its row a thread loads per batch. 4 and 8 measured the same on gpt-oss's
// shapes (tools/kernel-bench/gemv_dense_bench.cu); 4 leaves registers for the fused norm's one pass.
constexpr int kDenseMmaUnits = 4;
constexpr int kDenseMmaTileRows = 8;

// Halves per staged row: k rounded up to 64, plus 32 (64 bytes), so the rows of tokens g and
// g + 1, read in one 8-thread phase of a 16-byte shared load, fall on different banks.
__host__ __device__ constexpr int64_t dense_mma_x_stride(int64_t k) { return (k + 63) / 64 * 64 + 32; }

// Shared memory of a block that stages m rows: hi rows, then lo rows.
__host__ __device__ constexpr int64_t dense_mma_x_bytes(int64_t m, int64_t k) {
  return 2 * 2 * m * dense_mma_x_stride(k);
}

// Writes 4 consecutive inputs (k0 % 4 == 0) of a staged row as bf16 hi and lo.
__device__ __forceinline__ void dense_mma_put(__nv_bfloat16* hi, __nv_bfloat16* lo, int64_t k0, float4 v) {
  const float f[4] = {v.x, v.y, v.z, v.w};
  alignas(8) __nv_bfloat16 h[4], l[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    h[u] = __float2bfloat16_rn(f[u]);
    l[u] = __float2bfloat16_rn(f[u] - __bfloat162float(h[u]));
  }
  *reinterpret_cast<uint2*>(hi + k0) = *reinterpret_cast<const uint2*>(h);
  *reinterpret_cast<uint2*>(lo + k0) = *reinterpret_cast<const uint2*>(l);
}

// Stages rows mi < m of x (RMS-normalised when kNorm: xr.inv must be set) as bf16 hi and lo. A
// thread issues kStageVec 16-byte loads before it converts any: one L2 round trip per
// kStageVec · blockDim · 4 inputs.
template <int M, bool kNorm>
__device__ __forceinline__ void dense_mma_stage_x(const XRows<M, kNorm>& xr, int64_t k, __nv_bfloat16* hi,
                                                  __nv_bfloat16* lo) {
  constexpr int kStageVec = 4;
  const int64_t stride = dense_mma_x_stride(k);
  const int per_row = int(k / 4), total = xr.m * per_row;
  for (int base = threadIdx.x; base < total; base += kStageVec * blockDim.x) {
    float4 v[kStageVec];
#pragma unroll
    for (int j = 0; j < kStageVec; ++j) {
      const int idx = base + j * int(blockDim.x);
      if (idx < total) {
        float f[4];
        xr.template load<4>(idx / per_row, 4 * int64_t(idx % per_row), f);
        v[j] = make_float4(f[0], f[1], f[2], f[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kStageVec; ++j) {
      const int idx = base + j * int(blockDim.x);
      if (idx < total) dense_mma_put(hi + (idx / per_row) * stride, lo + (idx / per_row) * stride, 4 * int64_t(idx % per_row), v[j]);
    }
  }
}

// dense_mma_stage_x with the RMS norm when kNorm: one row (batch-1 decode) in one pass over x and
// the norm weight (stage_row_one_pass, the same bits; measured alone on gpt-oss's q/k/v shape, the
// two passes cost ~4 µs of a 21 µs kernel), otherwise block_inv_rms and then the staging pass.
constexpr int kDenseMmaOnePassUnits = 6;  // a 3072-wide row over 128 threads

template <int M, bool kNorm>
__device__ __forceinline__ void dense_mma_stage_x_normed(XRows<M, kNorm>& xr, int64_t k, float eps,
                                                         __nv_bfloat16* hi, __nv_bfloat16* lo) {
  if constexpr (kNorm) {
    auto put = [&](int k0, float4 u) { dense_mma_put(hi, lo, k0, u); };
    if (xr.m == 1 && stage_row_one_pass<kDenseMmaOnePassUnits>(xr.x, xr.norm, k, eps, put)) return;
  }
  block_inv_rms(xr, k, eps);
  dense_mma_stage_x(xr, k, hi, lo);
}

// One warp's share of one 8-row tile: batches kw, kw + KS, ... of kDenseMmaUnits pairs (32 k)
// each, of row tile0 + g (clamped to n - 1: rows past n are read, never stored).
template <int KS, int U = kDenseMmaUnits>
struct DenseMmaTile {
  uint4 w[U];
  const __nv_bfloat16* row;
  int64_t k, batches;
  int kw;

  __device__ __forceinline__ void load(int64_t b) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int64_t k0 = (b * U + i) * 32 + 8 * t;
      // Evict-first, as the 4-bit weights (gemv_mma.cuh): read once a step.
      w[i] = k0 < k ? __ldcs(reinterpret_cast<const uint4*>(row + k0)) : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  // Points at the tile and issues the loads of the warp's first batch.
  __device__ __forceinline__ void start(const __nv_bfloat16* weights, int64_t tile0, int64_t n, int64_t k_, int kw_) {
    const int g = threadIdx.x % 32 / 4;
    k = k_, kw = kw_, batches = ((k + 31) / 32 + U - 1) / U;
    row = weights + (tile0 + g < n ? tile0 + g : n - 1) * k;
    if (kw < batches) load(kw);
  }

  // acc += the products of all the warp's batches. hi, lo: row g of the staged x (null past m).
  __device__ __forceinline__ void finish(const __nv_bfloat16* hi, const __nv_bfloat16* lo, float (&acc)[2][4]) {
    const int t = threadIdx.x % 4;
    for (int64_t b = kw; b < batches; b += KS) {
      if (b != kw) load(b);
#pragma unroll
      for (int i = 0; i < U; ++i) {
        const int64_t k0 = (b * U + i) * 32 + 8 * t;
        uint4 xh = make_uint4(0u, 0u, 0u, 0u), xl = xh;
        if (hi && k0 < k) {
          xh = *reinterpret_cast<const uint4*>(hi + k0);
          xl = *reinterpret_cast<const uint4*>(lo + k0);
        }
        // Step 0: k0 .. k0 + 3, step 1: k0 + 4 .. k0 + 7; A rows 8..15 (a1, a3) are zero.
        const uint32_t a0h[4] = {xh.x, 0u, xh.y, 0u}, a1h[4] = {xh.z, 0u, xh.w, 0u};
        const uint32_t a0l[4] = {xl.x, 0u, xl.y, 0u}, a1l[4] = {xl.z, 0u, xl.w, 0u};
        mma_bf16(acc[0], a0h, w[i].x, w[i].y);
        mma_bf16(acc[1], a1h, w[i].z, w[i].w);
        mma_bf16(acc[0], a0l, w[i].x, w[i].y);
        mma_bf16(acc[1], a1l, w[i].z, w[i].w);
      }
    }
  }
};

// y[m, n] (+)= norm?(x[m, k]) · Wᵀ (+ b), m <= kGemvMaxM, W bf16 [n][k] row-major, k % 8 == 0.
// A block has NTB 8-row tiles × KS warps along K; warp (nt, kw) takes batches kw, kw + KS, ... of
// tile nt. Blocks stride over the tiles when the grid is smaller than n / (8 · NTB) (an lm_head);
// the next tile's first batch is loaded before the block sums the current one.
template <bool kNorm, int KS, int NTB, int U = kDenseMmaUnits>
__global__ void __launch_bounds__(32 * KS * NTB) gemv_bf16_mma_kernel(const __nv_bfloat16* __restrict__ w,
                                                                      const float* __restrict__ bias,
                                                                      const float* __restrict__ x,
                                                                      float* __restrict__ y, int m, int64_t n,
                                                                      int64_t k, GemvIo io) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int nt = warp / KS, kw = warp % KS;
  const int64_t tiles = (n + kDenseMmaTileRows - 1) / kDenseMmaTileRows, stride = int64_t(gridDim.x) * NTB;
  NIBBLE_TIMELINE_BLOCK(kGemvDense);
  DenseMmaTile<KS, U> tile;
  int64_t base = int64_t(blockIdx.x) * NTB;
  if (base + nt < tiles) tile.start(w, (base + nt) * kDenseMmaTileRows, n, k, kw);  // weights need no predecessor
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  XRows<kGemvMaxM, kNorm> xr{x, k, m, io.norm, {}};
  auto* hi = reinterpret_cast<__nv_bfloat16*>(dynamic_smem());
  __nv_bfloat16* lo = hi + m * dense_mma_x_stride(k);
  dense_mma_stage_x_normed(xr, k, io.eps, hi, lo);
  __syncthreads();
  NIBBLE_TIMELINE_MARK();
  const __nv_bfloat16* xh = g < m ? hi + g * dense_mma_x_stride(k) : nullptr;
  const __nv_bfloat16* xl = g < m ? lo + g * dense_mma_x_stride(k) : nullptr;
  __shared__ float partial[NTB][KS][kGemvMaxM][kDenseMmaTileRows];  // [tile][warp along K][token][row]
  for (; base < tiles; base += stride) {
    float acc[2][4] = {};
    if (base + nt < tiles) tile.finish(xh, xl, acc);
    if (base + stride + nt < tiles) tile.start(w, (base + stride + nt) * kDenseMmaTileRows, n, k, kw);
    // D: row g (token), columns 2t, 2t + 1 (rows of the tile) in acc[.][0], acc[.][1].
    if (g < m) {
      partial[nt][kw][g][2 * t] = acc[0][0] + acc[1][0];
      partial[nt][kw][g][2 * t + 1] = acc[0][1] + acc[1][1];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < NTB * m * kDenseMmaTileRows; idx += blockDim.x) {
      const int tn = idx / (m * kDenseMmaTileRows), mi = idx / kDenseMmaTileRows % m, r = idx % kDenseMmaTileRows;
      const int64_t row = (base + tn) * kDenseMmaTileRows + r;
      if (base + tn >= tiles || row >= n) continue;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < KS; ++i) s += partial[tn][i][mi][r];
      float* out = y + mi * n + row;
      *out = (io.accumulate ? *out : 0.f) + s + (bias ? bias[row] : 0.f);
    }
    __syncthreads();
  }
}

}  // namespace nibble::kernels
