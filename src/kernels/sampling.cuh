// Token sampling on the device (launcher: backend/cuda/sampling.cu), the semantics of
// backend/sampling.h's sample_logits for one row of n logits:
//   1. sample_max_kernel: the row max (one block);
//   2. sample_weights_kernel: the softmax numerators exp((x - max) / T) and the token ids;
//   3. a stable radix sort by weight, descending (CUB): ties stay in ascending id order, the
//      reference's candidate order;
//   4. sample_chunk_sums_kernel: f64 sums of the sorted weights per chunk of 1024;
//   5. sample_draw_kernel (one block): top-k, min-p, the kept mass, the top-p prefix and the draw,
//      each prefix found by a two-level block scan in f64 (the reference sums in f64): over the
//      chunk sums, then within the chunk that reaches the target.
// penalties_kernel, before any of them, penalises rows of logits in place (apply_penalties).
// The parameters (and the uniform number) are read from device memory: a recorded step serves
// every request's parameters.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "backend/sampling.h"

namespace nibble::kernels {

constexpr int kSampleThreads = 1024;

// Grid (rows, slices): row blockIdx.x's tokens, strided over the slices. A row's tokens are
// distinct, so no two threads touch one logit. The rounding steps are explicit (no contraction
// into an FMA) so the result is the reference's bit for bit.
__global__ void penalties_kernel(float* __restrict__ logits, int64_t n, const PenaltyRow* __restrict__ rows,
                                 const PenaltyToken* __restrict__ tokens) {
  const PenaltyRow r = rows[blockIdx.x];
  float* row = logits + r.logits_row * n;
  for (int64_t i = int64_t(blockIdx.y) * blockDim.x + threadIdx.x; i < r.count; i += int64_t(gridDim.y) * blockDim.x) {
    const PenaltyToken t = tokens[r.first + i];
    if (t.id < 0 || t.id >= n) continue;
    float l = row[t.id];
    l = l > 0 ? __fdiv_rn(l, r.penalties.repetition) : __fmul_rn(l, r.penalties.repetition);
    if (t.output_count > 0)
      l = __fsub_rn(l, __fadd_rn(__fmul_rn(r.penalties.frequency, float(t.output_count)), r.penalties.presence));
    row[t.id] = l;
  }
}

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

// Sums of the sorted weights per chunk of kSampleThreads (f64), one block per chunk: the first
// level of sample_first_prefix's search.
__global__ void __launch_bounds__(kSampleThreads) sample_chunk_sums_kernel(const float* __restrict__ w, int64_t n,
                                                                           double* __restrict__ chunk_sums) {
  using Reduce = cub::BlockReduce<double, kSampleThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t i = int64_t(blockIdx.x) * kSampleThreads + threadIdx.x;
  const double sum = Reduce(temp).Sum(i < n ? double(w[i]) : 0.0);
  if (threadIdx.x == 0) chunk_sums[blockIdx.x] = sum;
}

// The first i in [0, count) whose inclusive prefix sum of w (f64) satisfies `hit` (monotone: false
// then true), with that prefix; (-1, total) when none does. Two levels: a block scan over the
// chunks' sums (the last, partial chunk summed here) finds the chunk, a scan within it the index.
// Called by every thread of the block; count <= kSampleThreads² (sample_max_vocab).
template <typename Hit>
__device__ void sample_first_prefix(const float* __restrict__ w, const double* __restrict__ chunk_sums,
                                    int64_t count, Hit hit, int64_t& index, double& prefix) {
  using Scan = cub::BlockScan<double, kSampleThreads>;
  using Reduce = cub::BlockReduce<double, kSampleThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ double s_partial, s_carry, s_chunk_sum, s_prefix, s_total;
  __shared__ int64_t s_chunk, s_index;
  const int64_t n_chunks = (count + kSampleThreads - 1) / kSampleThreads, last = n_chunks - 1;
  const int tid = threadIdx.x;
  // The last chunk may be cut by count (top-k, min-p, top-p): sum its first elements here.
  {
    const int64_t i = last * kSampleThreads + tid;
    const double partial = Reduce(temp.reduce).Sum(i < count ? double(w[i]) : 0.0);
    if (tid == 0) s_partial = partial, s_chunk = -1, s_index = -1;
    __syncthreads();
  }
  double v = tid < n_chunks ? (tid == last ? s_partial : chunk_sums[tid]) : 0.0, incl;
  Scan(temp.scan).InclusiveSum(v, incl);
  if (tid < n_chunks && hit(incl) && (tid == 0 || !hit(incl - v))) s_chunk = tid, s_carry = incl - v, s_chunk_sum = v;
  if (tid == kSampleThreads - 1) s_total = incl;
  __syncthreads();
  if (s_chunk < 0) {
    index = -1;
    prefix = s_total;
    return;
  }
  const int64_t i = s_chunk * kSampleThreads + tid;
  const double x = i < count ? double(w[i]) : 0.0;
  double within;
  __syncthreads();  // temp is reused
  Scan(temp.scan).InclusiveSum(x, within);
  within += s_carry;
  if (i < count && hit(within) && (tid == 0 || !hit(within - x))) s_index = i, s_prefix = within;
  __syncthreads();
  if (s_index >= 0) {
    index = s_index;
    prefix = s_prefix;
  } else {  // the chunk's sum reached the target but its scan, rounded another way, fell short by an ulp
    index = ::min(count, (s_chunk + 1) * kSampleThreads) - 1;
    prefix = s_carry + s_chunk_sum;
  }
}

// w / ids sorted by weight, descending, ties by ascending id.
__global__ void __launch_bounds__(kSampleThreads) sample_draw_kernel(const float* __restrict__ w,
                                                                     const double* __restrict__ chunk_sums,
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
  sample_first_prefix(w, chunk_sums, keep, [](double) { return false; }, index, kept);  // the kept mass
  if (p.top_p < 1.f) {
    const double target = double(p.top_p) * kept * (1 - 1e-6);
    sample_first_prefix(w, chunk_sums, keep, [target](double s) { return s >= target; }, index, kept);
    if (index >= 0) keep = index + 1;
  }
  const double r = p.uniform * kept;
  sample_first_prefix(w, chunk_sums, keep, [r](double s) { return r < s; }, index, kept);
  if (threadIdx.x == 0) *out = ids[index >= 0 ? index : keep - 1];
}

}  // namespace nibble::kernels
