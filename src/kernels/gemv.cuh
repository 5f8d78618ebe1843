// Small-M matrix-vector products for decode (M = 1..8 activation rows), memory-bound: every
// weight byte is read once with 16-byte loads, coalesced across the warp, and several loads are in
// flight per warp. One warp computes R output rows; the activation values a lane needs are loaded
// once per K-chunk into registers and reused for all R rows, so L1 traffic for x stays below the
// weight traffic.
//
// INT4 "warp-interleaved" layout (made at load by backend/cuda/int4_layout.cpp), per output row:
//   K is cut into chunks of 256. Word (chunk c, lane l) holds 8 codes, nibble j = code of input
//   k = 256c + l + 32j. Chunks are stored in groups of 4 as [lane][4 words] (one uint4 per lane,
//   512 contiguous bytes per warp), a last partial group of r < 4 chunks as [lane][r words].
//   So lane l always multiplies x[256c + l + 32j]: consecutive lanes read consecutive x.
//   Scales: f16 [n][K/G]; zeros: u8 [n][K/G], or none (symmetric: zero point 8). G is a power of
//   two >= 32 (or covers all of K), so all 32 lanes' codes at position j of a word share group
//   (256c + 32j) >> log2(G): one shift, no division, in the inner loop.
// Dense rows (f32/f16/bf16) are read as 16-byte vectors of 16/sizeof(T) elements, lane-strided.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/int4_weight.cuh"
#include "kernels/linear.cuh"
#include "kernels/pdl.cuh"

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
  __device__ __forceinline__ float operator()(int mi, int64_t i) const {
    if (mi >= m) return 0.f;
    const float v = x[mi * stride + i];
    if constexpr (kNorm) return v * inv[mi] * norm[i];
    return v;
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

// L2 prefetch of everything rows [row0, row0 + R) of an INT4 matrix will read: issued before
// pdl_wait, since weights never depend on an earlier kernel.
template <int R>
__device__ __forceinline__ void int4_rows_prefetch(const Int4Weight& w, int64_t row0, int64_t n, int64_t k) {
  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = k / 2;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (row0 + r >= n) break;
    const int64_t row = row0 + r;
    for (int64_t off = 16 * lane; off < row_bytes; off += 32 * 16) prefetch_l2(w.codes + row * row_bytes + off);
    if (lane == 0) {
      prefetch_l2(w.scales + row * w.n_groups);
      if (w.zeros) prefetch_l2(w.zeros + row * w.n_groups);
    }
  }
}

// One stage of the INT4 GEMV pipeline: the words of up to 4 chunks (1024 k, one 16-byte load per
// lane) of R rows and, for groups of >= 64, their scales. Loading stage c+1 before computing stage
// c keeps two round trips to memory in flight per warp instead of a chain of dependent ones,
// which at batch 1 (a few waves of short warps) is what bounds these kernels.
template <int R, int CPG>
struct Int4Stage {
  // Scales in registers cost 2-8 per word and stage, which pushes the MoE kernels past one wave
  // of blocks (measured: 167 registers for gate/up); they are loaded late, from L1/L2, instead.
  static constexpr bool kScales = false;
  uint32_t wd[R][4];
  float scale[R][4][kScales ? 8 / CPG : 1];
  int words;
};

template <int R, int CPG>
__device__ __forceinline__ void int4_stage_load(const Int4Weight& w, int64_t row0, int64_t n, int64_t k, int64_t c0,
                                                Int4Stage<R, CPG>& st) {
  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = k / 2, chunks = k / 256;
  st.words = chunks - c0 >= 4 ? 4 : int(chunks - c0);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + r < n ? row0 + r : row0;  // rows past n: load a valid row, unused
    const uint8_t* base = w.codes + row * row_bytes + c0 * 128;
    if (st.words == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(base + 16 * lane);
      st.wd[r][0] = v.x, st.wd[r][1] = v.y, st.wd[r][2] = v.z, st.wd[r][3] = v.w;
    } else {
#pragma unroll
      for (int wi = 0; wi < 4; ++wi)
        st.wd[r][wi] = wi < st.words ? reinterpret_cast<const uint32_t*>(base)[lane * st.words + wi] : 0u;
    }
    if constexpr (Int4Stage<R, CPG>::kScales) {
#pragma unroll
      for (int wi = 0; wi < 4; ++wi)
#pragma unroll
        for (int gi = 0; gi < 8 / CPG; ++gi) {
          const int64_t g = row * w.n_groups + ((256 * (c0 + wi) + 32 * CPG * gi) >> w.group_shift);
          st.scale[r][wi][gi] = wi < st.words ? __half2float(w.scales[g]) : 0.f;
        }
    }
  }
}

// The 8 codes of one word (position kc of its chunk) times x, scales factored out of the sum:
// with CPG codes per group (G / 32, at most 8), the codes of a group are dequantised against
// their zero point only (two integer ops, one add, one fma per code) and the group's partial sum is
// scaled once. The nibble becomes a float without a conversion: 0x4B000000 | q is 2^23 + q.
template <int M, int R, int CPG>
__device__ __forceinline__ void int4_word_dot(const Int4Weight& w, int64_t row, const Int4Stage<R, CPG>& st, int r,
                                              int wi, int kc, const float (&xv)[M][8], float (&acc)[M]) {
  const uint32_t word = st.wd[r][wi];
  const int g0 = kc >> int(w.group_shift);
#pragma unroll
  for (int gi = 0; gi < 8 / CPG; ++gi) {
    const int64_t g = row * w.n_groups + g0 + gi;
    const float offset = 8388608.f + (w.zeros ? float(w.zeros[g]) : 8.f);
    float scale;
    if constexpr (Int4Stage<R, CPG>::kScales)
      scale = st.scale[r][wi][gi];
    else
      scale = __half2float(w.scales[g]);
    float q[CPG];
#pragma unroll
    for (int c = 0; c < CPG; ++c)
      q[c] = __int_as_float(0x4B000000 | ((word >> (4 * (gi * CPG + c))) & 0xF)) - offset;
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      float part = 0.f;
#pragma unroll
      for (int c = 0; c < CPG; ++c) part = fmaf(q[c], xv[mi][gi * CPG + c], part);
      acc[mi] = fmaf(scale, part, acc[mi]);
    }
  }
}

template <int M, int R, int CPG, bool kNorm>
__device__ __forceinline__ void int4_stage_dot(const Int4Weight& w, int64_t row0, int64_t n, int64_t c0,
                                               const Int4Stage<R, CPG>& st, const XRows<M, kNorm>& xr,
                                               float (&acc)[R][M]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    if (wi >= st.words) break;
    const int kc = int(256 * (c0 + wi));
    float xv[M][8];
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
      for (int j = 0; j < 8; ++j) xv[mi][j] = xr(mi, kc + lane + 32 * j);
#pragma unroll
    for (int r = 0; r < R; ++r) int4_word_dot<M, R, CPG>(w, row0 + r < n ? row0 + r : row0, st, r, wi, kc, xv, acc[r]);
  }
}

// The same for two matrices of one shape read against the same x (gate and up): each x value
// is loaded (and normalised) once for both, which at batch 1 is a third of the instructions.
template <int R, int CPG, bool kNorm>
__device__ __forceinline__ void int4_stage_dot2(const Int4Weight& w1, const Int4Weight& w2, int64_t row0, int64_t n,
                                                int64_t c0, const Int4Stage<R, CPG>& st1,
                                                const Int4Stage<R, CPG>& st2, const XRows<1, kNorm>& xr,
                                                float (&acc1)[R][1], float (&acc2)[R][1]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int wi = 0; wi < 4; ++wi) {
    if (wi >= st1.words) break;
    const int kc = int(256 * (c0 + wi));
    float xv[1][8];
#pragma unroll
    for (int j = 0; j < 8; ++j) xv[0][j] = xr(0, kc + lane + 32 * j);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r < n ? row0 + r : row0;
      int4_word_dot<1, R, CPG>(w1, row, st1, r, wi, kc, xv, acc1[r]);
      int4_word_dot<1, R, CPG>(w2, row, st2, r, wi, kc, xv, acc2[r]);
    }
  }
}

// The INT4 GEMV pipeline of one warp: two stages in flight. start() issues the first two stages'
// loads and needs nothing but the weights, so kernels call it before pdl_wait (the loads then
// overlap the previous kernel's tail and this kernel's own prologue); run() does the rest.
template <int R, int CPG>
struct Int4Pipe {
  Int4Stage<R, CPG> cur, next;

  __device__ __forceinline__ void start(const Int4Weight& w, int64_t row0, int64_t n, int64_t k) {
    int4_stage_load(w, row0, n, k, 0, cur);
    if (k / 256 > 4) int4_stage_load(w, row0, n, k, 4, next);
  }

  // acc[r][mi] += W[row0 + r] · x[mi] over all of K.
  template <int M, bool kNorm>
  __device__ __forceinline__ void run(const Int4Weight& w, int64_t row0, int64_t n, int64_t k,
                                      const XRows<M, kNorm>& xr, float (&acc)[R][M]) {
    const int64_t chunks = k / 256;
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      int4_stage_dot(w, row0, n, c0, cur, xr, acc);
      if (c0 + 4 < chunks) {
        cur = next;
        if (c0 + 8 < chunks) int4_stage_load(w, row0, n, k, c0 + 8, next);
      }
    }
  }
};

template <int M, int R, int CPG, bool kNorm>
__device__ __forceinline__ void int4_rows_dot(const Int4Weight& w, int64_t row0, int64_t n, int64_t k,
                                              const XRows<M, kNorm>& xr, float (&acc)[R][M]) {
  Int4Pipe<R, CPG> pipe;
  pipe.start(w, row0, n, k);
  pipe.run(w, row0, n, k, xr, acc);
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
    for (int mi = 0; mi < M; ++mi)
#pragma unroll
      for (int i = 0; i < V; ++i) xv[mi][i] = xr(mi, k0 + i);
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
};

// y[m, n] (+)= norm?(x[m, k]) · Wᵀ (+ b) for m <= M activation rows. PDL: the weight rows are
// prefetched before waiting on the kernel that produced x.
// Launch bounds: at batch 1 a GEMV must fit one wave of blocks (every extra wave repeats the
// whole latency chain), so batch-1 kernels are held to 6 blocks of 128 threads per SM (85
// registers): q/k/v's 640 blocks and the 8-expert gate/up's 768 blocks fit one wave of 792.
constexpr int kGemvThreads = 128, kGemvMinBlocks = 6;

template <int M, int R, int CPG, bool kNorm>
__global__ void __launch_bounds__(kGemvThreads, M == 1 ? kGemvMinBlocks : 1) gemv_int4_kernel(Int4Weight w, const float* __restrict__ bias, const float* __restrict__ x,
                                 float* __restrict__ y, int m, int64_t n, int64_t k, GemvIo io) {
  const int64_t row0 = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * R;
  // The first two stages of weights are loaded before waiting on the kernel that produced x.
  Int4Pipe<R, CPG> pipe;
  if (row0 < n) {
    int4_rows_prefetch<R>(w, row0, n, k);
    pipe.start(w, row0, n, k);
  }
  pdl_enter();
  XRows<M, kNorm> xr{x, k, m, io.norm, {}};
  block_inv_rms(xr, k, io.eps);
  if (row0 >= n) return;
  float acc[R][M] = {};
  pipe.run(w, row0, n, k, xr, acc);
  store_rows<M, R>(acc, row0, n, m, bias, y, n, io.accumulate);
}

template <DenseType T, int M, int R, bool kNorm>
__global__ void gemv_dense_kernel(const void* __restrict__ w, const float* __restrict__ bias,
                                  const float* __restrict__ x, float* __restrict__ y, int m, int64_t n,
                                  int64_t k, GemvIo io) {
  const int64_t row0 = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * R;
  if (row0 < n) dense_rows_prefetch<T, R>(w, row0, n, k);
  pdl_enter();
  XRows<M, kNorm> xr{x, k, m, io.norm, {}};
  block_inv_rms(xr, k, io.eps);
  if (row0 >= n) return;
  float acc[R][M] = {};
  dense_rows_dot<T, M, R>(w, row0, n, k, xr, acc);
  store_rows<M, R>(acc, row0, n, m, bias, y, n, io.accumulate);
}

// MoE decode, stage 1: for token t and slot s (expert e = ids[t, s]), act[t, s, :] =
// silu(gate_e · x_t) * (up_e · x_t), x_t RMS-normalised first when kNorm. A warp computes R rows
// of gate and the same R rows of up. The expert comes from the previous kernel (the router), so
// nothing can be prefetched before pdl_wait.
template <int R, int CPG, bool kNorm>
__global__ void __launch_bounds__(kGemvThreads, kGemvMinBlocks) moe_gate_up_int4_kernel(const Int4Weight* __restrict__ gate, const Int4Weight* __restrict__ up,
                                        const int32_t* __restrict__ ids, const float* __restrict__ x,
                                        float* __restrict__ act, int64_t top_k, int64_t inter, int64_t hidden,
                                        const float* __restrict__ norm, float eps) {
  pdl_enter();
  const int64_t slot = blockIdx.y;  // t * top_k + s
  const int64_t row0 = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * R;
  XRows<1, kNorm> xr{x + (slot / top_k) * hidden, hidden, 1, norm, {}};
  block_inv_rms(xr, hidden, eps);
  if (row0 >= inter) return;
  const int32_t e = ids[slot];
  float g[R][1] = {}, u[R][1] = {};
  // gate and up stream together: four loads in flight per warp.
  const Int4Weight& wg = gate[e];
  const Int4Weight& wu = up[e];
  const int64_t chunks = hidden / 256;
  Int4Stage<R, CPG> g_cur, g_next, u_cur, u_next;
  int4_stage_load(wg, row0, inter, hidden, 0, g_cur);
  int4_stage_load(wu, row0, inter, hidden, 0, u_cur);
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    if (c0 + 4 < chunks) {
      int4_stage_load(wg, row0, inter, hidden, c0 + 4, g_next);
      int4_stage_load(wu, row0, inter, hidden, c0 + 4, u_next);
    }
    int4_stage_dot2(wg, wu, row0, inter, c0, g_cur, u_cur, xr, g, u);
    g_cur = g_next;
    u_cur = u_next;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float gs = warp_sum(g[r][0]), us = warp_sum(u[r][0]);
    if (threadIdx.x % 32 == 0 && row0 + r < inter) act[slot * inter + row0 + r] = gs / (1.f + expf(-gs)) * us;
  }
}

// MoE decode, stage 2: out[t, :] (+)= Σ_s weight[t, s] · (down_e · act[t, s]). A block owns R
// output rows of one token and has one warp per slot (top_k <= kMoeDownSlots), so all slots'
// weights stream in parallel; the slots' partial sums meet in shared memory and are added in slot
// order: no atomics, deterministic. The routing was written two launches back (by the router,
// before stage 1), so the experts' rows are prefetched before pdl_wait (see pdl.cuh).
constexpr int kMoeDownSlots = 8;

template <int R, int CPG>
__global__ void __launch_bounds__(32 * kMoeDownSlots, 2) moe_down_int4_kernel(const Int4Weight* __restrict__ down, const int32_t* __restrict__ ids,
                                     const float* __restrict__ weights, const float* __restrict__ act,
                                     float* __restrict__ out, int64_t top_k, int64_t inter, int64_t hidden,
                                     bool accumulate) {
  __shared__ float partial[kMoeDownSlots][R];
  const int64_t t = blockIdx.y, row0 = int64_t(blockIdx.x) * R;
  const int s = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The routing is two launches old (see pdl.cuh): the experts' rows load before the wait.
  Int4Pipe<R, CPG> pipe;
  Int4Weight wd{};
  if (s < top_k) {
    wd = down[ids[t * top_k + s]];
    int4_rows_prefetch<R>(wd, row0, hidden, inter);
    pipe.start(wd, row0, hidden, inter);
  }
  pdl_enter();
  if (s < top_k) {
    const int64_t slot = t * top_k + s;
    float acc[R][1] = {};
    const XRows<1, false> xr{act + slot * inter, inter, 1, nullptr, {}};
    pipe.run(wd, row0, hidden, inter, xr, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[r][0]);
      if (lane == 0) partial[s][r] = weights[slot] * v;
    }
  }
  __syncthreads();
  if (threadIdx.x < R && row0 + threadIdx.x < hidden) {
    float total = 0.f;
    for (int64_t j = 0; j < top_k; ++j) total += partial[j][threadIdx.x];
    float* o = out + t * hidden + row0 + threadIdx.x;
    *o = (accumulate ? *o : 0.f) + total;
  }
}

// Row-major INT4 codes [n][k/2] -> the interleaved layout above; one thread per output word.
__global__ void int4_interleave_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst,
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
