// MoE routing and the row movement around per-expert GEMMs. route: one thread per token computes
// the softmax over n_experts logits and selects top-k by repeated arg-max (lower id wins ties, as
// the CPU reference does). gather/scatter move token rows to and from an expert's contiguous batch;
// scatter_add_weighted accumulates `weight · row` into the token's output row. A token's top-k
// experts are distinct, and one launch handles one expert, so no two threads add to one element.
#pragma once

#include <cstdint>

namespace nibble::kernels {

constexpr int64_t kMoeMaxTopK = 32;

__global__ void moe_route_kernel(const float* __restrict__ logits, int64_t m, int64_t n_experts,
                                 int64_t top_k, bool normalize, int32_t* __restrict__ ids,
                                 float* __restrict__ weights) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= m) return;
  const float* l = logits + t * n_experts;
  float mx = -INFINITY;
  for (int64_t e = 0; e < n_experts; ++e) mx = fmaxf(mx, l[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < n_experts; ++e) sum += expf(l[e] - mx);
  int32_t chosen[kMoeMaxTopK];
  float chosen_p[kMoeMaxTopK], top_sum = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    int32_t best = -1;
    float best_l = -INFINITY;
    for (int64_t e = 0; e < n_experts; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken |= chosen[i] == e;
      if (!taken && (best < 0 || l[e] > best_l)) best = int32_t(e), best_l = l[e];
    }
    chosen[j] = best;
    chosen_p[j] = expf(best_l - mx) / sum;
    top_sum += chosen_p[j];
  }
  for (int64_t j = 0; j < top_k; ++j) {
    ids[t * top_k + j] = chosen[j];
    weights[t * top_k + j] = chosen_p[j] / (normalize ? top_sum : 1.f);
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
