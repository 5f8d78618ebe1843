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

// Routes one token, by one warp: softmax over its logits (logit_of(e), e < n_experts), top_k
// arg-max rounds, ids and weights [top_k] written by lanes 0..top_k-1.
// route_token_by from this lane's logits, v[i] for expert lane + 32 i (i < per_lane; -inf past
// n_experts).
template <int kMaxPerLane>
__device__ __forceinline__ void route_token_values(const float (&v)[kMaxPerLane], int64_t n_experts, int64_t top_k,
                                                   bool normalize, int32_t* __restrict__ ids,
                                                   float* __restrict__ weights) {
  const int lane = threadIdx.x % 32;
  const int per_lane = int((n_experts + 31) / 32);
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    mx = fmaxf(mx, v[i]);
  }
  // Renormalised over the top k, the softmax's full sum cancels and its maximum is the first
  // choice's logit: the two warp reductions are left out (they were on the routing's serial path).
  float sum = 1.f;
  if (!normalize) {
    for (int offset = 16; offset > 0; offset >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
    sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      if (i >= per_lane) break;
      if (lane + 32 * i < n_experts) sum += expf(v[i] - mx);
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
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
    if (normalize && j == 0) mx = route_logit(best);
    const float p = expf(route_logit(best) - mx) / sum;
    top_sum += p;
    if (lane == j) chosen = best_e, chosen_p = p;
  }
  if (lane < top_k) {
    ids[lane] = chosen;
    weights[lane] = chosen_p / (normalize ? top_sum : 1.f);
  }
}

template <int kMaxPerLane = kMoeMaxExpertsPerLane, typename Logit>
__device__ __forceinline__ void route_token_by(Logit&& logit_of, int64_t n_experts, int64_t top_k, bool normalize,
                                               int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int lane = threadIdx.x % 32;
  // Only the first `per_lane` slots hold experts (4 for 128 experts): the unrolled loops stop
  // there, which keeps the 8 serial arg-max rounds short; v stays in registers.
  const int per_lane = int((n_experts + 31) / 32);
  float v[kMaxPerLane];  // expert lane + 32 i
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    const int64_t e = lane + 32 * i;
    v[i] = e < n_experts ? logit_of(e) : -INFINITY;
  }
  route_token_values(v, n_experts, top_k, normalize, ids, weights);
}

// This lane's arg-max keys from the logits: key[i] for expert lane + 32 i (0 past n_experts).
template <int kMaxPerLane, typename Logit>
__device__ __forceinline__ void route_keys_by(Logit&& logit_of, int64_t n_experts, uint32_t (&key)[kMaxPerLane]) {
  const int lane = threadIdx.x % 32;
  const int per_lane = int((n_experts + 31) / 32);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    if (i >= per_lane) break;
    const int64_t e = lane + 32 * i;
    key[i] = e < n_experts ? route_key(logit_of(e)) : 0u;
  }
}

// The rounds shared by the routing forms below, from this lane's keys (route_keys_by /
// route_keys_values): the top_k experts into ids (ids[j] the j-th choice, lanes < top_k), or the
// expert of choice s (s + 1 rounds; *logit its logit when given).
template <int kMaxPerLane>
__device__ __forceinline__ void route_ids_from_keys(uint32_t (&key)[kMaxPerLane], int per_lane, int64_t top_k,
                                                    int32_t* __restrict__ ids) {
  const int lane = threadIdx.x % 32;
  int32_t chosen = -1;
  for (int64_t j = 0; j < top_k; ++j) {
    uint32_t best;
    const int32_t best_e = route_round(key, per_lane, &best);
    if (lane == j) chosen = best_e;
  }
  if (lane < top_k) ids[lane] = chosen;
}
template <int kMaxPerLane>
__device__ __forceinline__ int32_t route_choice_from_keys(uint32_t (&key)[kMaxPerLane], int per_lane, int64_t s,
                                                          float* logit) {
  int32_t e = 0;
  uint32_t best;
  for (int64_t j = 0; j <= s; ++j) e = route_round(key, per_lane, &best);
  if (logit) *logit = route_logit(best);
  return e;
}

// route_keys_by from this lane's logits v[i] (expert lane + 32 i).
template <int kMaxPerLane>
__device__ __forceinline__ void route_keys_values(const float (&v)[kMaxPerLane], int64_t n_experts,
                                                  uint32_t (&key)[kMaxPerLane]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) key[i] = lane + 32 * i < n_experts ? route_key(v[i]) : 0u;
}

// route_ids_by and route_choice_by from this lane's logits v[i] (expert lane + 32 i).
template <int kMaxPerLane>
__device__ __forceinline__ void route_ids_values(const float (&v)[kMaxPerLane], int64_t n_experts, int64_t top_k,
                                                 int32_t* __restrict__ ids) {
  uint32_t key[kMaxPerLane];
  route_keys_values(v, n_experts, key);
  route_ids_from_keys(key, int((n_experts + 31) / 32), top_k, ids);
}
template <int kMaxPerLane>
__device__ __forceinline__ int32_t route_choice_values(const float (&v)[kMaxPerLane], int64_t n_experts, int64_t s,
                                                       float* logit = nullptr) {
  uint32_t key[kMaxPerLane];
  route_keys_values(v, n_experts, key);
  return route_choice_from_keys(key, int((n_experts + 31) / 32), s, logit);
}

// The top_k experts only (ids[j] the j-th choice, lanes < top_k), by one warp: route_token_by's
// keys, rounds and tie rule without the softmax, for a kernel that needs no weights.
template <int kMaxPerLane = kMoeMaxExpertsPerLane, typename Logit>
__device__ __forceinline__ void route_ids_by(Logit&& logit_of, int64_t n_experts, int64_t top_k,
                                             int32_t* __restrict__ ids) {
  uint32_t key[kMaxPerLane];
  route_keys_by(logit_of, n_experts, key);
  route_ids_from_keys(key, int((n_experts + 31) / 32), top_k, ids);
}

// route_token_by from logits[n_experts], read through L2 (__ldcg): they were written by another
// block or kernel; kShared: from shared memory.
template <bool kShared = false, int kMaxPerLane = kMoeMaxExpertsPerLane>
__device__ __forceinline__ void route_token(const float* __restrict__ l, int64_t n_experts, int64_t top_k,
                                            bool normalize, int32_t* __restrict__ ids,
                                            float* __restrict__ weights) {
  route_token_by<kMaxPerLane>([&](int64_t e) { return kShared ? l[e] : __ldcg(l + e); }, n_experts, top_k, normalize,
                              ids, weights);
}

// The expert of a token's choice s (0-based, s < top_k), by one warp from its logits (through L2):
// s + 1 of route_token's arg-max rounds, the same keys and tie rule, no softmax. The expert
// kernels pick their slot's expert this way when the router leaves the routing to them. Every
// lane returns it; *logit (when given) is its logit. route_choice_by takes the logits from
// logit(e) instead (the folded router's sums, RouterAcc below).
template <int kMaxPerLane = kMoeMaxExpertsPerLane, typename Logit>
__device__ __forceinline__ int32_t route_choice_by(Logit&& logit_of, int64_t n_experts, int64_t s,
                                                   float* logit = nullptr) {
  uint32_t key[kMaxPerLane];
  route_keys_by(logit_of, n_experts, key);
  return route_choice_from_keys(key, int((n_experts + 31) / 32), s, logit);
}

template <int kMaxPerLane = kMoeMaxExpertsPerLane>
__device__ __forceinline__ int32_t route_choice(const float* __restrict__ l, int64_t n_experts, int64_t s,
                                                float* logit = nullptr) {
  return route_choice_by<kMaxPerLane>([&](int64_t e) { return __ldcg(l + e); }, n_experts, s, logit);
}

// Where the expert kernels route for themselves (gemv_mma.cuh), route_choice with its loops sized
// for at most 4 experts a lane (128) where the logits allow, instead of 16 (512): the routing is on
// every expert block's path to its first weight load, and the smaller loops measured +1.2% tg128
// (Qwen3-30B-A3B INT4, H200, BENCHMARKS.md; why was not measured: less code to fetch, fewer
// registers). g_route_wide = 1 (NIBBLE_ROUTE_WIDE=1, A/B runs): the 16-a-lane loops always.
static __constant__ int g_route_wide = 0;

template <typename Logit>
__device__ __forceinline__ int32_t route_choice_sized_by(Logit&& logit_of, int64_t n_experts, int64_t s,
                                                         float* logit = nullptr) {
  if (n_experts <= 128 && !g_route_wide) return route_choice_by<4>(logit_of, n_experts, s, logit);
  return route_choice_by(logit_of, n_experts, s, logit);
}

__device__ __forceinline__ int32_t route_choice_sized(const float* __restrict__ l, int64_t n_experts, int64_t s,
                                                      float* logit = nullptr) {
  return route_choice_sized_by([&](int64_t e) { return __ldcg(l + e); }, n_experts, s, logit);
}

// Σ exp(l - mx) over a token's logits, by one warp (the softmax's denominator); _by: logit(e).
template <typename Logit>
__device__ __forceinline__ float route_softmax_sum_by(Logit&& logit_of, int64_t n_experts, float mx) {
  float sum = 0.f;
  for (int64_t e = threadIdx.x % 32; e < n_experts; e += 32) sum += expf(logit_of(e) - mx);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

template <int kMaxPerLane>
__device__ __forceinline__ float route_softmax_sum_values(const float (&v)[kMaxPerLane], int64_t n_experts, float mx) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + 32 * i < n_experts) sum += expf(v[i] - mx);
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

__device__ __forceinline__ float route_softmax_sum(const float* __restrict__ l, int64_t n_experts, float mx) {
  return route_softmax_sum_by([&](int64_t e) { return __ldcg(l + e); }, n_experts, mx);
}

// The router folded into the previous projection (the o GEMV, gemv_mma.cuh RouterFold): a decode
// step's router reads the residual row that the o projection's blocks have just written, so
// instead of a launch of its own each o block adds its 16 rows' share of every logit,
// Σ_j W[e, j] γ_j h_j, and of Σ_j h_j², to sums[replica][0..E) and sums[replica][E]. The shares
// are 64-bit fixed point, added as integers: the sums do not depend on the order the blocks
// arrive in, so the routing is as deterministic as a single kernel's. The RMS norm is linear in
// the logits, so it applies to the sums: logit_e = sum_e · 2^-32 · rsqrt(Σh² · 2^-24 / H + eps).
// Every o block adds to each of `replicas` copies, and expert block b reads copy b mod replicas
// (one copy measured best: 4, 8 and 16 took -0.5, -1.9 and -2.5% tg128 in their extra atomics;
// entries spread over more lines, -1.1 to -1.6%, BENCHMARKS.md). The readers' loads of the
// entries must all be in flight at once: a loop over copies per entry put them in series and
// lost 3%.
// The kernel after MoE down (the next q/k/v GEMV, GemvIo::clear) zeroes them for the next step:
// by its wait both readers, gate/up and down, are done. (So for gpt-oss-20b's MXFP4 experts; with
// a routing launch after o, that launch is the one reader and zeroes them itself: router_fold.cuh.)
// replicas is a power of two: a reader finds its copy with a mask, since a modulo's ~20
// instructions of integer division sat between gate/up's PDL wait and its sums' load.
struct RouterAcc {
  unsigned long long* sums;  // [replicas][stride]
  int replicas;              // a power of two
  // This block's copy.
  __device__ __forceinline__ const unsigned long long* copy() const {
    return sums + int64_t(blockIdx.x & unsigned(replicas - 1)) * stride;
  }
  int64_t stride;  // >= n_experts + 1
  int64_t hidden;
  float eps;
};

constexpr float kRouterFoldRowInvScale = 16.f;         // the staged row is x · γ / 16
constexpr float kRouterAccLogitScale = 4294967296.f;  // 2^32: |a block's share| < 2^23 fits
constexpr float kRouterAccSquareScale = 16777216.f;   // 2^24: a block's Σh² < 2^31 fits

// A share as fixed point, clamped to ±2^55 so that 256 shares cannot overflow.
__device__ __forceinline__ unsigned long long router_acc_fixed(float v, float scale) {
  const float lim = 36028797018963968.f;  // 2^55
  return static_cast<unsigned long long>(__float2ll_rn(fminf(fmaxf(v * scale, -lim), lim)));
}

// Entry i of this block's copy (through L2: written by another kernel's atomics):
// hundreds of expert blocks read the sums at once, each copy on lines of its own.
__device__ __forceinline__ float router_acc_entry(const RouterAcc& a, int64_t i) {
  const unsigned long long s = __ldcg(a.copy() + i);
  return float(static_cast<long long>(s));
}

// 1 / rms of the row: the logits' factor and the staged row's.
__device__ __forceinline__ float router_acc_inv_rms(const RouterAcc& a, int64_t n_experts) {
  const float ss = router_acc_entry(a, n_experts) * (1.f / kRouterAccSquareScale);
  return rsqrtf(ss / float(a.hidden) + a.eps);
}

__device__ __forceinline__ float router_acc_logit(const RouterAcc& a, int64_t e, float inv) {
  return router_acc_entry(a, e) * (1.f / kRouterAccLogitScale) * inv;
}

// This lane's logits from a folded router's sums (expert lane + 32 i in v[i], -inf past
// n_experts; the bias, or null, added), the same arithmetic as router_acc_logit; returns 1 / rms.
// Every load (the lane's sums, Σh², the bias) is issued before any is used: one L2 round trip,
// where reading Σh² first, for the 1 / rms the logits are scaled by, made two on the expert
// kernels' path from their wait to their first weight load (Qwen3-30B-A3B INT4 tg128 +1.1% at
// depth 0, gpt-oss-20b +0.5%, and gpt-oss-120b's expert kernels routing for themselves 1.8%
// ahead of its routing launch; H100, BENCHMARKS.md). Up to 4 experts a lane (128): more would hold
// too many registers in the expert kernels (they take the two trips, route_token_folded).
template <int kMaxPerLane>
__device__ __forceinline__ float router_acc_lane_logits(const RouterAcc& a, const float* __restrict__ bias,
                                                        int64_t n_experts, float (&v)[kMaxPerLane]) {
  static_assert(kMaxPerLane <= 4);
  const int lane = threadIdx.x % 32;
  const unsigned long long* sums = a.copy();
  unsigned long long raw[kMaxPerLane];
  float b[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int64_t e = lane + 32 * i;
    raw[i] = e < n_experts ? __ldcg(sums + e) : 0ull;
    b[i] = e < n_experts && bias ? __ldg(bias + e) : 0.f;
  }
  const float ss = float(static_cast<long long>(__ldcg(sums + n_experts))) * (1.f / kRouterAccSquareScale);
  const float inv = rsqrtf(ss / float(a.hidden) + a.eps);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const float logit = float(static_cast<long long>(raw[i])) * (1.f / kRouterAccLogitScale) * inv;
    v[i] = lane + 32 * i < n_experts ? (bias ? logit + b[i] : logit) : -INFINITY;
  }
  return inv;
}

// A token routed by one warp from a folded router's complete sums, as route_token: the logits
// with the router's bias (or null) added, the softmax top k into ids and weights (lanes < top_k).
// gpt-oss's MXFP4 expert kernels route this way (kernels/moe_mxfp4_stream.cuh). Returns 1 / rms.
// weights null: the ids only (route_ids_by).
template <int kMaxPerLane>
__device__ __forceinline__ float route_token_folded(const RouterAcc& a, const float* __restrict__ bias,
                                                    int64_t n_experts, int64_t top_k, bool normalize,
                                                    int32_t* __restrict__ ids, float* __restrict__ weights) {
  if constexpr (kMaxPerLane <= 4) {
    float v[kMaxPerLane];
    const float inv = router_acc_lane_logits(a, bias, n_experts, v);
    if (weights)
      route_token_values(v, n_experts, top_k, normalize, ids, weights);
    else
      route_ids_values(v, n_experts, top_k, ids);
    return inv;
  } else {
    const float inv = router_acc_inv_rms(a, n_experts);
    auto logit_of = [&](int64_t e) { return router_acc_logit(a, e, inv) + (bias ? __ldg(bias + e) : 0.f); };
    if (weights)
      route_token_by<kMaxPerLane>(logit_of, n_experts, top_k, normalize, ids, weights);
    else
      route_ids_by<kMaxPerLane>(logit_of, n_experts, top_k, ids);
    return inv;
  }
}

// The expert of choice s (route_choice_sized_by's rounds) from a folded router's sums in one L2
// round trip (router_acc_lane_logits); *inv = 1 / rms; *logit (when given) the choice's logit,
// *softmax_sum (when given) Σ exp(l - max) over all experts (the choice s = 0 holds the maximum).
__device__ __forceinline__ int32_t route_choice_folded(const RouterAcc& a, int64_t n_experts, int64_t s, float* inv,
                                                       float* logit = nullptr, float* softmax_sum = nullptr) {
  auto pick = [&](auto& v) {
    *inv = router_acc_lane_logits(a, nullptr, n_experts, v);
    float l;
    const int32_t e = route_choice_values(v, n_experts, s, &l);
    if (logit) *logit = l;
    if (softmax_sum) *softmax_sum = route_softmax_sum_values(v, n_experts, l);
    return e;
  };
  if (n_experts <= 128) {
    float v[4];
    return pick(v);
  }
  // More experts: Σh² first, then the logits (router_acc_lane_logits' limit).
  *inv = router_acc_inv_rms(a, n_experts);
  auto logit_of = [&](int64_t e) { return router_acc_logit(a, e, *inv); };
  float l;
  const int32_t e = route_choice_by(logit_of, n_experts, s, &l);
  if (logit) *logit = l;
  if (softmax_sum) *softmax_sum = route_softmax_sum_by(logit_of, n_experts, l);
  return e;
}

}  // namespace nibble::kernels
