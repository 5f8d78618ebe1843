// MoE routing and the row movement around per-expert GEMMs. route: one warp per token; lanes hold
// n_experts/32 logits each, the softmax and each of the top-k arg-max rounds are warp reductions
// (lower id wins ties, as the CPU reference does). gather/scatter move token rows to and from an expert's contiguous batch;
// scatter_add_weighted accumulates `weight · row` into the token's output row. A token's top-k
// experts are distinct, and one launch handles one expert, so no two threads add to one element.
#pragma once

#include <cstdint>

#include "kernels/gemv.cuh"
#include "kernels/mma.cuh"
#include "kernels/pdl.cuh"

namespace nibble::kernels {

constexpr int64_t kMoeMaxTopK = 32;

constexpr int kMoeMaxExpertsPerLane = 16;  // 512 experts

// Routes one token, by one warp: softmax over logits[n_experts], top_k arg-max rounds, ids and
// weights [top_k] written by lanes 0..top_k-1. Logits are read through L2 (__ldcg): in the fused
// router they were written by other blocks of the same kernel.
__device__ __forceinline__ void route_token(const float* __restrict__ l, int64_t n_experts, int64_t top_k,
                                            bool normalize, int32_t* __restrict__ ids,
                                            float* __restrict__ weights) {
  const int lane = threadIdx.x % 32;
  // Only the first `per_lane` slots hold experts (4 for 128 experts): the unrolled loops stop
  // there, which keeps the 8 serial arg-max rounds short; v stays in registers.
  const int per_lane = int((n_experts + 31) / 32);
  float v[kMoeMaxExpertsPerLane];  // expert lane + 32 i
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMoeMaxExpertsPerLane; ++i) {
    if (i >= per_lane) break;
    const int64_t e = lane + 32 * i;
    v[i] = e < n_experts ? __ldcg(l + e) : -INFINITY;
    mx = fmaxf(mx, v[i]);
  }
  for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMoeMaxExpertsPerLane; ++i) {
    if (i >= per_lane) break;
    if (lane + 32 * i < n_experts) sum += expf(v[i] - mx);
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  // The arg-max rounds on order-preserving integer keys: one warp max (redux.sync) finds the best
  // logit, one warp min the lowest expert holding it (the CPU reference's tie rule), instead of
  // five shuffle rounds of (value, id) pairs per choice. Taken and absent experts have key 0.
  uint32_t key[kMoeMaxExpertsPerLane];
#pragma unroll
  for (int i = 0; i < kMoeMaxExpertsPerLane; ++i) {
    if (i >= per_lane) break;
    const uint32_t u = __float_as_uint(v[i] + 0.f);  // -0 -> +0: equal logits, equal keys
    key[i] = lane + 32 * i < n_experts ? ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) : 0u;
  }
  float chosen_p = 0.f, top_sum = 0.f;  // lane j keeps the j-th choice
  int32_t chosen = -1;
  for (int64_t j = 0; j < top_k; ++j) {
    uint32_t best = 0;
#pragma unroll
    for (int i = 0; i < kMoeMaxExpertsPerLane; ++i) {
      if (i >= per_lane) break;
      best = max(best, key[i]);
    }
    best = __reduce_max_sync(0xffffffffu, best);
    uint32_t candidate = 0xffffffffu;
#pragma unroll
    for (int i = kMoeMaxExpertsPerLane - 1; i >= 0; --i)  // the lowest i holding it wins
      if (i < per_lane && key[i] == best) candidate = uint32_t(lane + 32 * i);
    const int32_t best_e = int32_t(__reduce_min_sync(0xffffffffu, candidate));
    const float logit = __uint_as_float((best & 0x80000000u) ? (best & 0x7fffffffu) : ~best);
    const float p = expf(logit - mx) / sum;
    top_sum += p;
    if (lane == j) chosen = best_e, chosen_p = p;
#pragma unroll
    for (int i = 0; i < kMoeMaxExpertsPerLane; ++i) {
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
  pdl_enter();
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= m) return;
  route_token(logits + t * n_experts, n_experts, top_k, normalize, ids + t * top_k, weights + t * top_k);
}

// The router GEMV (BF16/F16/F32 rows, input RMS-normalised when kNorm) and the routing in one
// launch, one warp per expert row. Each lane loads its first kRouterVecs 16-byte vectors of the
// row into registers before the PDL wait (the router is 0.5 MB: all of it is in flight at
// once); after the wait x is staged in shared memory, normalised (in one pass for a single row),
// and the dot products read it there. Every block writes its experts' logits, and the last block
// to finish (a counter, reset by that block for the next launch) routes all m tokens: no second
// launch and its latency per MoE layer.
constexpr int kRouterVecs = 8;        // 2048 bf16 per lane-strided row
constexpr int kRouterStageUnits = 4;  // a 2048-wide row over 128 threads

// Shared memory of the router: the m staged rows.
__host__ __device__ constexpr int64_t moe_router_smem_bytes(int64_t m, int64_t hidden) { return m * hidden * 4; }

template <DenseType T, int M, bool kNorm>
__global__ void moe_router_kernel(const void* __restrict__ w, const float* __restrict__ x, int m,
                                  int64_t n_experts, int64_t hidden, const float* __restrict__ norm, float eps,
                                  float* __restrict__ logits, int64_t top_k, bool normalize,
                                  int32_t* __restrict__ ids, float* __restrict__ weights,
                                  unsigned* __restrict__ counter) {
  constexpr int V = DenseVec<T>::kPerVec;
  constexpr int64_t elem = T == DenseType::kF32 ? 4 : 2;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const char* wrow = static_cast<const char*>(w) + (row < n_experts ? row : 0) * hidden * elem;
  uint4 wr[kRouterVecs];
#pragma unroll
  for (int i = 0; i < kRouterVecs; ++i) {
    const int64_t k0 = int64_t(V) * (lane + 32 * i);
    if (row < n_experts && k0 < hidden) wr[i] = __ldg(reinterpret_cast<const uint4*>(wrow + k0 * elem));
  }
  pdl_enter();
  float* xs = reinterpret_cast<float*>(dynamic_smem());  // [m][hidden], normalised
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
  __syncthreads();
  if (row < n_experts) {
    float acc[M] = {};
    auto dot = [&](int64_t k0, const float(&wv)[V]) {
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
      dot(k0, wv);
    }
    for (int64_t k0 = int64_t(V) * (lane + 32 * kRouterVecs); k0 < hidden; k0 += 32 * V) {  // past 8 vectors a lane
      float wv[V];
      DenseVec<T>::load(wrow + k0 * elem, wv);
      dot(k0, wv);
    }
#pragma unroll
    for (int mi = 0; mi < M; ++mi) {
      const float sum = warp_sum(acc[mi]);
      if (lane == 0 && mi < m) logits[mi * n_experts + row] = sum;
    }
  }
  __shared__ bool last;
  __syncthreads();
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
