// The MoE router folded into the o projection that adds into the residual (one token; the sums
// are moe_route.cuh's RouterAcc). Shared by the INT4 o GEMV (Qwen3, gemv_mma.cuh) and the MXFP4
// one (gpt-oss all-MXFP4, gemv_mxfp4.cuh): each o block holds its 16·NTB rows' columns of the
// 16-bit router [n_experts][n] and of the MoE's RMS-norm weights from before its PDL wait, and
// after its products adds its rows' shares of every logit, Σ_j W[e, j] γ_j h_j, and of Σ_j h_j²
// to the sums with fixed-point integer atomics (order-free, so deterministic).
//
// Who routes from the sums:
//   - Qwen3's INT4 expert kernels route for themselves (every gate/up and down block picks its
//     slot's expert from the sums; route_choice_folded); the next INT4 GEMV zeroes the sums.
//   - gpt-oss's MXFP4 expert kernels (20b's 32 experts, 120b's 128) route for themselves too
//     (kernels/moe_mxfp4_stream.cuh kMxfp4FoldSums: gate/up after its wait, down before its own,
//     from two launches back); the next MXFP4 or INT4 GEMV zeroes the sums. Routing inside them
//     once cost 4-7%: it took MoE down past the registers of two blocks an SM (ops.cu). Each
//     reads the sums in one L2 trip (moe_route.cuh router_acc_lane_logits).
//   - With more than 128 experts a one-block routing launch follows o (moe_route_folded_kernel):
//     the biased logits, the softmax top-k (route_token), the experts' input scale 16 / rms, and the
//     sums zeroed for the next step; the expert kernels read ids and weights. It measured 1-3%
//     faster for 120b than routing in the kernels while they read the sums in two trips; the o
//     block that finishes last routing instead (a ticket) 1-2% slower.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/linear.cuh"
#include "kernels/moe_route.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

// The routing launch's outputs (gpt-oss): ids and weights [top_k], scale = 16 / rms (the factor
// of the staged row x · γ / 16 that gate/up reads).
struct RouterFoldRoute {
  const float* bias;  // the router's, [n_experts], or null
  int32_t* ids;
  float* weights;
  float* scale;
  int top_k;
  bool normalize;
};

// w [n_experts][n] 16-bit router rows (bf16, or f16), norm the MoE's RMS-norm weights [n]. Each
// thread holds kFoldExpertsPerThread experts' weights for the block's 16·NTB rows: n_experts <=
// kFoldExpertsPerThread · threads and n % (16 · NTB) == 0 (the launchers check).
// The block's rows of x · γ / 16 also go to xg, as f16 in the expert kernel's staged order: the
// gate/up kernel's staged row, which it scales by 16 / rms once the sums give the rms (x · γ
// itself could pass f16's range where a residual has very large entries; / 16 keeps 16x that
// headroom and loses only the relative precision of entries below 2^-10 of the row's scale).
struct RouterFold {
  const uint16_t* w;
  const float* norm;
  __half* xg;
  RouterAcc acc;
  int64_t n_experts;
  bool bf16;
  RouterFoldRoute route;  // moe_route_folded_kernel's (gpt-oss); unused by Qwen3's
};
constexpr int kFoldExpertsPerThread = 2;

__device__ __forceinline__ float fold_weight(uint32_t bits16, bool bf16) {
  return bf16 ? __uint_as_float(bits16 << 16) : __half2float(__ushort_as_half(static_cast<unsigned short>(bits16)));
}

struct NoRouterFold {};  // an o GEMV without the fold

// One o block's part of the fold: the router's columns and the norm's weights of rows row0 ..
// row0 + 16·NTB (loaded before the wait, as the router kernel loaded its rows), then the shares.
template <int NTB>
struct RouterFoldRows {
  static constexpr int kVecs = 2 * NTB;  // 16-byte vectors of an expert's 16·NTB weights
  uint4 fw[kFoldExpertsPerThread][kVecs];
  float gamma = 0.f;  // thread j < 16·NTB: row row0 + j's

  __device__ __forceinline__ void load(const RouterFold& f, int64_t n, int64_t row0) {
#pragma unroll
    for (int i = 0; i < kFoldExpertsPerThread; ++i) {
      const int64_t e = threadIdx.x + i * int64_t(blockDim.x);
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
        if (e < f.n_experts) fw[i][v] = __ldcs(reinterpret_cast<const uint4*>(f.w + e * n + row0) + v);
    }
    if (threadIdx.x < 16 * NTB) gamma = __ldg(f.norm + row0 + threadIdx.x);
  }

  // After the block's rows are stored: s_gh[r] = γ·h and s_hh[r] = h² of its row r (the block
  // synchronised after writing them). One fixed-point add per expert and one for Σh².
  __device__ __forceinline__ void add(const RouterFold& f, const float* s_gh, const float* s_hh) const {
    unsigned long long* sums = f.acc.sums;
#pragma unroll
    for (int i = 0; i < kFoldExpertsPerThread; ++i) {
      const int64_t e = threadIdx.x + i * int64_t(blockDim.x);
      if (e >= f.n_experts) break;
      float dot = 0.f;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const uint32_t u[4] = {fw[i][v].x, fw[i][v].y, fw[i][v].z, fw[i][v].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          dot = fmaf(fold_weight(u[j] & 0xffffu, f.bf16), s_gh[8 * v + 2 * j], dot);
          dot = fmaf(fold_weight(u[j] >> 16, f.bf16), s_gh[8 * v + 2 * j + 1], dot);
        }
      }
      const unsigned long long v = router_acc_fixed(dot, kRouterAccLogitScale);
      for (int r = 0; r < f.acc.replicas; ++r) atomicAdd(sums + r * f.acc.stride + e, v);
    }
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      float ss = 0.f;
      for (int r = lane; r < 16 * NTB; r += 32) ss += s_hh[r];
      ss = warp_sum(ss);
      const unsigned long long v = router_acc_fixed(ss, kRouterAccSquareScale);
      if (lane == 0)
        for (int r = 0; r < f.acc.replicas; ++r) atomicAdd(sums + r * f.acc.stride + f.n_experts, v);
    }
  }
};

// Routes the token from the complete sums (one block): the biased logits, the softmax top-k
// (route_token), scale = 16 / rms; zeroes the sums for the next step (this is their only reader).
__device__ __forceinline__ void route_from_sums(const RouterFold& f) {
  constexpr int kMaxExperts = kMoeMaxExpertsPerLane * 32;
  __shared__ float s_logit[kMaxExperts + 1];
  const int64_t E = f.n_experts;
  for (int64_t i = threadIdx.x; i <= E; i += blockDim.x) {
    const unsigned long long s = __ldcg(f.acc.sums + i);
    f.acc.sums[i] = 0;
    s_logit[i] = float(static_cast<long long>(s));
  }
  __syncthreads();
  const float inv = rsqrtf(s_logit[E] * (1.f / kRouterAccSquareScale) / float(f.acc.hidden) + f.acc.eps);
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x)
    s_logit[e] = s_logit[e] * (1.f / kRouterAccLogitScale) * inv + (f.route.bias ? f.route.bias[e] : 0.f);
  __syncthreads();
  if (threadIdx.x < 32) route_token<true>(s_logit, E, f.route.top_k, f.route.normalize, f.route.ids, f.route.weights);
  if (threadIdx.x == 0) *f.route.scale = kRouterFoldRowInvScale * inv;
}

// The routing as a launch of its own after the folded o GEMV (one block): the gate/up kernel then
// stages xg before its wait (written two launches back).
__global__ void __launch_bounds__(128) moe_route_folded_kernel(RouterFold f) {
  NIBBLE_TIMELINE_BLOCK(kMoeRoute);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  route_from_sums(f);
}

}  // namespace nibble::kernels
