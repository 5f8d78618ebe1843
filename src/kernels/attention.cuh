// Causal GQA attention over a contiguous f32 KV cache [ctx, n_head_kv, head_dim]. One warp per
// (token, q head) streams its context with an online softmax (running max and sum), each lane
// holding head_dim/32 output dimensions, so any context length works without scratch memory.
// This is the exact first version; split-K flash-decoding replaces it for speed.
#pragma once

#include <cstdint>

#include "kernels/linear.cuh"
#include "kernels/pdl.cuh"

namespace nibble::kernels {

constexpr int64_t kAttentionMaxHeadDim = 256;

// One step of the online softmax: folds a score and its value row (this lane's dims
// lane + 32 j) into the running max, running sum and unnormalised output.
template <int kPerLane>
__device__ __forceinline__ void online_softmax_step(float score, const float (&v)[kPerLane],
                                                    float& running_max, float& running_sum,
                                                    float (&acc)[kPerLane]) {
  const float new_max = fmaxf(running_max, score);
  const float correction = expf(running_max - new_max), p = expf(score - new_max);
  running_sum = running_sum * correction + p;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = acc[j] * correction + p * v[j];
  running_max = new_max;
}

__global__ void attention_online_warp_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                             const float* __restrict__ v, float* __restrict__ out,
                                             int64_t m, const int32_t* __restrict__ positions,
                                             int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale) {
  const int64_t pair = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= m * n_head) return;
  const int64_t t = pair / n_head, h = pair % n_head, kv = h / (n_head / n_head_kv);
  const float* qh = q + pair * head_dim;
  constexpr int kPerLane = kAttentionMaxHeadDim / 32;
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = d < head_dim ? qh[d] : 0.f;
    acc[j] = 0.f;
  }
  float running_max = -INFINITY, running_sum = 0.f;
  const int64_t n_ctx = int64_t(positions[t]) + 1;
  for (int64_t pos = 0; pos < n_ctx; ++pos) {
    const float* kp = k + (pos * n_head_kv + kv) * head_dim;
    const float* vp = v + (pos * n_head_kv + kv) * head_dim;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < head_dim) dot += qv[j] * kp[d];
    }
    float vr[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) vr[j] = lane + 32 * j < head_dim ? vp[lane + 32 * j] : 0.f;
    online_softmax_step(warp_sum(dot) * scale, vr, running_max, running_sum, acc);
  }
  float* oh = out + pair * head_dim;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < head_dim) oh[d] = acc[j] / running_sum;
  }
}

// Split-K (flash-decoding) attention for short query blocks over long contexts. Stage 1: block
// (token·head, split) covers context positions [split·kSplit, (split+1)·kSplit) of that token's
// causal range; its warps take every 4th position with an online softmax, then merge in shared
// memory and write the split's (max, sum, unnormalised output). Stage 2 merges the splits.
constexpr int kAttentionSplit = 256;
constexpr int kAttentionSplitWarps = 4;

__global__ void attention_split_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                       const float* __restrict__ v, float* __restrict__ partial,
                                       const int32_t* __restrict__ positions, int64_t n_head,
                                       int64_t n_head_kv, int64_t head_dim, float scale, int64_t n_splits) {
  pdl_enter();
  constexpr int kPerLane = kAttentionMaxHeadDim / 32;
  __shared__ float s_max[kAttentionSplitWarps], s_sum[kAttentionSplitWarps];
  __shared__ float s_acc[kAttentionSplitWarps][kAttentionMaxHeadDim];
  const int64_t pair = blockIdx.x, split = blockIdx.y;
  const int64_t t = pair / n_head, h = pair % n_head, kv = h / (n_head / n_head_kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_ctx = int64_t(positions[t]) + 1;
  const int64_t begin = split * kAttentionSplit, end = min(n_ctx, begin + kAttentionSplit);
  const float* qh = q + pair * head_dim;
  float qv[kPerLane], acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    qv[j] = d < head_dim ? qh[d] * scale : 0.f;
    acc[j] = 0.f;
  }
  float running_max = -INFINITY, running_sum = 0.f;
  for (int64_t pos = begin + warp; pos < end; pos += kAttentionSplitWarps) {
    const float* kp = k + (pos * n_head_kv + kv) * head_dim;
    const float* vp = v + (pos * n_head_kv + kv) * head_dim;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < head_dim) dot += qv[j] * kp[d];
    }
    float vr[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) vr[j] = lane + 32 * j < head_dim ? vp[lane + 32 * j] : 0.f;
    online_softmax_step(warp_sum(dot), vr, running_max, running_sum, acc);
  }
  if (lane == 0) s_max[warp] = running_max, s_sum[warp] = running_sum;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j)
    if (lane + 32 * j < head_dim) s_acc[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  float* out = partial + (pair * n_splits + split) * (head_dim + 2);
  float block_max = -INFINITY;
  for (int w = 0; w < kAttentionSplitWarps; ++w) block_max = fmaxf(block_max, s_max[w]);
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kAttentionSplitWarps; ++w)
      if (s_sum[w] > 0.f) o += s_acc[w][d] * expf(s_max[w] - block_max);
    out[2 + d] = o;
  }
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int w = 0; w < kAttentionSplitWarps; ++w)
      if (s_sum[w] > 0.f) sum += s_sum[w] * expf(s_max[w] - block_max);
    out[0] = block_max;
    out[1] = sum;
  }
}

// The same split-K attention with GQA sharing: block (token, kv head, split) computes all G q
// heads that read this kv head, so each K and V row is loaded once for all of them instead of once
// per q head. Lane l holds dims l + 32 j of every head's q and accumulator. Writes the same
// partials as attention_split_kernel (one per q head and split).
template <int G>
__global__ void attention_split_gqa_kernel(const float* __restrict__ q, const float* __restrict__ k,
                                           const float* __restrict__ v, float* __restrict__ partial,
                                           const int32_t* __restrict__ positions, int64_t n_head,
                                           int64_t n_head_kv, int64_t head_dim, float scale, int64_t n_splits) {
  pdl_enter();
  constexpr int kPerLane = kAttentionMaxHeadDim / 64;  // head_dim <= 128 here
  __shared__ float s_max[kAttentionSplitWarps][G], s_sum[kAttentionSplitWarps][G];
  __shared__ float s_acc[kAttentionSplitWarps][G][kAttentionMaxHeadDim / 2];
  const int64_t t = blockIdx.x / n_head_kv, kv = blockIdx.x % n_head_kv, split = blockIdx.y;
  const int64_t group = n_head / n_head_kv;  // q heads kv * group .. + group - 1
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_ctx = int64_t(positions[t]) + 1;
  const int64_t begin = split * kAttentionSplit, end = min(n_ctx, begin + kAttentionSplit);
  float qv[G][kPerLane], acc[G][kPerLane], running_max[G], running_sum[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    running_max[h] = -INFINITY;
    running_sum[h] = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      qv[h][j] = h < group && d < head_dim ? q[((t * n_head) + kv * group + h) * head_dim + d] * scale : 0.f;
      acc[h][j] = 0.f;
    }
  }
  for (int64_t pos = begin + warp; pos < end; pos += kAttentionSplitWarps) {
    const float* kp = k + (pos * n_head_kv + kv) * head_dim;
    const float* vp = v + (pos * n_head_kv + kv) * head_dim;
    float kr[kPerLane], vr[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      kr[j] = d < head_dim ? kp[d] : 0.f;
      vr[j] = d < head_dim ? vp[d] : 0.f;
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) dot += qv[h][j] * kr[j];
      online_softmax_step(warp_sum(dot), vr, running_max[h], running_sum[h], acc[h]);
    }
  }
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == 0) s_max[warp][h] = running_max[h], s_sum[warp][h] = running_sum[h];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < head_dim) s_acc[warp][h][lane + 32 * j] = acc[h][j];
  }
  __syncthreads();
  for (int64_t h = 0; h < group && h < G; ++h) {
    float* out = partial + (((t * n_head) + kv * group + h) * n_splits + split) * (head_dim + 2);
    float block_max = -INFINITY;
    for (int w = 0; w < kAttentionSplitWarps; ++w) block_max = fmaxf(block_max, s_max[w][h]);
    for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
      float o = 0.f;
      for (int w = 0; w < kAttentionSplitWarps; ++w)
        if (s_sum[w][h] > 0.f) o += s_acc[w][h][d] * expf(s_max[w][h] - block_max);
      out[2 + d] = o;
    }
    if (threadIdx.x == 0) {
      float sum = 0.f;
      for (int w = 0; w < kAttentionSplitWarps; ++w)
        if (s_sum[w][h] > 0.f) sum += s_sum[w][h] * expf(s_max[w][h] - block_max);
      out[0] = block_max;
      out[1] = sum;
    }
  }
}

__global__ void attention_merge_kernel(const float* __restrict__ partial, float* __restrict__ out,
                                       int64_t m_heads, int64_t head_dim, int64_t n_splits) {
  pdl_enter();
  const int64_t pair = blockIdx.x;
  const float* p = partial + pair * n_splits * (head_dim + 2);
  float global_max = -INFINITY;
  for (int64_t s = 0; s < n_splits; ++s)
    if (p[s * (head_dim + 2) + 1] > 0.f) global_max = fmaxf(global_max, p[s * (head_dim + 2)]);
  float sum = 0.f;
  for (int64_t s = 0; s < n_splits; ++s) {
    const float* ps = p + s * (head_dim + 2);
    if (ps[1] > 0.f) sum += ps[1] * expf(ps[0] - global_max);
  }
  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    for (int64_t s = 0; s < n_splits; ++s) {
      const float* ps = p + s * (head_dim + 2);
      if (ps[1] > 0.f) o += ps[2 + d] * expf(ps[0] - global_max);
    }
    out[pair * head_dim + d] = o / sum;
  }
}

}  // namespace nibble::kernels

namespace nibble::kernels {

// Decode attention (few query tokens, any context) for GQA groups of G <= 8 q heads and head_dim
// HD (64 or 128), f32 KV. Block (token, kv head, split of SPLIT positions), 256 threads:
//   1. scores: thread i owns position begin + i and computes its dot product with all G queries
//      (q staged in shared memory), so no per-position warp reduction sits on the critical path;
//   2. softmax: warp h takes head h's scores (max, exp, sum) in shared memory;
//   3. output: each thread owns 4 dims and a stride of positions, accumulating all G heads, then
//      the position groups are summed in shared memory.
// Splits write (max, sum, unnormalised output) partials; the last block of a (token, kv head) to
// finish (a counter per pair, reset by that block) merges them, so there is no merge launch. With
// one split the output is written directly. K/V rows of earlier steps cannot change, so they are
// prefetched into L2 before pdl_wait.
// Positions per split: 256, and 128 for long contexts (kDecodeLongContext and up), where twice the
// blocks keep more loads in flight (tg128 at depth 8192: 216 -> 225 tok/s) while at short
// contexts the extra merge costs more (336 -> 316 at depth 0).
constexpr int kDecodeSplit = 256, kDecodeSplitLong = 128;
constexpr int64_t kDecodeLongContext = 4096;
constexpr int kDecodeThreads = 256;
static_assert(kDecodeSplit == kAttentionSplit && kDecodeSplit <= kDecodeThreads,
              "a thread per position; the partials are sized for the smaller splits (attention_split_floats)");
__host__ __device__ constexpr int decode_split(int64_t max_context) {
  return max_context >= kDecodeLongContext ? kDecodeSplitLong : kDecodeSplit;
}
// Floats per split partial of one head: (max, sum, 2 unused) then the HD-vector, 16-byte aligned.
__host__ __device__ constexpr int64_t decode_partial_stride(int64_t head_dim) { return head_dim + 4; }

template <int G, int HD, int SPLIT>
__global__ void __launch_bounds__(kDecodeThreads)
attention_decode_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                        float* __restrict__ partial, float* __restrict__ out, unsigned* __restrict__ counters,
                        const int32_t* __restrict__ positions, int64_t max_context, int64_t n_head,
                        int64_t n_head_kv, float scale, int64_t n_splits) {
  constexpr int kQuads = HD / 4;                       // float4 columns of a row
  constexpr int kGroups = kDecodeThreads / kQuads;     // position groups in stage 3
  __shared__ __align__(16) float qs[G][HD];
  __shared__ float sc[G][SPLIT];
  __shared__ __align__(16) float red[kGroups][G][HD];  // stage 3 partial sums
  __shared__ float s_max[G], s_sum[G];
  __shared__ bool last;
  const int64_t t = blockIdx.x / n_head_kv, kv = blockIdx.x % n_head_kv, split = blockIdx.y;
  const int64_t group = n_head / n_head_kv;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t row_stride = n_head_kv * HD;
  const float* kbase = k + kv * HD;
  const float* vbase = v + kv * HD;
  const int64_t begin = split * SPLIT;
  // Prefetch this split's K/V rows before the wait: rows before the token's own were written by
  // earlier steps. positions are the step's inputs, copied from the host before the step, never a
  // kernel's output, so reading them here keeps the PDL rule.
  constexpr int kLines = HD * 4 / 128;  // 128-byte lines per row
  const int64_t prefetch_rows = ::max(int64_t(0), ::min(int64_t(SPLIT), int64_t(positions[t]) - begin));
  for (int64_t i = tid; i < 2 * prefetch_rows * kLines; i += kDecodeThreads) {
    const int64_t line = i % (prefetch_rows * kLines), pos = begin + line / kLines;
    prefetch_l2((i < prefetch_rows * kLines ? kbase : vbase) + pos * row_stride + (line % kLines) * 32);
  }
  pdl_enter();
  const int64_t n_ctx = int64_t(positions[t]) + 1;
  const int64_t end = ::min(n_ctx, begin + int64_t(SPLIT)), count = ::max(int64_t(0), end - begin);

  for (int i = tid; i < G * HD; i += kDecodeThreads) {
    const int h = i / HD, d = i % HD;
    qs[h][d] = h < group ? q[((t * n_head) + kv * group + h) * HD + d] * scale : 0.f;
  }
  __syncthreads();
  // 1. Scores.
  if (tid < count) {
    const float4* kr = reinterpret_cast<const float4*>(kbase + (begin + tid) * row_stride);
    float s[G] = {};
#pragma unroll 8
    for (int c = 0; c < kQuads; ++c) {
      const float4 kv4 = kr[c];
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float4 q4 = reinterpret_cast<const float4*>(qs[h])[c];
        s[h] += q4.x * kv4.x + q4.y * kv4.y + q4.z * kv4.z + q4.w * kv4.w;
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) sc[h][tid] = s[h];
  }
  __syncthreads();
  // 2. Softmax numerators per head.
  for (int h = warp; h < G; h += kDecodeThreads / 32) {
    float mx = -INFINITY;
    for (int i = lane; i < count; i += 32) mx = fmaxf(mx, sc[h][i]);
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int i = lane; i < count; i += 32) {
      const float p = expf(sc[h][i] - mx);
      sc[h][i] = p;
      sum += p;
    }
    sum = warp_sum(sum);
    if (lane == 0) s_max[h] = mx, s_sum[h] = sum;
  }
  __syncthreads();
  // 3. Σ p · v, position group g = tid / kQuads, dims 4·(tid % kQuads).
  {
    const int quad = tid % kQuads, g = tid / kQuads;
    float4 acc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) acc[h] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int i = g; i < count; i += kGroups) {
      const float4 v4 = reinterpret_cast<const float4*>(vbase + (begin + i) * row_stride)[quad];
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float p = sc[h][i];
        acc[h].x += p * v4.x, acc[h].y += p * v4.y, acc[h].z += p * v4.z, acc[h].w += p * v4.w;
      }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) reinterpret_cast<float4*>(red[g][h])[quad] = acc[h];
  }
  __syncthreads();
  // Sum the position groups; one split: normalise and write the output, else the split's partial.
  for (int i = tid; i < G * HD; i += kDecodeThreads) {
    const int h = i / HD, d = i % HD;
    if (h >= group) continue;
    float o = 0.f;
#pragma unroll 4
    for (int g = 0; g < kGroups; ++g) o += red[g][h][d];
    const int64_t head = t * n_head + kv * group + h;
    if (n_splits == 1) {
      out[head * HD + d] = o / s_sum[h];
    } else {
      float* p = partial + (head * n_splits + split) * decode_partial_stride(HD);
      p[4 + d] = o;
      if (d == 0) p[0] = s_max[h], p[1] = s_sum[h];
    }
  }
  if (n_splits == 1) return;
  // The last split block of this (token, kv head) merges all splits.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(&counters[blockIdx.x], 1u) == unsigned(n_splits) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Merge: per head the global max and softmax sum over the splits (lanes stride the splits),
  // then each thread one float4 of the output (G · HD / 4 = 256 for G = 8, HD = 128) summing the
  // splits' partial vectors with their weights: independent 16-byte loads, batched by the unroll
  // (a loop of dependent loads per split and dimension cost ~60 µs per layer at 32 splits).
  __shared__ float s_scale[G];
  for (int h = warp; h < G && h < group; h += kDecodeThreads / 32) {
    const float* p = partial + ((t * n_head + kv * group + h) * n_splits) * decode_partial_stride(HD);
    float mx = -INFINITY;
    for (int64_t s = lane; s < n_splits; s += 32) {
      const float* ps = p + s * decode_partial_stride(HD);
      if (__ldcg(ps + 1) > 0.f) mx = fmaxf(mx, __ldcg(ps));
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int64_t s = lane; s < n_splits; s += 32) {
      const float* ps = p + s * decode_partial_stride(HD);
      const float l = __ldcg(ps + 1);
      if (l > 0.f) sum += l * expf(__ldcg(ps) - mx);
    }
    sum = warp_sum(sum);
    if (lane == 0) s_max[h] = mx, s_scale[h] = 1.f / sum;
  }
  __syncthreads();
  for (int64_t s0 = 0; s0 < n_splits; s0 += SPLIT) {  // weights of up to SPLIT splits in sc
    const int64_t chunk = ::min(int64_t(SPLIT), n_splits - s0);
    for (int i = tid; i < G * chunk; i += kDecodeThreads) {
      const int h = int(i / chunk);
      const int64_t s = s0 + i % chunk;
      if (h >= group) continue;
      const float* ps = partial + ((t * n_head + kv * group + h) * n_splits + s) * decode_partial_stride(HD);
      sc[h][s - s0] = __ldcg(ps + 1) > 0.f ? expf(__ldcg(ps) - s_max[h]) * s_scale[h] : 0.f;
    }
    __syncthreads();
    for (int i = tid; i < G * HD / 4; i += kDecodeThreads) {
      const int h = i / (HD / 4), d4 = i % (HD / 4);
      if (h >= group) continue;
      const float* p = partial + ((t * n_head + kv * group + h) * n_splits + s0) * decode_partial_stride(HD) + 4;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int64_t s = 0; s < chunk; ++s) {
        const float w = sc[h][s];
        const float4 v = __ldcg(reinterpret_cast<const float4*>(p + s * decode_partial_stride(HD)) + d4);
        o.x += w * v.x, o.y += w * v.y, o.z += w * v.z, o.w += w * v.w;
      }
      float4* dst = reinterpret_cast<float4*>(out + (t * n_head + kv * group + h) * HD) + d4;
      if (s0 == 0) {
        *dst = o;
      } else {
        const float4 prev = *dst;
        *dst = make_float4(prev.x + o.x, prev.y + o.y, prev.z + o.z, prev.w + o.w);
      }
    }
    __syncthreads();
  }
  if (tid == 0) counters[blockIdx.x] = 0;
}

}  // namespace nibble::kernels
