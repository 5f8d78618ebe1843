// MoE routing and the row movement around per-expert GEMMs. route: one warp per token; lanes hold
// n_experts/32 logits each, the softmax and each of the top-k arg-max rounds are warp reductions
// (lower id wins ties, as the CPU reference does). gather/scatter move token rows to and from an expert's contiguous batch;
// scatter_add_weighted accumulates `weight · row` into the token's output row. A token's top-k
// experts are distinct, and one launch handles one expert, so no two threads add to one element.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "kernels/gemv.cuh"
#include "kernels/mma.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

constexpr int64_t kMoeMaxTopK = 32;

constexpr int kMoeMaxExpertsPerLane = 16;  // 512 experts

// Routes one token, by one warp: softmax over logits[n_experts], top_k arg-max rounds, ids and
// weights [top_k] written by lanes 0..top_k-1. Logits are read through L2 (__ldcg): in the fused
// router they were written by other blocks of the same kernel; kShared: from shared memory.
template <bool kShared = false, int kMaxPerLane = kMoeMaxExpertsPerLane>
__device__ __forceinline__ void route_token(const float* __restrict__ l, int64_t n_experts, int64_t top_k,
                                            bool normalize, int32_t* __restrict__ ids,
                                            float* __restrict__ weights) {
  const int lane = threadIdx.x % 32;
  // Only the first `per_lane` slots hold experts (4 for 128 experts): the unrolled loops stop
  // there, which keeps the 8 serial arg-max rounds short; v stays in registers.
  const int per_lane = int((n_experts + 31) / 32);
  float v[kMaxPerLane];  // expert lane + 32 i
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    const int64_t e = lane + 32 * i;
    v[i] = e < n_experts ? (kShared ? l[e] : __ldcg(l + e)) : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    if (lane + 32 * i < n_experts) sum += expf(v[i] - mx);
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  // The arg-max rounds on order-preserving integer keys: one warp max (redux.sync) finds the best
  // logit, one warp min the lowest expert holding it (the CPU reference's tie rule), instead of
  // five shuffle rounds of (value, id) pairs per choice. Taken and absent experts have key 0.
  uint32_t key[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    const uint32_t u = __float_as_uint(v[i] + 0.f);  // -0 -> +0: equal logits, equal keys
    key[i] = lane + 32 * i < n_experts ? ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) : 0u;
  }
  float chosen_p = 0.f, top_sum = 0.f;  // lane j keeps the j-th choice
  int32_t chosen = -1;
  for (int64_t j = 0; j < top_k; ++j) {
    uint32_t best = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      if (i >= per_lane) break;
      best = max(best, key[i]);
    }
    best = __reduce_max_sync(0xffffffffu, best);
    uint32_t candidate = 0xffffffffu;
#pragma unroll
    for (int i = kMaxPerLane - 1; i >= 0; --i)  // the lowest i holding it wins
      if (i < per_lane && key[i] == best) candidate = uint32_t(lane + 32 * i);
    const int32_t best_e = int32_t(__reduce_min_sync(0xffffffffu, candidate));
    const float logit = __uint_as_float((best & 0x80000000u) ? (best & 0x7fffffffu) : ~best);
    const float p = expf(logit - mx) / sum;
    top_sum += p;
    if (lane == j) chosen = best_e, chosen_p = p;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      if (i >= per_lane) break;
      if (lane + 32 * i == best_e) key[i] = 0u;  // taken
    }
  }
  if (lane < top_k) {
    ids[lane] = chosen;
    weights[lane] = chosen_p / (normalize ? top_sum : 1.f);
  }
}

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
//     7.0 µs a layer (in-kernel timeline, BENCHMARKS.md); most of what is left comes after the
//     products (~2.2 µs after the wait) and is not yet explained.
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
      if (valid && k0 < hidden) wr[i] = __ldg(reinterpret_cast<const uint4*>(wrow + k0 * kElem));
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
