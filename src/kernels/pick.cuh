// A greedy decode step's pick on the device: the (value, index) arg-max with the lowest index on
// ties, and the post of the pick to the host. Shared by the argmax kernels (elementwise.cuh) and
// the MXFP4 lm_head that picks as it goes (mxfp4_stream.cuh).
#pragma once

#include <cmath>
#include <cstdint>

namespace nibble::kernels {

struct ArgmaxBest {
  float val = -INFINITY;
  int32_t idx = INT32_MAX;
  __device__ __forceinline__ void merge(float v, int32_t i) {
    if (v > val || (v == val && i < idx)) val = v, idx = i;
  }
  __device__ __forceinline__ void warp_merge() {
    for (int o = 16; o > 0; o >>= 1) merge(__shfl_xor_sync(0xffffffffu, val, o), __shfl_xor_sync(0xffffffffu, idx, o));
  }
};

// The best of count partial (value, index) pairs, in every lane of the calling warp (every lane
// calls it); read through L2 (ld.cg) when kL2, for partials other blocks wrote in this launch.
template <bool kL2 = false>
__device__ __forceinline__ ArgmaxBest warp_best_of(const float* part_val, const int32_t* part_idx, unsigned count) {
  ArgmaxBest best;
  for (unsigned b = threadIdx.x % 32; b < count; b += 32)
    best.merge(kL2 ? __ldcg(part_val + b) : part_val[b], kL2 ? __ldcg(part_idx + b) : part_idx[b]);
  best.warp_merge();
  return best;
}

// The pick of a row's best: its index, or 0 for a row of NaNs (as std::max_element returns the
// first element).
__device__ __forceinline__ int32_t best_index(const ArgmaxBest& best) { return best.idx == INT32_MAX ? 0 : best.idx; }

// A decode step's pick, written by the kernel that advances the next step's inputs straight into
// pinned host memory mapped for the device: ring[seq mod kDecodePostRing] = (seq << 32) | pick,
// then seq + 1 (a counter in device memory). The host knows each step's seq (it counts the posts it
// queued), waits for the step's event and checks the tag. Why: the 4-byte copy to the host between
// two steps' graphs held the next step back (tg128 against the copy: Qwen3-30B-A3B INT4 +0.5%,
// gpt-oss-20b all-MXFP4 +0.1-0.4%, H100, BENCHMARKS.md). Null seq: no post.
constexpr int kDecodePostRing = 64;

struct DecodePost {
  unsigned* seq;
  unsigned long long* ring;
};

__device__ __forceinline__ void decode_post(const DecodePost& post, int32_t pick) {
  if (!post.seq) return;
  const unsigned s = *post.seq;
  post.ring[s % kDecodePostRing] = (static_cast<unsigned long long>(s) << 32) | static_cast<uint32_t>(pick);
  *post.seq = s + 1;
}

// What a kernel that picks a row's token writes: each of the row's blocks its best at part_val /
// part_idx[slot], counted on *counter; the last merges them, writes the pick to *out, with next_ids
// advances the next decode step's id and position (*next_ids, *positions + 1) and posts it (a null
// post.seq: no post), and resets the counter.
struct GreedyPick {
  float* part_val;
  int32_t* part_idx;
  unsigned* counter;
  int32_t* out;
  int32_t* next_ids;
  int32_t* positions;
  DecodePost post;
};

// The block's best of every thread's (called by every thread; s_best: 32 entries of shared
// memory), in warp 0's lanes.
__device__ __forceinline__ ArgmaxBest block_best(ArgmaxBest best, ArgmaxBest* s_best) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
  best.warp_merge();
  if (lane == 0) s_best[warp] = best;
  __syncthreads();
  best = warp == 0 && lane < warps ? s_best[lane] : ArgmaxBest{};
  if (warp == 0) best.warp_merge();
  return best;
}

// The block's end of a picking kernel, block `slot` of the `slots` that pick one row (p's pointers
// at that row's): every thread of the block calls it with its own best (of the elements it saw);
// returns after the last of the row's blocks has written the pick (and, with next_ids, advanced
// and posted it). s_best: 32 entries of shared memory.
__device__ __forceinline__ void greedy_pick_finish(ArgmaxBest best, const GreedyPick& p, ArgmaxBest* s_best,
                                                   unsigned slot, unsigned slots) {
  __shared__ bool s_last;
  const int lane = threadIdx.x % 32;
  best = block_best(best, s_best);
  if (threadIdx.x == 0) {
    p.part_val[slot] = best.val;
    p.part_idx[slot] = best.idx;
    __threadfence();  // the partial before the count: the last block reads it
    s_last = atomicAdd(p.counter, 1u) == slots - 1;
  }
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  __threadfence();  // the other blocks' partials, seen through their counts
  best = warp_best_of<true>(p.part_val, p.part_idx, slots);
  if (lane == 0) {
    const int32_t pick = best_index(best);
    *p.out = pick;
    if (p.next_ids) {
      *p.next_ids = pick, *p.positions += 1;
      decode_post(p.post, pick);
    }
    *p.counter = 0;  // for the next launch (stream order: none runs beside this one)
  }
}

}  // namespace nibble::kernels
