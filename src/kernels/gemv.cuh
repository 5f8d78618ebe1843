// Small-M matrix-vector products for decode (M = 1..8 activation rows) of dense (f32/f16/bf16)
// weights on the CUDA cores: the routers, f32/f16 weights, and BF16 shapes the tensor-core GEMV
// (kernels/gemv_dense_mma.cuh) does not take. Every weight byte is read once with 16-byte loads,
// coalesced across the warp. One warp computes R output rows; the activation values a lane needs
// are loaded once per K-chunk into registers and reused for all R rows. The INT4 decode products
// run on the tensor cores (kernels/gemv_mma.cuh); the helpers here that they share are the
// activation rows (XRows, fused RMS norm) and the INT4 layout, defined here:
//
// INT4 "warp-interleaved" layout (made at load by backend/cuda/int4_layout.cpp), per output row:
//   K is cut into chunks of 256. Word (chunk c, lane l) holds 8 codes, nibble j = code of input
//   k = 256c + l + 32j. Chunks are stored in groups of 4 as [lane][4 words] (one uint4 per lane,
//   512 contiguous bytes per warp), a last partial group of r < 4 chunks as [lane][r words].
//   Scales: f16 [n][K/G]; zeros: u8 [n][K/G], or none (symmetric: zero point 8). G is a power of
//   two >= 32 (or covers all of K), so all 32 lanes' codes at position j of a word share group
//   (256c + 32j) >> log2(G).
// Dense rows (f32/f16/bf16) are read as 16-byte vectors of 16/sizeof(T) elements, lane-strided.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/int4_weight.cuh"
#include "kernels/linear.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

constexpr int kGemvMaxM = 8;


// The activation rows a GEMV reads, x[mi · stride + i] for mi < m, optionally RMS-normalised on
// the fly (x · inv_rms(row) · norm[i]): the norm fused into the projection that consumes it.
template <int M, bool kNorm>
struct XRows {
  const float* __restrict__ x;
  int64_t stride;
  int m;
  const float* __restrict__ norm;  // kNorm only
  float inv[M];                    // kNorm only: 1 / rms of each row
  // out[j] = row mi's input i + j (normalised when kNorm; 0 past m) for j < V (V % 4 == 0,
  // i % 4 == 0), with 16-byte loads: a lane's scalar loads at a 32-byte lane stride touch 8x the
  // sectors they use.
  template <int V>
  __device__ __forceinline__ void load(int mi, int64_t i, float (&out)[V]) const {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (mi < m) v = *reinterpret_cast<const float4*>(x + mi * stride + i + j);
      if constexpr (kNorm) {
        const float4 w = *reinterpret_cast<const float4*>(norm + i + j);
        const float s = mi < m ? inv[mi] : 0.f;
        v = make_float4(v.x * s * w.x, v.y * s * w.y, v.z * s * w.z, v.w * s * w.w);
      }
      out[j] = v.x, out[j + 1] = v.y, out[j + 2] = v.z, out[j + 3] = v.w;
    }
  }
};

// 1 / sqrt(mean(x²) + eps) of each of the m rows (length k, k % 4 == 0), by the whole block: every
// thread must call it. Each block of a fused-norm GEMV recomputes it; a 2048-wide row is 8 KB
// read from L2, less than one weight row group.
template <int M, bool kNorm>
__device__ __forceinline__ void block_inv_rms(XRows<M, kNorm>& xr, int64_t k, float eps) {
  if constexpr (kNorm) {
    __shared__ float partial[M][32];
    __shared__ float result[M];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      float ss = 0.f;
      if (mi < xr.m)
        for (int64_t i = 4 * int64_t(threadIdx.x); i < k; i += 4 * int64_t(blockDim.x)) {
          const float4 v = *reinterpret_cast<const float4*>(xr.x + mi * xr.stride + i);
          ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
      ss = warp_sum(ss);
      if (lane == 0) partial[mi][warp] = ss;
    }
    __syncthreads();
    if (threadIdx.x < M) {
      float ss = 0.f;
      for (int w = 0; w < int(blockDim.x / 32); ++w) ss += partial[threadIdx.x][w];
      result[threadIdx.x] = rsqrtf(ss / float(k) + eps);
    }
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < M; ++mi) xr.inv[mi] = result[mi];
  }
}

// A 16-byte load through a generic address (LD, not LDG), volatile so that it keeps its place
// after the PDL wait. ptxas issues a staged row's generic loads all before their first use, where
// it split the same global loads (LDG) into rounds under register pressure, a second L2 trip
// after the wait (tools/kernel-bench/param_bench.cu: 0.16 µs of a 16 KB row's staging under a
// weight burst, BENCHMARKS.md).
__device__ __forceinline__ float4 load_f4_generic(const float* p) {
  float4 v;
  asm volatile("ld.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// One pass over a single activation row (m == 1, the batch-1 decode): each thread loads its
// float4 units of x and of the norm weight (at most kUnits), the block sums the squares from
// registers, and put(k0, unit) is called with each unit normalised. That is one L2 round trip
// where block_inv_rms followed by a staging pass takes two. The sums run in block_inv_rms's
// order, so both give the same bits. Returns false, having done nothing, when the row needs more
// than kUnits units per thread (callers then take the two passes). Every thread must call it;
// callers synchronise before reading what put wrote. kGeneric: the loads by load_f4_generic.
template <int kUnits, bool kGeneric = false, typename Put>
__device__ __forceinline__ bool stage_row_one_pass(const float* __restrict__ x, const float* __restrict__ norm,
                                                   int64_t k, float eps, Put&& put) {
  const int per_row = int(k / 4);
  if (per_row > kUnits * int(blockDim.x)) return false;
  __shared__ float partial[32];
  float4 v[kUnits], w[kUnits];
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int idx = int(threadIdx.x) + j * int(blockDim.x);
    if (idx < per_row) {
      v[j] = kGeneric ? load_f4_generic(x + 4 * idx) : reinterpret_cast<const float4*>(x)[idx];
      w[j] = kGeneric ? load_f4_generic(norm + 4 * idx) : reinterpret_cast<const float4*>(norm)[idx];
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kUnits; ++j)
    if (int(threadIdx.x) + j * int(blockDim.x) < per_row)
      ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < int(blockDim.x / 32); ++i) total += partial[i];
  const float inv = rsqrtf(total / float(k) + eps);
#pragma unroll
  for (int j = 0; j < kUnits; ++j) {
    const int idx = int(threadIdx.x) + j * int(blockDim.x);
    if (idx < per_row)
      put(4 * idx, make_float4(v[j].x * inv * w[j].x, v[j].y * inv * w[j].y, v[j].z * inv * w[j].z,
                               v[j].w * inv * w[j].w));
  }
  return true;
}

template <DenseType T>
struct DenseVec;
template <>
struct DenseVec<DenseType::kF32> {
  static constexpr int kPerVec = 4;
  __device__ static void load(const void* p, float* out) {
    const float4 v = *static_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
};
template <>
struct DenseVec<DenseType::kF16> {
  static constexpr int kPerVec = 8;
  __device__ static void load(const void* p, float* out) {
    const uint4 v = *static_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
};
template <>
struct DenseVec<DenseType::kBF16> {
  static constexpr int kPerVec = 8;
  __device__ static void load(const void* p, float* out) {
    const uint4 v = *static_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
};

// acc[r][mi] += W[row0 + r] · x[mi] for dense rows; needs k % (32 · kPerVec) == 0.
template <DenseType T, int M, int R, bool kNorm>
__device__ __forceinline__ void dense_rows_dot(const void* w, int64_t row0, int64_t n, int64_t k,
                                               const XRows<M, kNorm>& xr, float (&acc)[R][M]) {
  constexpr int V = DenseVec<T>::kPerVec;
  constexpr int64_t elem = T == DenseType::kF32 ? 4 : 2;
  const int lane = threadIdx.x % 32;
#pragma unroll 4
  for (int64_t k0 = V * lane; k0 < k; k0 += 32 * V) {
    float xv[M][V];
#pragma unroll
    for (int mi = 0; mi < M; ++mi) xr.load(mi, k0, xv[mi]);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r >= n) break;
      float wv[V];
      DenseVec<T>::load(static_cast<const char*>(w) + ((row0 + r) * k + k0) * elem, wv);
#pragma unroll
      for (int mi = 0; mi < M; ++mi)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[r][mi] = fmaf(wv[i], xv[mi][i], acc[r][mi]);
    }
  }
}

template <DenseType T, int R>
__device__ __forceinline__ void dense_rows_prefetch(const void* w, int64_t row0, int64_t n, int64_t k) {
  constexpr int64_t elem = T == DenseType::kF32 ? 4 : 2;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (row0 + r >= n) break;
    const char* row = static_cast<const char*>(w) + (row0 + r) * k * elem;
    for (int64_t off = 16 * lane; off < k * elem; off += 32 * 16) prefetch_l2(row + off);
  }
}

// accumulate: y += result (the residual add fused into the projection), else y = result.
template <int M, int R>
__device__ __forceinline__ void store_rows(float (&acc)[R][M], int64_t row0, int64_t n, int m,
                                           const float* __restrict__ bias, float* __restrict__ y,
                                           int64_t y_stride, bool accumulate) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      const float s = warp_sum(acc[r][mi]);
      if (threadIdx.x % 32 == 0 && row0 + r < n && mi < m) {
        float* out = y + mi * y_stride + row0 + r;
        *out = (accumulate ? *out : 0.f) + s + (bias ? bias[row0 + r] : 0.f);
      }
    }
}

// What a decode GEMV does around the product: the optional RMS norm of its input rows (norm
// weight non-null) and whether it adds into y.
struct GemvIo {
  const float* norm;
  float eps;
  bool accumulate;
  float* normed_out = nullptr;  // split-K kernel with the norm: block 0 also writes the normalised rows here
  void* staged_out = nullptr;   // INT4 mma kernel with the norm: block 0 also writes its staged rows here
  unsigned long long* clear = nullptr;  // INT4 and MXFP4 mma kernels: block 0 zeroes clear[0..clear_count) after its wait
  int clear_count = 0;
};

// y[m, n] (+)= norm?(x[m, k]) · Wᵀ (+ b) for m <= M activation rows. PDL: the first weight rows
// are prefetched before waiting on the kernel that produced x. Warps stride over the row groups
// (the grid may be smaller than n / R rows): a 152K-row lm_head would otherwise be ~9,500 blocks,
// each recomputing the norm of x behind two barriers.
constexpr int kGemvThreads = 128;

template <DenseType T, int M, int R, bool kNorm>
__global__ void gemv_dense_kernel(const void* __restrict__ w, const float* __restrict__ bias,
                                  const float* __restrict__ x, float* __restrict__ y, int m, int64_t n,
                                  int64_t k, GemvIo io) {
  const int64_t first = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * R;
  const int64_t stride = int64_t(gridDim.x) * (blockDim.x / 32) * R;
  NIBBLE_TIMELINE_BLOCK(kGemvDense);
  if (first < n) dense_rows_prefetch<T, R>(w, first, n, k);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  XRows<M, kNorm> xr{x, k, m, io.norm, {}};
  block_inv_rms(xr, k, io.eps);
  for (int64_t row0 = first; row0 < n; row0 += stride) {
    float acc[R][M] = {};
    dense_rows_dot<T, M, R>(w, row0, n, k, xr, acc);
    store_rows<M, R>(acc, row0, n, m, bias, y, n, io.accumulate);
  }
}

// Few rows (a router: gpt-oss's 32 or 128 experts): one block per row, its KS warps along K, so a
// row's bytes are in flight on KS warps at once instead of on one (Nsight Compute: gpt-oss-20b's
// 32 x 2880 BF16 router took 10 µs as 8 blocks of the kernel above, at 0.6% of DRAM bandwidth).
// The warps' partial sums are added in warp order: deterministic.
// A single row (batch-1 decode) whose row fits kSplitKVecs 16-byte vectors a thread takes
// SplitKRowOnePass instead: the weights in registers before the PDL wait, x read once.
constexpr int kSplitKVecs = 4;

// One block's row of the split-K GEMV at m = 1, where it fits kSplitKVecs vectors a thread. Before
// the PDL wait (load) each thread loads its vectors of the row (and of the norm's weights) into
// registers; after it (finish), x once, with the dot product and (kNorm) the sum of squares taken
// together and reduced in one block meeting: y = (w · (γ ⊙ x)) · rsqrt(mean(x²) + eps) + b. The
// two-pass form (block_inv_rms, then the dot product reading x again) took gpt-oss's router 3.6 µs
// from its wait to its end (in-kernel timeline, H100): two L2 round trips and two block meetings
// for 32 outputs; this one 1.0 µs (gpt-oss-20b tg128 +3.9%, BENCHMARKS.md).
template <DenseType T, int KS, bool kNorm>
struct SplitKRowOnePass {
  static constexpr int V = DenseVec<T>::kPerVec;  // a 16-byte vector of the row
  uint4 wv[kSplitKVecs];
  float4 g[kSplitKVecs][V / 4];
  float b;

  static __device__ __forceinline__ bool fits(int64_t k) {
    return k % V == 0 && k / V <= int64_t(kSplitKVecs) * 32 * KS;
  }
  __device__ __forceinline__ void load(const char* w_row, const float* __restrict__ bias, int64_t k, const GemvIo& io) {
#pragma unroll
    for (int i = 0; i < kSplitKVecs; ++i) {
      const int64_t v = threadIdx.x + int64_t(i) * 32 * KS;
      if (v >= k / V) break;
      wv[i] = __ldcs(reinterpret_cast<const uint4*>(w_row) + v);  // evict-first: read once a step
      if constexpr (kNorm)
#pragma unroll
        for (int j = 0; j < V / 4; ++j) g[i][j] = __ldg(reinterpret_cast<const float4*>(io.norm + v * V) + j);
    }
    b = bias && threadIdx.x == 0 ? __ldg(bias + blockIdx.x) : 0.f;
  }
  __device__ __forceinline__ void finish(const float* __restrict__ x, float* __restrict__ y, int64_t k,
                                         const GemvIo& io) const {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float4 xv[kSplitKVecs][V / 4];
    float dot = 0.f, ss = 0.f;
#pragma unroll
    for (int i = 0; i < kSplitKVecs; ++i) {
      const int64_t v = threadIdx.x + int64_t(i) * 32 * KS;
      if (v >= k / V) break;
      float wf[V];
      DenseVec<T>::load(&wv[i], wf);
#pragma unroll
      for (int j = 0; j < V / 4; ++j) {
        const float4 u = xv[i][j] = *reinterpret_cast<const float4*>(x + v * V + 4 * j);
        if constexpr (kNorm) {
          ss += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w;
          const float4 gg = g[i][j];
          dot = fmaf(wf[4 * j], gg.x * u.x, dot), dot = fmaf(wf[4 * j + 1], gg.y * u.y, dot);
          dot = fmaf(wf[4 * j + 2], gg.z * u.z, dot), dot = fmaf(wf[4 * j + 3], gg.w * u.w, dot);
        } else {
          dot = fmaf(wf[4 * j], u.x, dot), dot = fmaf(wf[4 * j + 1], u.y, dot);
          dot = fmaf(wf[4 * j + 2], u.z, dot), dot = fmaf(wf[4 * j + 3], u.w, dot);
        }
      }
    }
    __shared__ float partial[KS][2];
    dot = warp_sum(dot);
    if constexpr (kNorm) ss = warp_sum(ss);
    if (lane == 0) partial[warp][0] = dot, partial[warp][1] = ss;
    __syncthreads();
    float inv = 1.f;
    if constexpr (kNorm) {
      float total = 0.f;
#pragma unroll
      for (int i = 0; i < KS; ++i) total += partial[i][1];
      inv = rsqrtf(total / float(k) + io.eps);
    }
    if (threadIdx.x == 0) {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < KS; ++i) sum += partial[i][0];
      float* out = y + blockIdx.x;
      *out = (io.accumulate ? *out : 0.f) + sum * inv + b;
    }
    if constexpr (kNorm) {
      // gpt-oss's router: the MoE kernels two launches on read the normalised row (pdl.cuh).
      if (io.normed_out && blockIdx.x == 0)
#pragma unroll
        for (int i = 0; i < kSplitKVecs; ++i) {
          const int64_t v = threadIdx.x + int64_t(i) * 32 * KS;
          if (v >= k / V) break;
#pragma unroll
          for (int j = 0; j < V / 4; ++j) {
            const float4 u = xv[i][j], gg = g[i][j];
            reinterpret_cast<float4*>(io.normed_out + v * V)[j] =
                make_float4(u.x * inv * gg.x, u.y * inv * gg.y, u.z * inv * gg.z, u.w * inv * gg.w);
          }
        }
    }
  }
};

template <DenseType T, int M, int KS, bool kNorm, bool kOnePass = true>
__global__ void __launch_bounds__(32 * KS) gemv_dense_split_k_kernel(const void* __restrict__ w,
                                                                     const float* __restrict__ bias,
                                                                     const float* __restrict__ x,
                                                                     float* __restrict__ y, int m, int64_t n,
                                                                     int64_t k, GemvIo io) {
  constexpr int V = DenseVec<T>::kPerVec;
  constexpr int64_t elem = T == DenseType::kF32 ? 4 : 2;
  const int64_t row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const char* w_row = static_cast<const char*>(w) + row * k * elem;
  NIBBLE_TIMELINE_BLOCK(kGemvDense);
  if constexpr (M == 1) {
    if (kOnePass && SplitKRowOnePass<T, KS, kNorm>::fits(k)) {
      SplitKRowOnePass<T, KS, kNorm> one;
      one.load(w_row, bias, k, io);
      pdl_enter_at<kNorm ? kPdlRouter : kPdlNoSite>();
      NIBBLE_TIMELINE_WAITED();
      one.finish(x, y, k, io);
      return;
    }
  }
  for (int64_t k0 = V * (lane + 32 * warp); k0 < k; k0 += 32 * KS * V) prefetch_l2(w_row + k0 * elem);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  XRows<M, kNorm> xr{x, k, m, io.norm, {}};
  block_inv_rms(xr, k, io.eps);
  float acc[M] = {};
#pragma unroll 4
  for (int64_t k0 = V * (lane + 32 * warp); k0 < k; k0 += 32 * KS * V) {
    float wv[V];
    DenseVec<T>::load(w_row + k0 * elem, wv);
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      float xv[V];
      xr.load(mi, k0, xv);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[mi] = fmaf(wv[i], xv[i], acc[mi]);
    }
  }
  if constexpr (kNorm) {
    // gpt-oss's router: the MoE kernels two launches on read the normalised rows (pdl.cuh), so the
    // norm needs no launch of its own.
    if (io.normed_out && blockIdx.x == 0)
      for (int idx = threadIdx.x; idx < m * int(k / 4); idx += blockDim.x) {
        const int mi = idx / int(k / 4);
        const int64_t k0 = 4 * int64_t(idx % int(k / 4));
        float f[4];
        xr.template load<4>(mi, k0, f);
        *reinterpret_cast<float4*>(io.normed_out + mi * k + k0) = make_float4(f[0], f[1], f[2], f[3]);
      }
  }
  __shared__ float partial[KS][M];
#pragma unroll
  for (int mi = 0; mi < M; ++mi) {
    const float s = warp_sum(acc[mi]);
    if (lane == 0) partial[warp][mi] = s;
  }
  __syncthreads();
  if (int(threadIdx.x) < m && threadIdx.x < M) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) s += partial[i][threadIdx.x];
    float* out = y + threadIdx.x * n + row;
    *out = (io.accumulate ? *out : 0.f) + s + (bias ? bias[row] : 0.f);
  }
}

// The output side of the tensor-core decode GEMVs (kernels/gemv_mma.cuh, gemv_mxfp4.cuh): a block
// has NTB 16-row tiles from tile `base` on, KS warps along K on each, and m <= kGemvMaxM tokens;
// its NTB · m · 16 outputs are spread over the block's threads. `load` fetches the bias and the
// values y already holds (the residual, when accumulating) before the products, so those loads
// overlap the staging and the products instead of following them; `store` adds the KS warps'
// partial sums in order.
template <int KS, int NTB>
struct TileStore {
  static constexpr int kPerThread = (4 + KS - 1) / KS;  // NTB · kGemvMaxM · 16 outputs over 32 · KS · NTB threads
  float prev[kPerThread], b[kPerThread];
  int64_t base;

  // Output j of this thread: tile tn, token mi, row r of the tile; false past the outputs or n.
  // One token (decode) without the divisions by m: they sat between the PDL wait and the loads
  // of the bias and the residual (~100 instructions in the o projection's SASS).
  __device__ __forceinline__ bool at(int j, int m, int64_t n, int& tn, int& mi, int& r, int64_t& row) const {
    const int idx = threadIdx.x + j * blockDim.x;
    if (m == 1)
      tn = idx / 16, mi = 0, r = idx % 16;
    else
      tn = idx / (m * 16), mi = idx / 16 % m, r = idx % 16;
    row = (base + tn) * 16 + r;
    return idx < NTB * m * 16 && row < n;
  }
  __device__ __forceinline__ void load(const float* __restrict__ bias, const float* __restrict__ y, int m, int64_t n,
                                       bool accumulate, int64_t base_tile) {
    base = base_tile;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      int tn, mi, r;
      int64_t row;
      const bool mine = at(j, m, n, tn, mi, r, row);
      b[j] = bias && mine ? bias[row] : 0.f;
      prev[j] = accumulate && mine ? y[mi * n + row] : 0.f;
    }
  }
  // partial: [tile][warp along K][token][row of the tile]. written(tile row, token, value) sees
  // each stored output (the folded router's epilogue, gemv_mma.cuh).
  template <typename Written>
  __device__ __forceinline__ void store(const float (&partial)[NTB][KS][kGemvMaxM][16], float* __restrict__ y, int m,
                                        int64_t n, Written&& written) const {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      int tn, mi, r;
      int64_t row;
      if (!at(j, m, n, tn, mi, r, row)) continue;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < KS; ++i) s += partial[tn][i][mi][r];
      const float v = prev[j] + s + b[j];
      y[mi * n + row] = v;
      written(tn * 16 + r, mi, v);
    }
  }
  __device__ __forceinline__ void store(const float (&partial)[NTB][KS][kGemvMaxM][16], float* __restrict__ y, int m,
                                        int64_t n) const {
    store(partial, y, m, n, [](int, int, float) {});
  }
};

// Copies `rows` activation rows already staged as f16 (`halves` each, a multiple of 8, contiguous
// from src) into shared memory rows `stride` halves apart, 16 bytes a thread: the MoE down
// projections' inputs, written by their gate/up kernels in staged order.
__device__ __forceinline__ void copy_staged_rows(const __half* __restrict__ src, int rows, int64_t halves,
                                                 int64_t stride, __half* dst) {
  const int units = int(halves / 8);
  for (int idx = threadIdx.x; idx < rows * units; idx += blockDim.x) {
    const int row = idx / units, u = idx % units;
    reinterpret_cast<uint4*>(dst + row * stride)[u] = reinterpret_cast<const uint4*>(src + row * halves)[u];
  }
}

// Row-major INT4 codes [n][k/2] -> the interleaved layout above; one thread per output word.
static __global__ void int4_interleave_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
                                              int64_t n, int64_t k) {
  const int64_t chunks = k / 256, words_per_row = k / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * words_per_row) return;
  const int64_t row = idx / words_per_row, c = idx % words_per_row / 32, lane = idx % 32;
  const uint8_t* s = src + row * (k / 2);
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int64_t i = 256 * c + lane + 32 * j;
    word |= uint32_t((s[i / 2] >> ((i & 1) * 4)) & 0xF) << (4 * j);
  }
  const int64_t c0 = c / 4 * 4, words = chunks - c0 < 4 ? chunks - c0 : 4;
  reinterpret_cast<uint32_t*>(dst + row * (k / 2) + c0 * 128)[lane * words + (c - c0)] = word;
}

}  // namespace nibble::kernels
