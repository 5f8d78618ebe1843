// MoE routing and the row movement around per-expert GEMMs. route: one warp per token
// (moe_route.cuh). gather/scatter move token rows to and from an expert's contiguous batch;
// scatter_add_weighted accumulates `weight · row` into the token's output row. A token's top-k
// experts are distinct, and one launch handles one expert, so no two threads add to one element.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "kernels/gemm_layout.h"
#include "kernels/gemv.cuh"
#include "kernels/mma.cuh"
#include "kernels/moe_route.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

constexpr int64_t kMoeMaxTopK = 32;

__global__ void moe_route_kernel(const float* __restrict__ logits, int64_t m, int64_t n_experts,
                                 int64_t top_k, bool normalize, int32_t* __restrict__ ids,
                                 float* __restrict__ weights) {
  NIBBLE_TIMELINE_BLOCK(kMoeRoute);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= m) return;
  route_token(logits + t * n_experts, n_experts, top_k, normalize, ids + t * top_k, weights + t * top_k);
}

// The router GEMV (BF16/F16/F32 rows, input RMS-normalised when kNorm) and the routing in one
// launch, one warp per expert row. Each lane loads its first kRouterVecs 16-byte vectors of the
// row into registers before the PDL wait (the router is 0.5 MB: all of it is in flight at
// once); after the wait x is staged in shared memory, normalised (in one pass for a single row),
// and the dot products read it there. Then the logits of all blocks meet in one block, which
// routes the m tokens: no second launch and its latency per MoE layer. Two ways to meet:
//   moe_router_cluster_kernel (sm_90+, n_experts <= kRouterClusterExperts): the blocks are one
//     thread-block cluster; each keeps its logits in shared memory and block 0 reads them over
//     distributed shared memory after a cluster barrier.
//   moe_router_kernel: every block writes its logits to global memory and the last block to
//     finish (a counter, reset by that block for the next launch) reads them back: a fence, an
//     atomic and a read through L2. The cluster took the router's critical time from 7.7 to
//     7.0 µs a layer (in-kernel timeline, BENCHMARKS.md), ~4.8 of it after the products.
// Both now run only with NIBBLE_MOE_ROUTER_ROUTES=1 (A/B runs): by default the router writes
// logits only and the expert kernels route (moe_router_logits_kernel below).
constexpr int kRouterVecs = 8;        // 2048 bf16 per lane-strided row
constexpr int kRouterStageUnits = 4;  // a 2048-wide row over 128 threads

// Shared memory of the router: the m staged rows.
__host__ __device__ constexpr int64_t moe_router_smem_bytes(int64_t m, int64_t hidden) { return m * hidden * 4; }

// One warp's expert row: its first kRouterVecs vectors per lane in registers (issued at once).
template <DenseType T>
struct RouterRow {
  static constexpr int V = DenseVec<T>::kPerVec;
  static constexpr int64_t kElem = T == DenseType::kF32 ? 4 : 2;
  uint4 wr[kRouterVecs];
  const char* wrow;
  bool valid;

  __device__ __forceinline__ void load(const void* w, int64_t row, int64_t n_experts, int64_t hidden) {
    const int lane = threadIdx.x % 32;
    valid = row < n_experts;
    wrow = static_cast<const char*>(w) + (valid ? row : 0) * hidden * kElem;
#pragma unroll
    for (int i = 0; i < kRouterVecs; ++i) {
      const int64_t k0 = int64_t(V) * (lane + 32 * i);
      if (valid && k0 < hidden) wr[i] = __ldcs(reinterpret_cast<const uint4*>(wrow + k0 * kElem));  // evict-first
    }
  }

  // acc[mi] = this row · xs[mi] (summed over the warp: every lane holds it).
  template <int M>
  __device__ __forceinline__ void dot(const float* xs, int m, int64_t hidden, float (&acc)[M]) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int mi = 0; mi < M; ++mi) acc[mi] = 0.f;
    auto fma_vec = [&](int64_t k0, const float(&wv)[V]) {
#pragma unroll
      for (int mi = 0; mi < M; ++mi) {
        if (mi >= m) break;
#pragma unroll
        for (int e = 0; e < V; e += 4) {
          const float4 xv = *reinterpret_cast<const float4*>(xs + mi * hidden + k0 + e);
          acc[mi] = fmaf(wv[e], xv.x, acc[mi]);
          acc[mi] = fmaf(wv[e + 1], xv.y, acc[mi]);
          acc[mi] = fmaf(wv[e + 2], xv.z, acc[mi]);
          acc[mi] = fmaf(wv[e + 3], xv.w, acc[mi]);
        }
      }
    };
#pragma unroll
    for (int i = 0; i < kRouterVecs; ++i) {
      const int64_t k0 = int64_t(V) * (lane + 32 * i);
      if (k0 >= hidden) break;
      float wv[V];
      DenseVec<T>::load(&wr[i], wv);
      fma_vec(k0, wv);
    }
    for (int64_t k0 = int64_t(V) * (lane + 32 * kRouterVecs); k0 < hidden; k0 += 32 * V) {  // past 8 vectors a lane
      float wv[V];
      DenseVec<T>::load(wrow + k0 * kElem, wv);
      fma_vec(k0, wv);
    }
#pragma unroll
    for (int mi = 0; mi < M; ++mi) acc[mi] = warp_sum(acc[mi]);
  }
};

// The m input rows into shared memory xs[m][hidden], normalised when kNorm (one pass for one row).
template <int M, bool kNorm>
__device__ __forceinline__ void router_stage(const float* __restrict__ x, int m, int64_t hidden,
                                             const float* __restrict__ norm, float eps, float* xs) {
  bool staged = false;
  if constexpr (kNorm)
    if (m == 1)
      staged = stage_row_one_pass<kRouterStageUnits>(x, norm, hidden, eps, [&](int k0, float4 u) {
        *reinterpret_cast<float4*>(xs + k0) = u;
      });
  if (!staged) {
    XRows<M, kNorm> xr{x, hidden, m, norm, {}};
    block_inv_rms(xr, hidden, eps);
    for (int64_t idx = threadIdx.x; idx < m * hidden / 4; idx += blockDim.x) {
      const int mi = int(idx / (hidden / 4));
      const int64_t k0 = 4 * (idx % (hidden / 4));
      float f[4];
      xr.load(mi, k0, f);
      *reinterpret_cast<float4*>(xs + mi * hidden + k0) = make_float4(f[0], f[1], f[2], f[3]);
    }
  }
}

template <DenseType T, int M, bool kNorm>
__global__ void moe_router_kernel(const void* __restrict__ w, const float* __restrict__ x, int m,
                                  int64_t n_experts, int64_t hidden, const float* __restrict__ norm, float eps,
                                  float* __restrict__ logits, int64_t top_k, bool normalize,
                                  int32_t* __restrict__ ids, float* __restrict__ weights,
                                  unsigned* __restrict__ counter) {
  const int lane = threadIdx.x % 32;
  NIBBLE_TIMELINE_BLOCK(kMoeRouter);
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  RouterRow<T> rw;
  rw.load(w, row, n_experts, hidden);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  float* xs = reinterpret_cast<float*>(dynamic_smem());  // [m][hidden], normalised
  router_stage<M, kNorm>(x, m, hidden, norm, eps, xs);
  __syncthreads();
  if (rw.valid) {
    float acc[M];
    rw.template dot<M>(xs, m, hidden, acc);
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
      if (lane == 0 && mi < m) logits[mi * n_experts + row] = acc[mi];
  }
  __shared__ bool last;
  __syncthreads();
  NIBBLE_TIMELINE_MARK();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's logits are visible before it is counted
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int64_t t = threadIdx.x / 32; t < m; t += blockDim.x / 32)
    route_token(logits + t * n_experts, n_experts, top_k, normalize, ids + t * top_k, weights + t * top_k);
  if (threadIdx.x == 0) *counter = 0;
}

// The cluster router: ceil(n_experts / kRouterClusterWarps) blocks of kRouterClusterWarps warps,
// launched as one cluster (at most the portable 8 blocks).
constexpr int kRouterClusterWarps = 16;
constexpr int kRouterClusterBlocks = 8;
constexpr int64_t kRouterClusterExperts = int64_t(kRouterClusterWarps) * kRouterClusterBlocks;

template <DenseType T, int M, bool kNorm>
__global__ void __launch_bounds__(32 * kRouterClusterWarps) moe_router_cluster_kernel(
    const void* __restrict__ w, const float* __restrict__ x, int m, int64_t n_experts, int64_t hidden,
    const float* __restrict__ norm, float eps, int64_t top_k, bool normalize, int32_t* __restrict__ ids,
    float* __restrict__ weights) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  NIBBLE_TIMELINE_BLOCK(kMoeRouter);
  const unsigned rank = cluster.block_rank();
  RouterRow<T> rw;
  rw.load(w, int64_t(rank) * kRouterClusterWarps + warp, n_experts, hidden);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  float* xs = reinterpret_cast<float*>(dynamic_smem());  // [m][hidden], normalised
  router_stage<M, kNorm>(x, m, hidden, norm, eps, xs);
  __syncthreads();
  __shared__ float s_logits[M][kRouterClusterWarps];  // this block's rows
  __shared__ float s_all[M][kRouterClusterExperts];   // block 0: every row
  if (rw.valid) {
    float acc[M];
    rw.template dot<M>(xs, m, hidden, acc);
#pragma unroll
    for (int mi = 0; mi < M; ++mi)
      if (lane == 0 && mi < m) s_logits[mi][warp] = acc[mi];
  }
  NIBBLE_TIMELINE_MARK();
  cluster.sync();  // every block's logits are in its shared memory
  if (rank == 0) {
    for (int64_t idx = threadIdx.x; idx < m * n_experts; idx += blockDim.x) {
      const int64_t mi = idx / n_experts, e = idx % n_experts;
      const float* remote = cluster.map_shared_rank(&s_logits[0][0], unsigned(e / kRouterClusterWarps));
      s_all[mi][e] = remote[mi * kRouterClusterWarps + e % kRouterClusterWarps];
    }
  }
  // Block 0 has read the others' shared memory: they may end. Block 0 waits at the end.
  cluster.barrier_arrive();
  if (rank == 0) {
    __syncthreads();
    for (int t = warp; t < m; t += kRouterClusterWarps)
      // Loops sized for 4 experts a lane, not 16: this code runs once a launch, by one warp,
      // from a cold instruction cache (A/B: +1.7% tg128 at depth 0).
      route_token<true, int(kRouterClusterExperts / 32)>(s_all[t], n_experts, top_k, normalize, ids + t * top_k,
                                                         weights + t * top_k);
  }
  cluster.barrier_wait();
#endif
}

// The router's logits only, one warp per expert row, kRouterLogitsWarps warps a block: the
// routing is left to the expert kernels (moe_gate_up_int4_mma_kernel picks its slot's expert with
// route_choice_sized after its wait; the MoE down kernels pick each slot's with it before their
// wait, the logits being two launches back by then). This takes the cross-block meeting and
// the routing warp off the critical path: in the in-kernel timeline they were ~4.8 of the cluster
// router's 7.0 µs a layer, its products done 2.2 µs after the wait. Small blocks spread the 0.5 MB
// over ~32 SMs instead of 8. No staging: each lane reads the x elements of its own weight vectors
// straight from L2 (one round trip, all loads issued at once) and the warp sums x² beside the dot
// products, so the RMS norm needs no block reduction: logit = (w · (γ ⊙ x)) · rsqrt(mean(x²) + eps).
// Since every warp then holds the whole normalised row, warps 0..7 also write it for gate/up as
// f16 in the decode mma order (xn [m][hidden], when given; the launcher passes it only where a
// lane's vectors are all in registers, moe_router_logits_xn): gate/up copies it after its wait
// instead of staging it before (a block reduction and ~3 µs from its start, which kept its
// release ~2 µs behind this kernel's end).
// The logits are written `replicas` times, replica_stride floats apart (lanes 0..replicas - 1
// each store one copy): hundreds of expert blocks read them at once, each from copy b mod replicas.
constexpr int kRouterLogitsWarps = 4;

template <DenseType T, bool kNorm>
__global__ void __launch_bounds__(32 * kRouterLogitsWarps) moe_router_logits_kernel(
    const void* __restrict__ w, const float* __restrict__ x, int m, int64_t n_experts, int64_t hidden,
    const float* __restrict__ norm, float eps, float* __restrict__ logits, __half* __restrict__ xn, int replicas,
    int64_t replica_stride) {
  constexpr int V = RouterRow<T>::V;
  const int lane = threadIdx.x % 32;
  NIBBLE_TIMELINE_BLOCK(kMoeRouter);
  const int64_t row = int64_t(blockIdx.x) * kRouterLogitsWarps + threadIdx.x / 32;
  RouterRow<T> rw;
  rw.load(w, row, n_experts, hidden);
  // Gate/up is released at the wait: its blocks then become resident while this kernel runs.
  // Released after the logits, +0.5-0.7% at depth while each gate/up block pulled both expert
  // tables into L1 before its wait (~4 MB of L2 traffic against this kernel's reads); without
  // that prefetch (512121e) the wait is +0.7% at depth 0 and a tie at 8192 and 16384 (BENCHMARKS.md).
  pdl_enter_at<kPdlRouter, kPdlAtWait>();
  NIBBLE_TIMELINE_WAITED();
  if (!rw.valid) return;
  for (int mi = 0; mi < m; ++mi) {
    const float* xr = x + mi * hidden;
    float xv[kRouterVecs][V], gv[kRouterVecs][V];
#pragma unroll
    for (int i = 0; i < kRouterVecs; ++i) {  // every load of the lane's vectors first
      const int64_t k0 = int64_t(V) * (lane + 32 * i);
#pragma unroll
      for (int e = 0; e < V; e += 4) {
        const bool in = k0 < hidden;
        const float4 a = in ? __ldcg(reinterpret_cast<const float4*>(xr + k0 + e)) : make_float4(0, 0, 0, 0);
        const float4 b = kNorm && in ? __ldg(reinterpret_cast<const float4*>(norm + k0 + e)) : make_float4(1, 1, 1, 1);
        xv[i][e] = a.x, xv[i][e + 1] = a.y, xv[i][e + 2] = a.z, xv[i][e + 3] = a.w;
        gv[i][e] = b.x, gv[i][e + 1] = b.y, gv[i][e + 2] = b.z, gv[i][e + 3] = b.w;
      }
    }
    float dot = 0.f, ss = 0.f;
#pragma unroll
    for (int i = 0; i < kRouterVecs; ++i) {
      const int64_t k0 = int64_t(V) * (lane + 32 * i);
      if (k0 >= hidden) break;
      float wv[V];
      DenseVec<T>::load(&rw.wr[i], wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        ss = fmaf(xv[i][e], xv[i][e], ss);
        dot = fmaf(wv[e], gv[i][e] * xv[i][e], dot);
      }
    }
    for (int64_t k0 = int64_t(V) * (lane + 32 * kRouterVecs); k0 < hidden; k0 += 32 * V) {  // past 8 vectors a lane
      float wv[V];
      DenseVec<T>::load(rw.wrow + k0 * RouterRow<T>::kElem, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float xe = __ldcg(xr + k0 + e), ge = kNorm ? __ldg(norm + k0 + e) : 1.f;
        ss = fmaf(xe, xe, ss);
        dot = fmaf(wv[e], ge * xe, dot);
      }
    }
    const float inv = kNorm ? rsqrtf(warp_sum(ss) / float(hidden) + eps) : 1.f;
    dot = warp_sum(dot) * inv;
    pdl_trigger_at<kPdlRouter, kPdlAtWait>(kPdlAfterProducts);
    if (lane < replicas) logits[lane * replica_stride + mi * n_experts + row] = dot;
    if (xn && row < kRouterVecs) {
#pragma unroll
      for (int i = 0; i < kRouterVecs; ++i) {  // warp `row` writes vector i = row of every lane
        const int64_t k0 = int64_t(V) * (lane + 32 * i);
        if (i != row || k0 >= hidden) continue;
#pragma unroll
        for (int e = 0; e < V; ++e) xn[mi * hidden + gemv_mma_x_half(k0 + e)] = __float2half_rn(xv[i][e] * inv * gv[i][e]);
      }
    }
  }
}

__global__ void gather_rows_kernel(const float* __restrict__ src, const int32_t* __restrict__ rows,
                                   int64_t n_rows, int64_t dim, float* __restrict__ dst) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_rows * dim) return;
  dst[idx] = src[int64_t(rows[idx / dim]) * dim + idx % dim];
}

__global__ void scatter_add_weighted_kernel(const float* __restrict__ src, const int32_t* __restrict__ rows,
                                            const float* __restrict__ row_weights, int64_t n_rows,
                                            int64_t dim, float* __restrict__ dst) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_rows * dim) return;
  const int64_t r = idx / dim;
  dst[int64_t(rows[r]) * dim + idx % dim] += row_weights[r] * src[idx];
}

}  // namespace nibble::kernels
