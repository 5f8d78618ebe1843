// Token sampling on the device (launcher: backend/cuda/sampling.cu), the semantics of
// backend/sampling.h's sample_logits for one row of n logits:
//   1. sample_max_kernel: the row max (one block);
//   2. sample_weights_kernel: the softmax numerators exp((x - max) / T) and the token ids;
//   3. a stable radix sort by weight, descending (CUB): ties stay in ascending id order, the
//      reference's candidate order;
//   4. sample_draw_kernel (one block): top-k, min-p, the kept mass, the top-p prefix and the draw,
//      each prefix found by a block-wide scan in f64 (the reference sums in f64) that stops at the
//      first chunk reaching its target, so a peaked distribution reads a few chunks, not the row.
// The parameters (and the uniform number) are read from device memory: a recorded step serves
// every request's parameters.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "backend/sampling.h"

namespace nibble::kernels {

constexpr int kSampleThreads = 1024;

__global__ void __launch_bounds__(kSampleThreads) sample_max_kernel(const float* __restrict__ x, int64_t n,
                                                                    float* __restrict__ max_out) {
  using Reduce = cub::BlockReduce<float, kSampleThreads>;
  __shared__ typename Reduce::TempStorage temp;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += kSampleThreads) m = fmaxf(m, x[i]);
  m = Reduce(temp).Reduce(m, [](float a, float b) { return fmaxf(a, b); });
  if (threadIdx.x == 0) *max_out = m;
}

__global__ void sample_weights_kernel(const float* __restrict__ x, int64_t n, const float* __restrict__ max_in,
                                      const SampleInputs* __restrict__ in, float* __restrict__ w,
                                      int32_t* __restrict__ ids) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  w[i] = expf((x[i] - *max_in) / in->temperature);
  ids[i] = int32_t(i);
}

// The first i in [0, count) whose inclusive prefix sum of w (f64) satisfies `hit`, with that prefix;
// (-1, total) when none does. Called by every thread of the block.
template <typename Hit>
__device__ void sample_first_prefix(const float* __restrict__ w, int64_t count, Hit hit, int64_t& index,
                                    double& prefix) {
  using Scan = cub::BlockScan<double, kSampleThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ double s_carry, s_prefix;
  __shared__ int64_t s_index;
  if (threadIdx.x == 0) s_carry = 0, s_index = -1;
  __syncthreads();
  for (int64_t c0 = 0; c0 < count; c0 += kSampleThreads) {
    const int64_t i = c0 + threadIdx.x;
    double v = i < count ? double(w[i]) : 0.0, incl;
    Scan(temp).InclusiveSum(v, incl);
    incl += s_carry;
    const bool mine = i < count && hit(incl);
    // The lowest hitting index of the chunk: prefix sums grow with i, so hits are a suffix.
    const bool first = mine && (threadIdx.x == 0 || !hit(incl - v));
    __syncthreads();  // everyone has read s_carry
    if (first) s_index = i, s_prefix = incl;
    if (threadIdx.x == kSampleThreads - 1) s_carry = incl;
    __syncthreads();
    if (s_index >= 0) break;
  }
  index = s_index;
  prefix = s_index >= 0 ? s_prefix : s_carry;
}

// w / ids sorted by weight, descending, ties by ascending id.
__global__ void __launch_bounds__(kSampleThreads) sample_draw_kernel(const float* __restrict__ w,
                                                                     const int32_t* __restrict__ ids, int64_t n,
                                                                     const SampleInputs* __restrict__ in,
                                                                     int32_t* __restrict__ out) {
  const SampleInputs p = *in;
  int64_t keep = p.top_k > 0 ? min(n, int64_t(p.top_k)) : n;
  int64_t index;
  double kept;
  if (p.min_p > 0.f) {  // drop the tail below min_p x the best (always keeping the best)
    const float threshold = p.min_p * w[0];
    __shared__ int64_t s_first_below;
    if (threadIdx.x == 0) s_first_below = keep;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < keep; i += kSampleThreads)
      if (w[i] < threshold) atomicMin(reinterpret_cast<unsigned long long*>(&s_first_below), (unsigned long long)i);
    __syncthreads();
    keep = max(int64_t(1), s_first_below);
  }
  sample_first_prefix(w, keep, [](double) { return false; }, index, kept);  // the kept mass
  if (p.top_p < 1.f) {
    const double target = double(p.top_p) * kept * (1 - 1e-6);
    sample_first_prefix(w, keep, [target](double s) { return s >= target; }, index, kept);
    if (index >= 0) keep = index + 1;
  }
  const double r = p.uniform * kept;
  sample_first_prefix(w, keep, [r](double s) { return r < s; }, index, kept);
  if (threadIdx.x == 0) *out = ids[index >= 0 ? index : keep - 1];
}

}  // namespace nibble::kernels
