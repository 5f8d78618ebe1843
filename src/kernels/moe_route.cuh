// Top-k routing of one token by one warp, from its router logits: the softmax and each arg-max
// round are warp reductions; ties go to the lower expert id, as in the CPU reference. Shared by
// the routing kernels (moe.cuh) and the MoE decode kernels that route for themselves
// (gemv_mma.cuh).
#pragma once

#include <cmath>
#include <cstdint>

namespace nibble::kernels {

constexpr int kMoeMaxExpertsPerLane = 16;  // 512 experts

// Order-preserving integer key of a logit for the arg-max rounds (-0 -> +0: equal logits, equal
// keys); taken and absent experts have key 0, below every logit's.
__device__ __forceinline__ uint32_t route_key(float v) {
  const uint32_t u = __float_as_uint(v + 0.f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The logit a key was made from.
__device__ __forceinline__ float route_logit(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// One arg-max round over a warp's keys (expert lane + 32 i in key[i], i < per_lane): one warp max
// (redux.sync) finds the best key, one warp min the lowest expert holding it (the CPU reference's
// tie rule), instead of five shuffle rounds of (value, id) pairs. The chosen key is cleared.
// Returns the expert; *best_key its key.
template <int kMaxPerLane>
__device__ __forceinline__ int32_t route_round(uint32_t (&key)[kMaxPerLane], int per_lane, uint32_t* best_key) {
  const int lane = threadIdx.x % 32;
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
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    if (lane + 32 * i == best_e) key[i] = 0u;  // taken
  }
  *best_key = best;
  return best_e;
}

// Routes one token, by one warp: softmax over logits[n_experts], top_k arg-max rounds, ids and
// weights [top_k] written by lanes 0..top_k-1. Logits are read through L2 (__ldcg): they were
// written by another block or kernel; kShared: from shared memory.
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
  uint32_t key[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    key[i] = lane + 32 * i < n_experts ? route_key(v[i]) : 0u;
  }
  float chosen_p = 0.f, top_sum = 0.f;  // lane j keeps the j-th choice
  int32_t chosen = -1;
  for (int64_t j = 0; j < top_k; ++j) {
    uint32_t best;
    const int32_t best_e = route_round(key, per_lane, &best);
    const float p = expf(route_logit(best) - mx) / sum;
    top_sum += p;
    if (lane == j) chosen = best_e, chosen_p = p;
  }
  if (lane < top_k) {
    ids[lane] = chosen;
    weights[lane] = chosen_p / (normalize ? top_sum : 1.f);
  }
}

// The expert of a token's choice s (0-based, s < top_k), by one warp from its logits (through L2):
// s + 1 of route_token's arg-max rounds, the same keys and tie rule, no softmax. The expert
// kernels pick their slot's expert this way when the router leaves the routing to them. Every
// lane returns it; *logit (when given) is its logit.
template <int kMaxPerLane = kMoeMaxExpertsPerLane>
__device__ __forceinline__ int32_t route_choice(const float* __restrict__ l, int64_t n_experts, int64_t s,
                                                float* logit = nullptr) {
  const int lane = threadIdx.x % 32;
  const int per_lane = int((n_experts + 31) / 32);
  uint32_t key[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    const int64_t e = lane + 32 * i;
    key[i] = e < n_experts ? route_key(__ldcg(l + e)) : 0u;
  }
  int32_t e = 0;
  uint32_t best;
  for (int64_t j = 0; j <= s; ++j) e = route_round(key, per_lane, &best);
  if (logit) *logit = route_logit(best);
  return e;
}

// Where the expert kernels route for themselves (gemv_mma.cuh), route_choice with its loops sized
// for at most 4 experts a lane (128) where the logits allow, instead of 16 (512): the routing is on
// every expert block's path to its first weight load, and the smaller loops measured +1.2% tg128
// (Qwen3-30B-A3B INT4, H200, BENCHMARKS.md; why was not measured: less code to fetch, fewer
// registers). g_route_wide = 1 (NIBBLE_ROUTE_WIDE=1, A/B runs): the 16-a-lane loops always.
static __constant__ int g_route_wide = 0;

__device__ __forceinline__ int32_t route_choice_sized(const float* __restrict__ l, int64_t n_experts, int64_t s,
                                                      float* logit = nullptr) {
  if (n_experts <= 128 && !g_route_wide) return route_choice<4>(l, n_experts, s, logit);
  return route_choice(l, n_experts, s, logit);
}

// Σ exp(l - mx) over a token's logits, by one warp (the softmax's denominator).
__device__ __forceinline__ float route_softmax_sum(const float* __restrict__ l, int64_t n_experts, float mx) {
  float sum = 0.f;
  for (int64_t e = threadIdx.x % 32; e < n_experts; e += 32) sum += expf(__ldcg(l + e) - mx);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

}  // namespace nibble::kernels
