// Decode attention over the paged KV cache (backend/kv_pages.h). Three kernels:
//   attention_online_warp_kernel: any shape, f32 or f16 KV; one warp per (token, q head) streams
//     its context with an online softmax. The exact fallback for shapes the others do not take.
//   attention_decode_kernel: f32 KV, head_dim 64/128, GQA group <= 8, split-K on CUDA cores.
//   attention_decode_tc_kernel: f16 KV (the default), head_dim 64/128, GQA group <= 16, split-K
//     on the tensor cores.
// The split-K kernels share the partial layout and the merge by the last split blocks; the
// tensor-core kernel's splits may instead be one cluster's blocks, merged through distributed
// shared memory (kCluster, sm_90 on: decode_merge_cluster).
// All three take gpt-oss's AttentionMods: a sliding window (keys of the last `window` positions)
// and a learned sink logit per q head that joins each softmax's denominator.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>
#include <type_traits>

#include "kernels/attention_prologue.h"
#include "kernels/kv_access.cuh"
#include "kernels/linear.cuh"
#include "kernels/mma.cuh"
#include "kernels/pdl.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

constexpr int64_t kAttentionMaxHeadDim = 256;

// gpt-oss's attention options (Backend::attention): sinks [n_head] or null, window 0 for none.
struct AttentionMods {
  const float* sinks = nullptr;
  int64_t window = 0;
};
// The first position a query at n_ctx - 1 sees.
__device__ __forceinline__ int64_t window_first(int64_t n_ctx, int64_t window) {
  return window > 0 && n_ctx > window ? n_ctx - window : 0;
}
// Query head h's sink logit in natural-log units, -inf without sinks.
__device__ __forceinline__ float sink_logit(const AttentionMods& mods, int64_t h) {
  return mods.sinks ? mods.sinks[h] : -__builtin_huge_valf();
}
// The softmax denominator's sink term folded into (max, sum) on the way out, as one factor for
// all of a head's values (sink_factor_log2, here in natural-log units): one factor a lane instead
// of a division (and with a sink two exponentials) a value, ~0.8% of a Qwen3 decode step at depth
// 0 in decode attention's tail (BENCHMARKS.md).
__device__ __forceinline__ float sink_factor(float max_ln, float sum, float sink) {
  constexpr float kLog2e = 1.4426950408889634f;
  return sink_factor_log2(max_ln * kLog2e, sum, sink * kLog2e);
}

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

template <typename T>
__global__ void attention_online_warp_kernel(const float* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const int32_t* __restrict__ tables,
                                             const int32_t* __restrict__ seq_rows, int64_t table_stride,
                                             int block_size_log2, float* __restrict__ out, int64_t m,
                                             const int32_t* __restrict__ positions, int64_t n_head,
                                             int64_t n_head_kv, int64_t head_dim, float scale, AttentionMods mods) {
  const int64_t pair = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pair >= m * n_head) return;
  const int64_t t = pair / n_head, h = pair % n_head, kv = h / (n_head / n_head_kv);
  const int32_t* block_table = kv_token_table(tables, seq_rows, table_stride, t);
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
  for (int64_t pos = window_first(n_ctx, mods.window); pos < n_ctx; ++pos) {
    const int64_t row = kv_pool_row(block_table, block_size_log2, pos);
    const T* kp = k + (row * n_head_kv + kv) * head_dim;
    const T* vp = v + (row * n_head_kv + kv) * head_dim;
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < head_dim) dot += qv[j] * kv_load(kp + d);
    }
    float vr[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) vr[j] = lane + 32 * j < head_dim ? kv_load(vp + lane + 32 * j) : 0.f;
    online_softmax_step(warp_sum(dot) * scale, vr, running_max, running_sum, acc);
  }
  float* oh = out + pair * head_dim;
  const float f = sink_factor(running_max, running_sum, sink_logit(mods, h));
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < head_dim) oh[d] = acc[j] * f;
  }
}

}  // namespace nibble::kernels

namespace nibble::kernels {

// Split-K decode partials: per (token, q head, split) (max, sum, 2 unused) then the unnormalised
// HD-vector, 16-byte aligned; max in natural-log units of the scaled scores.
__host__ __device__ constexpr int64_t decode_partial_stride(int64_t head_dim) { return head_dim + 4; }

// Elements d .. d + N - 1 of one head's result from one split (one 4-, 8- or 16-byte store): with
// `only` (the single split holding positions) the normalised output (with the head's sink logit,
// -inf for none), else the split's partial in the layout above (value unnormalised, the max in
// natural-log units, the softmax sum) for decode_merge_last_split.
template <int HD, int N = 1>
__device__ __forceinline__ void decode_store_split(float* __restrict__ out, float* __restrict__ partial, int64_t head,
                                                   int64_t split, int64_t n_splits, bool only, int d,
                                                   const float (&value)[N], float max_ln, float sum, float sink) {
  static_assert(N == 1 || N == 2 || N == 4);
  std::conditional_t<N == 1, float, std::conditional_t<N == 2, float2, float4>> v;
  float* e = reinterpret_cast<float*>(&v);
  float* dst;
  if (only) {
    const float f = sink_factor(max_ln, sum, sink);
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = value[i] * f;
    dst = out + head * HD + d;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = value[i];
    float* p = partial + (head * n_splits + split) * decode_partial_stride(HD);
    if (d == 0) p[0] = max_ln, p[1] = sum;
    dst = p + 4 + d;
  }
  *reinterpret_cast<decltype(v)*>(dst) = v;
}

// A load with acquire semantics at GPU scope: a merger's poll of its pair's arrival count.
__device__ __forceinline__ unsigned long long load_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// An arrival: release of what the block stored before it, acquire of what the others released.
__device__ __forceinline__ unsigned long long atomic_add_acq_rel_gpu(unsigned long long* p, unsigned long long v) {
  unsigned long long old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

// The merge of a (token, kv head)'s split partials, run by the last `mergers` of its splits
// holding positions to arrive (splits first .. n_active - 1, the first past a sliding window's
// start), so there is no merge launch. Merger i takes the pair's heads i, i + mergers, ...; all but
// the last to arrive poll the pair's arrival count until every split's partial is stored. Why
// several: one block reading every head's partials (33 splits x 8 heads x 528 bytes at depth 8192,
// 139 KB) while the o GEMV's weights stream kept decode attention ~5 µs past its other blocks
// (in-kernel timeline, BENCHMARKS.md); with two heads a merger each reads 35 KB (Qwen3 INT4
// tg128 at depth 8192 +8.6% on an H100). Polling blocks only wait for blocks that are resident or
// will be (the caller keeps pairs x mergers at most half the SMs, and the PDL successor launches
// only once every block has triggered), so none waits forever.
// The count: counters[pair] only grows. A launch's n splits add one each as they arrive (the old
// value's low bits are the arrival rank) and the last to arrive adds kMergeLaunchCount - n, so each
// launch starts at a multiple of kMergeLaunchCount (the counts start at 0; a pair with one split
// never counts) and no merger waits on a second atomic or a reset before merging: the mergers'
// second count and a reset by the last done, as it was, took Qwen3-30B-A3B INT4 tg128 1.1% at
// depth 8192, 1.0% at 16384 (BENCHMARKS.md). The arrival is one acq_rel atomic (+0.1% against
// fence.acq_rel.gpu and a relaxed atomic; __threadfence, fence.sc.gpu, measured the same); with no
// release at all, which is not correct, the step was only 0.7% faster at depth 8192: what remains
// of the merge tail is the last partial's way to the mergers under the o GEMV's weight burst, not
// the partials' volume (merging each partial as it lands, with no count, tied at 8192:
// docs/experiments/2026-11-28-attention-polled-merge.patch, BENCHMARKS.md).
// Within a merger the threads are units of HD / 4 (one float4 of a head each); with fewer heads
// than units, a head's splits are dealt round-robin to SG units, each walking its splits with an
// online softmax (kMergeBatch loads at once), and the units' results are combined in unit order
// through shared memory, so the bits do not depend on arrival order (kSpread; without it a unit
// walks all of a head's splits, which needs no shared memory). Called by every thread.
constexpr int kMergeBatch = 16;
constexpr unsigned long long kMergeLaunchCount = 1ull << 16;  // more than any launch's splits

template <int G, int HD, int kThreads, bool kSpread = true, typename Marker = NoTimelineMarker>
__device__ void decode_merge_last_split(const float* __restrict__ partial, float* __restrict__ out,
                                        unsigned long long* __restrict__ counters, int64_t t, int64_t kv, int64_t group,
                                        int64_t n_head, int64_t n_splits, int64_t first, int64_t n_active,
                                        const AttentionMods& mods, int mergers, Marker marker = {}) {
  constexpr int kLanes = HD / 4, kUnits = kThreads / kLanes;
  static_assert(kThreads % kLanes == 0);
  __shared__ int s_merger;
  const int tid = threadIdx.x;
  const unsigned n = unsigned(n_active - first), r_count = ::min(unsigned(::max(mergers, 1)), n);
  unsigned long long* count = counters + blockIdx.x;
  __syncthreads();
  if (tid == 0) {
    // Release: the block's partial (every thread's stores, ordered by the barrier); acquire, for
    // the last to arrive, the other splits' partials.
    const unsigned long long old = atomic_add_acq_rel_gpu(count, 1), base = old & ~(kMergeLaunchCount - 1);
    const unsigned rank = unsigned(old - base);
    const int merger = int(rank) - int(n - r_count);  // < 0: not a merger
    if (merger >= 0) {
      if (rank == n - 1) {
        atomicAdd(count, kMergeLaunchCount - n);  // the next launch starts at a multiple again
      } else {
        while (load_acquire_gpu(count) < base + n) {
        }
      }
    }
    s_merger = merger;
  }
  __syncthreads();  // after thread 0's acquire: the partials' loads below see every split's stores
  const int merger = s_merger;
  if (merger < 0) return;
  marker(11, float(merger));  // a merger's poll done
  constexpr float kInf = __builtin_huge_valf();
  const int heads = int((group - merger + r_count - 1) / r_count);  // heads merger, merger + r_count, ...
  const int sg_count = kSpread ? ::max(1, kUnits / ::max(heads, 1)) : 1;  // units a head
  const int unit = tid / kLanes, d4 = tid % kLanes, sg = unit % sg_count;
  // This unit's splits first + sg, first + sg + sg_count, ... of head slot hs, online.
  auto walk = [&](int hs, float& mx, float& l, float4& o) {
    const int64_t head = t * n_head + kv * group + merger + int64_t(hs) * r_count;
    const float* p = partial + head * n_splits * decode_partial_stride(HD);
    mx = -kInf, l = 0.f, o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int64_t s0 = first + sg; s0 < n_active; s0 += int64_t(kMergeBatch) * sg_count) {
      float2 ml[kMergeBatch];
      float4 v[kMergeBatch];
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        const int64_t s = s0 + int64_t(j) * sg_count;
        const float* ps = p + s * decode_partial_stride(HD);
        ml[j] = s < n_active ? __ldcg(reinterpret_cast<const float2*>(ps)) : make_float2(-kInf, 0.f);
        v[j] = s < n_active ? __ldcg(reinterpret_cast<const float4*>(ps + 4) + d4) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        if (!(ml[j].y > 0.f)) continue;  // a split with no positions (or none left)
        const float m2 = fmaxf(mx, ml[j].x), a = __expf(mx - m2), b = __expf(ml[j].x - m2);
        l = l * a + ml[j].y * b;
        o = make_float4(o.x * a + v[j].x * b, o.y * a + v[j].y * b, o.z * a + v[j].z * b, o.w * a + v[j].w * b);
        mx = m2;
      }
    }
  };
  auto finish = [&](int hs, float mx, float l, float4 o) {
    const int64_t h = merger + int64_t(hs) * r_count;
    const float f = sink_factor(mx, l, sink_logit(mods, kv * group + h));
    reinterpret_cast<float4*>(out + (t * n_head + kv * group + h) * HD)[d4] =
        make_float4(o.x * f, o.y * f, o.z * f, o.w * f);
  };
  if (sg_count == 1) {
    for (int hs = unit; hs < heads; hs += kUnits) {
      float mx, l;
      float4 o;
      walk(hs, mx, l, o);
      marker(12, o.x);  // the partials loaded and weighed
      finish(hs, mx, l, o);
    }
    return;
  }
  if constexpr (kSpread) {
    // sg_count > 1: heads <= kUnits / 2, one slot a unit at most.
    __shared__ float s_mx[kThreads], s_l[kThreads];
    __shared__ __align__(16) float4 s_o[kThreads];
    const int hs = unit / sg_count;
    const bool active = hs < heads;
    float mx = -kInf, l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active) walk(hs, mx, l, o);
    marker(12, o.x);
    s_mx[tid] = mx, s_l[tid] = l, s_o[tid] = o;
    __syncthreads();
    if (!active || sg != 0) return;
    for (int j = 1; j < sg_count; ++j) {  // units unit + j: the same head, dims d4
      const int i = tid + j * kLanes;
      if (!(s_l[i] > 0.f)) continue;
      const float m2 = fmaxf(mx, s_mx[i]), a = __expf(mx - m2), b = __expf(s_mx[i] - m2);
      const float4 v = s_o[i];
      l = l * a + s_l[i] * b;
      o = make_float4(o.x * a + v.x * b, o.y * a + v.y * b, o.z * a + v.z * b, o.w * a + v.w * b);
      mx = m2;
    }
    marker(13, o.x);  // the units' results combined
    finish(hs, mx, l, o);
  }
}

// The merge of a (token, kv head)'s split partials when its splits are the blocks of one cluster
// (attention_decode_tc_kernel<..., kCluster>): each block has left its heads' (max in log2 units,
// sum, unnormalised O) in its shared memory, and block `rank` of C writes the outputs rank,
// rank + C, ... (16-byte units, head-major) from every block's, read through distributed shared
// memory: C consecutive lanes take one unit, a block's partial each, and meet by shuffles. No
// partial goes through L2 and there is no arrival count: at depth 8192 the split merge by the last
// splits kept ~4.5 µs a layer between the last partial and its end, the partials' L2 trip under
// the o GEMV's weight burst (BENCHMARKS.md). Called by every thread of every block of the cluster;
// C a power of two up to 16 (the non-portable cluster size).
template <int HD, int ROWS, int kThreads>
__device__ __forceinline__ void decode_merge_cluster(const float (&s_m)[ROWS], const float (&s_l)[ROWS],
                                                     const float (&s_acc)[ROWS][HD], int rows,
                                                     float* __restrict__ out_pair, const float* s_sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  constexpr int kUnits = HD / 4;
  constexpr float kInf = __builtin_huge_valf(), kLog2e = 1.4426950408889634f;
  constexpr int kPasses = (ROWS * kUnits + kThreads - 1) / kThreads;
  static_assert(kThreads % 16 == 0, "a unit's lanes (a power of two up to 16) within a warp");
  const int c = int(cluster.num_blocks()), rank = int(cluster.block_rank()), c_log2 = __ffs(c) - 1;
  const int s = int(threadIdx.x) & (c - 1), j = int(threadIdx.x) >> c_log2, units = rows * kUnits;
  cluster.sync();  // every block's partials in its shared memory
  const float* rm = cluster.map_shared_rank(&s_m[0], unsigned(s));
  const float* rl = cluster.map_shared_rank(&s_l[0], unsigned(s));
  const float4* racc = reinterpret_cast<const float4*>(cluster.map_shared_rank(&s_acc[0][0], unsigned(s)));
  // This thread's units: rank + c·i, i = pass · (kThreads / c) + j; the c lanes of a unit share it.
  float mv[kPasses], lv[kPasses];
  float4 vv[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int f = rank + pass * kThreads + (j << c_log2);
    const bool valid = f < units;
    const int h = valid ? f / kUnits : 0;
    mv[pass] = valid ? rm[h] : -kInf;
    lv[pass] = valid ? rl[h] : 0.f;
    vv[pass] = valid ? racc[f] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  cluster.barrier_arrive();  // this block has read the others' shared memory (it waits below)
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int f = rank + pass * kThreads + (j << c_log2);
    float mx = mv[pass];
    for (int o = c / 2; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const bool valid = f < units;  // a valid unit has a block with positions: mx finite
    const float w = valid ? exp2_approx(mv[pass] - mx) : 0.f;
    float l = lv[pass] * w;
    float4 v = make_float4(vv[pass].x * w, vv[pass].y * w, vv[pass].z * w, vv[pass].w * w);
    for (int o = c / 2; o > 0; o /= 2) {
      l += __shfl_xor_sync(0xffffffffu, l, o);
      v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
      v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
      v.z += __shfl_xor_sync(0xffffffffu, v.z, o);
      v.w += __shfl_xor_sync(0xffffffffu, v.w, o);
    }
    if (valid && s == 0) {
      const float fac = sink_factor_log2(mx, l, s_sink[f / kUnits] * kLog2e);
      reinterpret_cast<float4*>(out_pair)[f] = make_float4(v.x * fac, v.y * fac, v.z * fac, v.w * fac);
    }
  }
  cluster.barrier_wait();  // every block has read this one's
#endif
}

// Before pdl_wait: fetch into L2 the K/V rows of a split's positions [begin, begin + split) that
// earlier steps wrote (those before `written`, the token's own position). K/V rows of earlier
// steps cannot change, and positions and the block table are the step's inputs, copied from the
// host before the step, never a kernel's output, so reading them here keeps the PDL rule.
// K's and V's line of a row come from one block-table lookup, in 32-bit indices (a 64-bit
// division a prefetch before: on decode attention's chain before its wait, BENCHMARKS.md).
template <int HD, int kThreads, typename T>
__device__ __forceinline__ void prefetch_split_rows(const T* kbase, const T* vbase, const int32_t* block_table,
                                                    int block_size_log2, int64_t row_stride, int64_t begin,
                                                    int64_t split, int64_t written) {
  // 128-byte lines per row (an E4M3 row of 64 dims is half a line: one)
  constexpr int kPerLine = 128 / int(sizeof(T)), kLines = (HD + kPerLine - 1) / kPerLine;
  const int rows = int(::max(int64_t(0), ::min(split, written - begin)));
  for (int i = threadIdx.x; i < rows * kLines; i += kThreads) {
    const int64_t off = kv_pool_row(block_table, block_size_log2, begin + i / kLines) * row_stride + (i % kLines) * kPerLine;
    prefetch_l2(kbase + off);
    prefetch_l2(vbase + off);
  }
}

// Decode attention on CUDA cores for f32 KV, GQA groups of G <= 8 q heads and head_dim HD (64 or
// 128). Block (token, kv head, split of SPLIT positions), 256 threads:
//   1. scores: thread i owns position begin + i and computes its dot product with all G queries
//      (q staged in shared memory), so no per-position warp reduction sits on the critical path;
//   2. softmax: warp h takes head h's scores (max, exp, sum) in shared memory;
//   3. output: each thread owns 4 dims and a stride of positions, accumulating all G heads, then
//      the position groups are summed in shared memory.
// With one split the output is written directly, else partials merged by the last split block.
// The split's rows are prefetched into L2 before pdl_wait (prefetch_split_rows).
// Positions per split: 256, and 128 for long contexts (kDecodeLongContext and up), where twice the
// blocks keep more loads in flight (tg128 at depth 8192: 216 -> 225 tok/s) while at short
// contexts the extra merge costs more (336 -> 316 at depth 0).
constexpr int kDecodeSplit = 256, kDecodeSplitLong = 128;
constexpr int64_t kDecodeLongContext = 4096;
constexpr int kDecodeThreads = 256;
static_assert(kDecodeSplit <= kDecodeThreads, "a thread per position");
__host__ __device__ constexpr int decode_split(int64_t max_context) {
  return max_context >= kDecodeLongContext ? kDecodeSplitLong : kDecodeSplit;
}

template <int G, int HD, int SPLIT>
__global__ void __launch_bounds__(kDecodeThreads)
attention_decode_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                        const int32_t* __restrict__ tables, const int32_t* __restrict__ seq_rows,
                        int64_t table_stride, int block_size_log2,
                        float* __restrict__ partial, float* __restrict__ out, unsigned long long* __restrict__ counters,
                        const int32_t* __restrict__ positions, int64_t n_head, int64_t n_head_kv, float scale,
                        int64_t n_splits, AttentionMods mods) {
  constexpr int kQuads = HD / 4;                       // float4 columns of a row
  constexpr int kGroups = kDecodeThreads / kQuads;     // position groups in stage 3
  __shared__ __align__(16) float qs[G][HD];
  __shared__ float sc[G][SPLIT];
  __shared__ __align__(16) float red[kGroups][G][HD];  // stage 3 partial sums
  __shared__ float s_max[G], s_sum[G];
  const int64_t t = blockIdx.x / n_head_kv, kv = blockIdx.x % n_head_kv, split = blockIdx.y;
  const int64_t group = n_head / n_head_kv;
  const int32_t* block_table = kv_token_table(tables, seq_rows, table_stride, t);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t row_stride = n_head_kv * HD;
  const float* kbase = k + kv * HD;
  const float* vbase = v + kv * HD;
  // The split's positions [lo, end): from its start or the window's, whichever is later. Every
  // split reaches the merge, so one with none left (before the window) stores an empty partial.
  const int64_t n_ctx = int64_t(positions[t]) + 1;
  const int64_t begin = split * SPLIT, lo = ::max(begin, window_first(n_ctx, mods.window));
  auto row_of = [&](int64_t pos) { return kv_pool_row(block_table, block_size_log2, pos) * row_stride; };
  prefetch_split_rows<HD, kDecodeThreads>(kbase, vbase, block_table, block_size_log2, row_stride, lo,
                                          ::max(int64_t(0), begin + SPLIT - lo), positions[t]);
  NIBBLE_TIMELINE_BLOCK(kAttention);
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  const int64_t end = ::min(n_ctx, begin + int64_t(SPLIT)), count = ::max(int64_t(0), end - lo);

  for (int i = tid; i < G * HD; i += kDecodeThreads) {
    const int h = i / HD, d = i % HD;
    qs[h][d] = h < group ? q[((t * n_head) + kv * group + h) * HD + d] * scale : 0.f;
  }
  __syncthreads();
  // 1. Scores.
  if (tid < count) {
    const float4* kr = reinterpret_cast<const float4*>(kbase + row_of(lo + tid));
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
      const float4 v4 = reinterpret_cast<const float4*>(vbase + row_of(lo + i))[quad];
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
    const float value[1] = {o};
    decode_store_split<HD>(out, partial, t * n_head + kv * group + h, split, n_splits, n_splits == 1, d, value,
                           s_max[h], s_sum[h], sink_logit(mods, kv * group + h));
  }
  if (n_splits == 1) return;
  decode_merge_last_split<G, HD, kDecodeThreads, false>(partial, out, counters, t, kv, group, n_head, n_splits, 0,
                                                        n_splits, mods, 1);
}

// Decode attention on the tensor cores for f16 or FP8 E4M3 KV (T; E4M3 converted to f16 exactly as
// it arrives, half the bytes per position): GQA groups of up to 16 q heads as the 16 rows
// of mma.m16n8k16 (Qwen3-30B-A3B: 8 of 16 used), head_dim HD 64 or 128. Block (token, kv head,
// split of SPLIT positions), WARPS warps; each warp takes tiles of 16 positions (every WARPS-th
// tile of the split), FlashAttention-2 style with an online softmax in registers:
//   S = Q·Kᵀ: Q the A operand (f16 fragments in registers, scaled by scale·log2 e), K the B
//     operand loaded straight from global memory into registers. The head dimension's order in a
//     dot product is free, so thread quad t4 takes 8 contiguous dims (one 16-byte load) per 32
//     as its k indices of two k-steps, and Q's fragments use the same order. n-tile j column n
//     is position 4(n / 2) + 2j + n % 2 of the tile, which leaves each thread the 4 contiguous
//     positions 4·t4 .. 4·t4 + 3 of P.
//   O += P·V: P from the S accumulators (the C fragments of n-tiles 0 and 1 are the A fragment of
//     the 16-position k-step), V the B operand, also straight from global: thread group g takes
//     the HD / 8 contiguous dims HD / 8 · g .. of its 4 positions (16-byte loads) and output
//     n-tile nt column n is dim HD / 8 · n + nt; a byte permute pairs two positions' halves.
// No shared memory in the loop and no __syncthreads; the warps' (max, sum, O) are merged through
// shared memory at the end, then the split partial or, with one split holding positions (the
// others end at once), the output is written.
// WARPS 8 with ROWS 8 (groups up to 8), or WARPS 4 with ROWS 16 (groups up to 16: the warp merge's
// shared memory is WARPS x ROWS x HD floats).
constexpr int kDecodeTcTile = 16, kDecodeTcRows = 16;

// The warps' O rows for the merge: row-major in dim order, each 16-byte unit u of row `row` at
// unit u ^ decode_tc_swizzle(row, u) (a permutation within each aligned 128-byte run). A thread
// holds HD / 4 contiguous dims of its rows (dims HD / 4 · t4 ..: n-tiles nt of halves b = 0, 1),
// stored as HD / 16 units; in one 16-byte store the 8 lanes of a phase (rows g, g + 1, quads
// t4 0..3) then land on 8 distinct units of the banks, and a merge warp's reads of one row in dim
// order (8 or 16 bytes a lane) are runs of 128 bytes: no conflicts either way.
__device__ __forceinline__ int decode_tc_swizzle(int row, int unit) { return ((unit / 8) << 1 | (row & 1)) & 7; }
__device__ __forceinline__ float* decode_tc_o_unit(float* row_base, int row, int unit) {
  return row_base + 4 * (unit ^ decode_tc_swizzle(row, unit));
}

// The attention prologue (norm.cuh qk_norm_rope_kv_write_kernel) fused into the tensor-core decode
// kernel, for steps whose every token is its sequence's one new token: q, k and v come raw from the
// projection, each block normalises and rotates its q heads as it builds their fragments (RoPE's
// pairs, dims d and d + HD/2, are both the same thread's), and the warp whose tiles hold the
// token's position writes the new K/V row to the cache and keeps a copy in shared memory that its
// own loop reads, so no block (and no other warp) reads a row another wrote, and no barrier waits
// for it. Saves a launch and its boundary per
// layer, but at depth 0 the work lands on attention's few blocks: even for Qwen3-30B-A3B there,
// +0.7% at depth 8192, +1% for gpt-oss-20b (BENCHMARKS.md). Its inputs: kernels/attention_prologue.h.

template <int HD, int SPLIT, int WARPS, int ROWS, typename T, bool kCluster = false>
__global__ void __launch_bounds__(32 * WARPS)
attention_decode_tc_kernel(const float* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           const int32_t* __restrict__ tables, const int32_t* __restrict__ seq_rows,
                           int64_t table_stride, int block_size_log2,
                           float* __restrict__ partial, float* __restrict__ out, unsigned long long* __restrict__ counters,
                           const int32_t* __restrict__ positions, int64_t n_head, int64_t n_head_kv,
                           float scale_log2, int64_t n_splits, AttentionMods mods, AttentionPrologue pro,
                           T* __restrict__ k_out, T* __restrict__ v_out, int mergers) {
  static_assert(HD == 64 || HD == 128);
  static_assert(SPLIT % (WARPS * kDecodeTcTile) == 0 && (ROWS == 8 || ROWS == 16));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (kCluster) return;  // clusters are sm_90's: the launcher never picks them before
#endif
  constexpr int kDecodeTcWarps = WARPS;
  constexpr int kThreads = 32 * kDecodeTcWarps;
  constexpr int kChunks = HD / 32;         // 16-byte K units per row and thread
  constexpr int kDimsPerGroup = HD / 8;    // V dims per thread group g (= output n-tiles)
  constexpr int kVUnits = kDimsPerGroup / 8;
  constexpr float kInf = __builtin_huge_valf();
  // The warps' (max, sum) per row, a row's warps contiguous (one 16-byte load per 4 warps), and
  // their O rows (decode_tc_o_unit's layout). With scalar stores and loads the merge took ~1.2 µs
  // of gpt-oss-120b's ~4.7 µs attention at depth 0 (in-kernel timeline, H100).
  __shared__ __align__(16) float s_m[ROWS][kDecodeTcWarps], s_l[ROWS][kDecodeTcWarps];
  __shared__ __align__(16) float s_o[kDecodeTcWarps][ROWS][HD];
  // kCluster: the pair is blockIdx.y and its splits are the blocks of one cluster (blockIdx.x, the
  // cluster rank), which merge through distributed shared memory (the end of this kernel).
  const int64_t pair = kCluster ? blockIdx.y : blockIdx.x, split = kCluster ? blockIdx.x : blockIdx.y;
  const int64_t t = pair / n_head_kv, kv = pair % n_head_kv;
  const int group = int(n_head / n_head_kv);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  // The loads before the wait that depend on no other load (the fused prologue's norm weights
  // and frequencies, the heads' sinks) asked for first, beside the position and the block table's
  // row, so that they share one L2 round trip: after the K/V prefetch's lookups, as they were, the
  // chain before the wait was ~2.9 µs, and most blocks start only as q/k/v's blocks leave (they do
  // not fit an SM beside one), so it was on the step's path. Qwen3-30B-A3B INT4 tg128 on an H200
  // (BENCHMARKS.md): +2.0% at depth 0, +1.6% at 2048, +3.0% at 8192, +2.0% at 16384 with FP8 KV.
  const bool fused = pro.q_in != nullptr;
  static_assert(HD <= kThreads, "a thread a dim for the norm weights");
  float pre_qw = 1.f, pre_kw = 1.f, pre_freq = 0.f, pre_sink = -kInf;
  if (fused && tid < HD) {
    if (pro.q_norm) pre_qw = pro.q_norm[tid];
    if (pro.k_norm) pre_kw = pro.k_norm[tid];
    if (tid < HD / 2) pre_freq = pro.inv_freq[tid];
  }
  if (tid < ROWS && tid < group) pre_sink = sink_logit(mods, kv * group + tid);
  const int32_t* block_table = kv_token_table(tables, seq_rows, table_stride, t);
  const int64_t row_stride = n_head_kv * HD;
  const T* kbase = k + kv * HD;
  const T* vbase = v + kv * HD;
  auto row_of = [&](int64_t pos) { return kv_pool_row(block_table, block_size_log2, pos) * row_stride; };
  const int64_t n_ctx = int64_t(positions[t]) + 1;
  const int64_t lo = window_first(n_ctx, mods.window);
  // The split's positions [begin, begin + span), of which [max(begin, lo), end) are attended.
  int64_t begin, span, n_active = n_splits, first_split = 0;
  if constexpr (kCluster) {
    // The context's tiles from lo's dealt out evenly, a contiguous run a block: every block stays
    // (the cluster's barriers count them all), one with none stores an empty partial.
    const int64_t tile0 = lo / kDecodeTcTile, tiles_all = (n_ctx - 1) / kDecodeTcTile - tile0 + 1;
    const int64_t per = (tiles_all + n_splits - 1) / n_splits;
    span = per * kDecodeTcTile;
    begin = (tile0 + split * per) * kDecodeTcTile;
  } else {
    // Splits past the token's position (the context bucket sizes the grid; the position is known
    // only on the device) end here: they write nothing and the merge counts only the others.
    // So do splits wholly before a sliding window's first position `lo`.
    span = SPLIT;
    begin = split * SPLIT;
    n_active = ::min(n_splits, (n_ctx + SPLIT - 1) / SPLIT);
    first_split = lo / SPLIT;
    if (split >= n_active || split < first_split) return;
  }
  NIBBLE_TIMELINE_BLOCK(kAttentionTc);
  const int64_t from = ::max(begin, lo);
  prefetch_split_rows<HD, kThreads>(kbase, vbase, block_table, block_size_log2, row_stride, from,
                                    begin + span - from, n_ctx - 1);
  // The fused prologue's inputs that need no predecessor: norm weights and the rotation at the
  // token's position (the same f32 angle as qk_norm_rope_kv_write_kernel).
  const int64_t pos_new = n_ctx - 1;
  const bool writes_new = fused && pos_new >= begin && pos_new < begin + span;  // this split holds the new row
  __shared__ float s_qw[HD], s_kw[HD], s_cos[HD / 2], s_sin[HD / 2];
  __shared__ __align__(16) T s_knew[HD], s_vnew[HD];
  if (fused && tid < HD) {  // a thread a dim (HD <= kThreads), its loads asked for at the start
    s_qw[tid] = pre_qw, s_kw[tid] = pre_kw;
    if (tid < HD / 2) {
      float sn, cs;
      sincosf(float(pos_new) * pre_freq, &sn, &cs);
      s_cos[tid] = cs * pro.attention_factor, s_sin[tid] = sn * pro.attention_factor;
    }
  }
  // This thread's share of them in registers, still before the wait: its q dims d = 32c + 8·t4 + e
  // of the first half (c < kChunks / 2) and their partners d + HD / 2.
  constexpr int kRot = kChunks / 2 * 8;
  float rw0[kRot], rw1[kRot], rcs[kRot], rsn[kRot];
  if (fused) {
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kChunks / 2; ++c)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int d = 32 * c + 8 * t4 + e, i = 8 * c + e;
        rw0[i] = s_qw[d], rw1[i] = s_qw[d + HD / 2], rcs[i] = s_cos[d], rsn[i] = s_sin[d];
      }
  }
  // The successor (the o GEMV) is released only after this block's loop (below): released here,
  // its blocks' weight loads (o's 4.2 MB for Qwen3-30B-A3B) filled the memory queues while this
  // loop's K/V rows came from L2, and a 16-position tile waited ~1 µs for rows already in L2.
  // After the loop its loads overlap the merges instead (BENCHMARKS.md, H100: Qwen3-30B-A3B INT4
  // +1.8% at depth 0, +1.4% at 8192, +2.7% at 16384 with FP8 KV; after the merges was worse at
  // depth 0).
  // The heads' sink logits read before the wait too: after the loop, where the merge needs them,
  // a global read would queue behind the o GEMV's weights, released by then.
  __shared__ float s_sink[ROWS];
  if (tid < ROWS) s_sink[tid] = pre_sink;
  const int rows = ::min(group, ROWS);
  pdl_enter_at<kPdlAttention, kPdlAfterProducts>();
  NIBBLE_TIMELINE_WAITED();
  const int64_t end = ::min(n_ctx, begin + span);
  // The new row is the business of the one warp whose tiles hold its position (the others never
  // read it, so no block barrier waits for it): its raw key and value first, so that their L2
  // trip overlaps the queries' below instead of following it.
  constexpr int kPairs = HD / 64;  // rotation pairs (i, i + HD / 2) per lane
  const bool new_warp = writes_new && warp == int((pos_new - begin) / kDecodeTcTile % kDecodeTcWarps);
  float nk[2 * kPairs], nv[2 * kPairs];
  if (new_warp) {
    const float* ksrc = pro.k_new + t * pro.kv_stride + kv * HD;
    const float* vsrc = pro.v_new + t * pro.kv_stride + kv * HD;
#pragma unroll
    for (int j = 0; j < 2 * kPairs; ++j) {  // j < kPairs: i, else i + HD / 2
      nk[j] = ksrc[lane + 32 * j];
      nv[j] = vsrc[lane + 32 * j];
    }
  }

  // Q fragments: row r = head g + 8·(r % 2); k-step 2c + e holds dims 32c + 8·t4 + 4e + {0, 1}
  // (registers 0, 1) and + {2, 3} (registers 2, 3).
  uint32_t qf[HD / 16][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = g + 8 * r;
    const bool head = h < group && h < ROWS;
    // Fused: the raw head, normalised (the quad holds all HD dims) and rotated in registers.
    float qv[kChunks][8] = {};
    if (fused && (ROWS > 8 || r == 0)) {  // with 8 rows, row g + 8 is never a head
      const float* qr = pro.q_in + t * pro.q_stride + (kv * group + h) * HD;
      float ss = 0.f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int e = 0; e < 8; e += 4) {
          const float4 u = head ? *reinterpret_cast<const float4*>(qr + 32 * c + 8 * t4 + e) : make_float4(0, 0, 0, 0);
          qv[c][e] = u.x, qv[c][e + 1] = u.y, qv[c][e + 2] = u.z, qv[c][e + 3] = u.w;
        }
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += qv[c][e] * qv[c][e];
      const float inv = pro.q_norm ? rsqrtf(quad_sum(ss) / float(HD) + pro.eps) : 1.f;
#pragma unroll
      for (int c = 0; c < kChunks / 2; ++c)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int i = 8 * c + e;
          const float x0 = qv[c][e] * inv * rw0[i], x1 = qv[c + kChunks / 2][e] * inv * rw1[i];
          qv[c][e] = x0 * rcs[i] - x1 * rsn[i];
          qv[c + kChunks / 2][e] = x1 * rcs[i] + x0 * rsn[i];
        }
    }
    const float* qh = head ? q + ((t * n_head) + kv * group + h) * HD : nullptr;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
      if (fused) {
        a = make_float4(qv[c][0], qv[c][1], qv[c][2], qv[c][3]);
        b = make_float4(qv[c][4], qv[c][5], qv[c][6], qv[c][7]);
      } else if (qh) {
        a = *reinterpret_cast<const float4*>(qh + 32 * c + 8 * t4);
        b = *reinterpret_cast<const float4*>(qh + 32 * c + 8 * t4 + 4);
      }
      qf[2 * c][r] = pack_f16x2(a.x * scale_log2, a.y * scale_log2);
      qf[2 * c][2 + r] = pack_f16x2(a.z * scale_log2, a.w * scale_log2);
      qf[2 * c + 1][r] = pack_f16x2(b.x * scale_log2, b.y * scale_log2);
      qf[2 * c + 1][2 + r] = pack_f16x2(b.z * scale_log2, b.w * scale_log2);
    }
  }

  NIBBLE_TIMELINE_MARK_AT(1);  // thread 0's q fragments built
  if (new_warp) {
    // The new key (RMSNorm, RoPE) and value, to the cache and to shared memory for this warp's loop.
    const int64_t row = kv_pool_row(block_table, block_size_log2, pos_new) * row_stride + kv * HD;
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) ss += nk[j] * nk[j] + nk[kPairs + j] * nk[kPairs + j];
    const float inv = pro.k_norm ? rsqrtf(warp_sum(ss) / float(HD) + pro.eps) : 1.f;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const int i = lane + 32 * j;
      const float x0 = nk[j] * inv * s_kw[i], x1 = nk[kPairs + j] * inv * s_kw[i + HD / 2];
      const float y0 = x0 * s_cos[i] - x1 * s_sin[i], y1 = x1 * s_cos[i] + x0 * s_sin[i];
      kv_store(k_out + row + i, y0), kv_store(s_knew + i, y0);
      kv_store(k_out + row + i + HD / 2, y1), kv_store(s_knew + i + HD / 2, y1);
    }
#pragma unroll
    for (int j = 0; j < 2 * kPairs; ++j) {
      const int i = lane + 32 * j;  // lane + 32 j covers 0 .. HD - 1 as j runs over 2 kPairs
      kv_store(v_out + row + i, nv[j]), kv_store(s_vnew + i, nv[j]);
    }
    __syncwarp();  // the new row in shared memory, for this warp's lanes
  }
  NIBBLE_TIMELINE_MARK_AT(2);
  float o[kDimsPerGroup][4];
#pragma unroll
  for (int d = 0; d < kDimsPerGroup; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float row_m[2] = {-kInf, -kInf}, row_l[2] = {0.f, 0.f};

  for (int64_t p0 = begin + warp * kDecodeTcTile; p0 < end; p0 += kDecodeTcWarps * kDecodeTcTile) {
    if (p0 + kDecodeTcTile <= lo) continue;  // wholly before the window (a tile with `lo` has a position for every row)
    // Loads first (K: 2 rows x kChunks units, V: 4 rows x kVUnits), zeros past the end so that
    // masked positions contribute 0 · 0 (never 0 · NaN from memory no step wrote).
    uint4 kr[2][kChunks], vr[4][kVUnits];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t pos = p0 + 4 * (g / 2) + 2 * j + g % 2;
      const T* src = !(pos < end && pos >= lo) ? nullptr
                     : new_warp && pos == pos_new ? s_knew + 8 * t4
                                                    : kbase + row_of(pos) + 8 * t4;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) kr[j][c] = src ? kv_load8_f16(src + 32 * c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t pos = p0 + 4 * t4 + i;
      const T* src = !(pos < end && pos >= lo) ? nullptr
                     : new_warp && pos == pos_new ? s_vnew + kDimsPerGroup * g
                                                    : vbase + row_of(pos) + kDimsPerGroup * g;
#pragma unroll
      for (int u = 0; u < kVUnits; ++u) vr[i][u] = src ? kv_load8_f16(src + 8 * u) : make_uint4(0, 0, 0, 0);
    }
    // S (log2 units): s[j] = rows g, g + 8 x positions 4·t4 + 2j + {0, 1}.
    float s[2][4] = {};
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mma_f16(s[j], qf[2 * c], kr[j][c].x, kr[j][c].y);
        mma_f16(s[j], qf[2 * c + 1], kr[j][c].z, kr[j][c].w);
      }
    NIBBLE_TIMELINE_MARK_AT(3);  // this tile's S products issued (its K rows arrived)
    float mx[2] = {-kInf, -kInf};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t pos = p0 + 4 * t4 + 2 * j + c % 2;
        const float x = pos < end && pos >= lo ? s[j][c] : -kInf;
        s[j][c] = x;
        mx[c / 2] = fmaxf(mx[c / 2], x);
      }
    online_softmax_tile(s, mx, row_m, row_l, o);
    NIBBLE_TIMELINE_MARK_AT(4);  // its softmax done (S products complete)
    const uint32_t a[4] = {pack_f16x2(s[0][0], s[0][1]), pack_f16x2(s[0][2], s[0][3]), pack_f16x2(s[1][0], s[1][1]),
                           pack_f16x2(s[1][2], s[1][3])};
#pragma unroll
    for (int nt = 0; nt < kDimsPerGroup; ++nt) {
      const int u = nt / 8, w = nt % 8 / 2;
      const uint32_t sel = nt % 2 ? 0x7632u : 0x5410u;  // high or low halves of two words
      auto word = [&](int i) { return reinterpret_cast<const uint32_t*>(&vr[i][u])[w]; };
      mma_f16(o[nt], a, __byte_perm(word(0), word(1), sel), __byte_perm(word(2), word(3), sel));
    }
    NIBBLE_TIMELINE_MARK_AT(5);  // its P·V products issued (its V rows arrived)
  }
  pdl_trigger_at<kPdlAttention, kPdlAfterProducts>(kPdlAfterProducts);

  NIBBLE_TIMELINE_MARK_AT(0);  // the loop done
  // Merge the warps: (max, sum) per row, O rows; row r of this thread is head g + 8r.
#pragma unroll
  for (int r = 0; r < ROWS / 8; ++r) {
    const int row = g + 8 * r;
    const float l = quad_sum(row_l[r]);
    if (t4 == 0) s_m[row][warp] = row_m[r], s_l[row][warp] = l;
#pragma unroll
    for (int c = 0; c < HD / 16; ++c) {  // dims HD / 4 · t4 + 4c + i: n-tile (4c + i) mod HD / 8 of half (4c + i) / (HD / 8)
      float4 u;
      float* e = &u.x;
#pragma unroll
      for (int i = 0; i < 4; ++i) e[i] = o[(4 * c + i) % (HD / 8)][2 * r + (4 * c + i) / (HD / 8)];
      *reinterpret_cast<float4*>(decode_tc_o_unit(s_o[warp][row], row, HD / 16 * t4 + c)) = u;
    }
  }
  NIBBLE_TIMELINE_MARK_AT(6);  // the warps' rows in shared memory
  pdl_trigger_at<kPdlAttention, kPdlAfterProducts>(kPdlAfterInput);
  __syncthreads();
  NIBBLE_TIMELINE_MARK_AT(8);  // every warp's rows there
  const bool only = !kCluster && n_active - first_split == 1;
  // kCluster: this block's heads' (max in log2 units, sum, unnormalised O) for the cluster merge.
  __shared__ __align__(16) float s_cm[ROWS], s_cl[ROWS], s_cacc[kCluster ? ROWS : 1][kCluster ? HD : 4];
  const bool empty = end <= from;  // a cluster's block with no positions (the others have some)
  // The warps that had tiles: tiles tile_lo .. tile_lo + tiles - 1 of the split, tile i in warp
  // i mod WARPS. At depth 0 most warps have none, and their rows are not read.
  const int tile_lo = int((::max(begin, lo) - begin) / kDecodeTcTile);
  const int tiles = int((end - 1 - begin) / kDecodeTcTile) - tile_lo + 1;
  // Warp w merges heads w, w + WARPS, ...: every lane weighs the warps' rows of the head itself
  // (the same broadcast reads), so no second barrier; a lane's HD / 32 dims are one load a warp
  // and one store. The same terms in the same order as a pass per row, then per column.
  constexpr int kPerLane = HD / 32;
  using Vec = std::conditional_t<kPerLane == 2, float2, float4>;
  for (int h = warp; h < rows; h += kDecodeTcWarps) {
    if (kCluster && empty) {
      if (lane == 0) s_cm[h] = -kInf, s_cl[h] = 0.f;
      *reinterpret_cast<Vec*>(&s_cacc[h][kPerLane * lane]) = Vec{};
      continue;
    }
    float m[kDecodeTcWarps], ls[kDecodeTcWarps];
#pragma unroll
    for (int w = 0; w < kDecodeTcWarps; w += 4) {
      *reinterpret_cast<float4*>(m + w) = *reinterpret_cast<const float4*>(&s_m[h][w]);
      *reinterpret_cast<float4*>(ls + w) = *reinterpret_cast<const float4*>(&s_l[h][w]);
    }
    Vec part[kDecodeTcWarps];
#pragma unroll
    for (int w = 0; w < kDecodeTcWarps; ++w) {
      const bool had = tiles >= kDecodeTcWarps || (w - tile_lo % kDecodeTcWarps + kDecodeTcWarps) % kDecodeTcWarps < tiles;
      part[w] = had ? *reinterpret_cast<const Vec*>(decode_tc_o_unit(s_o[w][h], h, kPerLane * lane / 4) + kPerLane * lane % 4)
                    : Vec{};
    }
    // This tail is on the step's critical path with one split (depth 0), so it is kept short: the
    // maxima as a tree (3 dependent steps for 8 warps, not 8) and each warp's weight by the SFU
    // alone (a warp with no positions has max -inf: weight 2^-inf = 0; mx is finite, as a block
    // here has a position). With the one-factor output (sink_factor) +1.5% for Qwen3 at depth 0.
    float mt[kDecodeTcWarps];
#pragma unroll
    for (int w = 0; w < kDecodeTcWarps; ++w) mt[w] = m[w];
#pragma unroll
    for (int s2 = kDecodeTcWarps / 2; s2 > 0; s2 /= 2)
#pragma unroll
      for (int w = 0; w < s2; ++w) mt[w] = fmaxf(mt[w], mt[w + s2]);
    const float mx = mt[0];
    NIBBLE_TIMELINE_MARK_AFTER(9, mx);  // the warps' maxima read
    float acc[kPerLane] = {}, l = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeTcWarps; ++w) {
      const float f = exp2_approx(m[w] - mx);
      l += ls[w] * f;
      const float* pv = &part[w].x;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) acc[j] += pv[j] * f;
    }
    NIBBLE_TIMELINE_MARK_AFTER(10, acc[0] + l);  // the head's rows weighed
    if constexpr (kCluster) {
      if (lane == 0) s_cm[h] = mx, s_cl[h] = l;
      Vec a;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) (&a.x)[j] = acc[j];
      *reinterpret_cast<Vec*>(&s_cacc[h][kPerLane * lane]) = a;
    } else {
      // The max in log2 units here, natural-log units in the partial.
      decode_store_split<HD>(out, partial, t * n_head + kv * group + h, split, n_splits, only, kPerLane * lane, acc,
                             mx * 0.6931471805599453f, l, s_sink[h]);
    }
  }
  if constexpr (kCluster) {
    decode_merge_cluster<HD, ROWS, kThreads>(s_cm, s_cl, s_cacc, rows, out + (t * n_head + kv * group) * HD, s_sink);
    return;
  }
  NIBBLE_TIMELINE_MARK_AT(7);  // the outputs stored
  if (only) return;
  decode_merge_last_split<ROWS, HD, kThreads>(partial, out, counters, t, kv, group, n_head, n_splits, first_split,
                                              n_active, mods, mergers, NIBBLE_TIMELINE_MARKER);
}

}  // namespace nibble::kernels
