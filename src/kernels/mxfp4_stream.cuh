// The MXFP4 decode products with the weights streamed through shared memory (sm_90+): a ring
// of stages that one producer warp a block fills with bulk copies of whole 16-row tiles
// (kernels/bulk_copy.cuh) and the consumer warps decode and multiply as they land. Used by
// gpt-oss's MoE decode (kernels/moe_mxfp4_stream.cuh) and by an MXFP4 lm_head (below).
//
// Why: the register kernels (kernels/gemv_mxfp4.cuh) hold a warp's next groups in registers, and
// each warp streams only ~12 KB, so its loads, its E2M1 decode and its products take turns, and
// the bytes an SM has in flight are bounded by its registers. Here no register holds a load in
// flight, and the inner loop is only the decode and the mma steps (the register kernels': whole
// groups without per-block bounds, the token's row for every B column, so no lane's load is
// predicated).
//
// A stage is one 16-row tile of one matrix over all of K: 16 row copies (k/2 bytes each, into
// rows padded so that the 8 rows a warp's 16-byte loads touch fall in distinct banks) and one
// copy of the tile's 16 scale rows. The consumer warps split the tile's groups of 128 k; their
// partial sums meet in shared memory, summed by whichever warp finishes the tile last.
//
// Work: items (one output tile each) go to blocks round-robin, or (kClaim) only each block's first
// ceil(stages / L) do, the rest going to whichever block's producer claims them first from a
// counter in global memory; an item is L tiles in sequence
// (MoE gate/up and the lm_head: 1; MoE down: top_k, one per slot, weighted and summed in
// registers). Needs n % 16 == 0 and 16-byte aligned codes and scales (the launchers check; the
// register kernels take the rest). Batch 1 only: every B column is the token's row.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/bulk_copy.cuh"
#include "kernels/gemv_mxfp4.cuh"
#include "kernels/pick.cuh"
#include "kernels/timeline.cuh"

namespace nibble::kernels {

// A staged code row: k/2 bytes padded to 64 mod 128, so rows g and g + 1 start half a bank cycle
// apart and a warp's 16-byte loads of 8 rows are conflict-free.
__host__ __device__ constexpr int64_t mxfp4_stream_row_stride(int64_t k) { return k / 2 + (192 - (k / 2) % 128) % 128; }
// A stage: the 16 code rows, the 16 scale rows, then the tile's 16 bias floats (when its source
// has them).
__host__ __device__ constexpr int64_t mxfp4_stream_stage_bytes(int64_t k) {
  return 16 * mxfp4_stream_row_stride(k) + 16 * mxfp4_scale_stride(k) + 64;
}
// An item's staged biases (Mxfp4StreamTile::bias) as its epilogue sees them: tile l's 16 floats
// in v[l] when bit l of mask is set (l < kMxfp4StagedBiasTiles; the epilogue reads the rest, or
// unstaged ones, from global memory).
constexpr int kMxfp4StagedBiasTiles = 4;
struct Mxfp4StagedBias {
  float v[kMxfp4StagedBiasTiles][16];
  uint32_t mask, pad[3];
};
// Dynamic shared memory: the ring, its two barriers a stage, the consumers' partial sums of
// stages + 2 items (W × 16 floats and 16 bytes each: a counter, and for the first `stages` the
// item in that stage when items are claimed and whether that stage holds biases), their staged
// biases, then `extra` bytes (16-aligned).
__host__ __device__ constexpr int64_t mxfp4_stream_extra_offset(int64_t k, int stages, int warps) {
  return stages * (mxfp4_stream_stage_bytes(k) + 16) + (stages + 2) * (64 * warps + 16) +
         (stages + 2) * int64_t(sizeof(Mxfp4StagedBias));
}
__host__ __device__ constexpr int64_t mxfp4_stream_smem(int64_t k, int stages, int warps, int64_t extra) {
  return mxfp4_stream_extra_offset(k, stages, warps) + extra;
}

// One block (32 k) of rows g and g + 8 of a staged tile: the two words' E2M1 pairs as the mma's A,
// x's 16-byte unit as B (every column the token's row: only column 0 is kept), the block's scales
// applied to the sums. acc[0]: row g, acc[1]: row g + 8.
__device__ __forceinline__ void mxfp4_block_dot(uint32_t w0, uint32_t w1, uint32_t s0, uint32_t s1, uint4 xv,
                                                float (&acc)[2]) {
  uint32_t p0[4], p1[4];
  mxfp4_decode_word(w0, p0);
  mxfp4_decode_word(w1, p1);
  const uint32_t a0[4] = {p0[0], p1[0], p0[1], p1[1]}, a1[4] = {p0[2], p1[2], p0[3], p1[3]};
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  mma_f16(d, a0, xv.x, xv.y);
  mma_f16(d, a1, xv.z, xv.w);
  acc[0] = fmaf(d[0], __uint_as_float(s0), acc[0]);
  acc[1] = fmaf(d[2], __uint_as_float(s1), acc[1]);
}

// acc += this warp's groups (kw, kw + W, ...) of a staged tile, rows g and g + 8; x: the token's
// staged row (+ t), in shared memory or (kGlobalX) global. Whole groups of 4 blocks take a loop
// without per-block bounds; a last partial group (k % 128 != 0) the general one.
template <int W, bool kGlobalX>
__device__ __forceinline__ void mxfp4_stage_dot(const uint8_t* stage, int64_t k, int kw, const uint4* x,
                                                float (&acc)[2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int stride = int(mxfp4_stream_row_stride(k)), sstride = int(mxfp4_scale_stride(k));
  const int whole = int(k / 128), groups = int(mxfp4_groups(k));
  const uint8_t* row0 = stage + g * stride + 16 * t;
  const uint8_t* row1 = row0 + 8 * stride;
  const uint32_t* sc0 = reinterpret_cast<const uint32_t*>(stage + 16 * stride + g * sstride);
  const uint32_t* sc1 = reinterpret_cast<const uint32_t*>(stage + 16 * stride + (g + 8) * sstride);
  auto load_x = [&](int unit) { return kGlobalX ? __ldg(x + 4 * unit) : x[4 * unit]; };
  for (int q = kw; q < whole; q += W) {
    const uint4 v0 = *reinterpret_cast<const uint4*>(row0 + 64 * q);
    const uint4 v1 = *reinterpret_cast<const uint4*>(row1 + 64 * q);
    const uint32_t s0 = sc0[q], s1 = sc1[q];
    const uint32_t w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int b = 0; b < 4; ++b)
      mxfp4_block_dot(w0[b], w1[b], __float_as_uint(mxfp4_group_scale(s0, b)),
                      __float_as_uint(mxfp4_group_scale(s1, b)), load_x(4 * q + b), acc);
  }
  if (whole < groups && whole % W == kw) {  // the partial group: r < 4 blocks, words at 4 (r·t + b)
    const int q = whole, r = mxfp4_group_blocks(k, q);
    const uint8_t* base0 = row0 - 16 * t + 64 * q;
    const uint8_t* base1 = base0 + 8 * stride;
    for (int b = 0; b < r; ++b)
      mxfp4_block_dot(*reinterpret_cast<const uint32_t*>(base0 + 4 * (r * t + b)),
                      *reinterpret_cast<const uint32_t*>(base1 + 4 * (r * t + b)),
                      __float_as_uint(mxfp4_group_scale(sc0[q], b)), __float_as_uint(mxfp4_group_scale(sc1[q], b)),
                      load_x(4 * q + b), acc);
  }
}

struct Mxfp4StreamTile {  // what the producer copies: rows tile0 .. tile0 + 15 of w
  Mxfp4Weight w;
  int64_t tile0;
  // Those rows' biases (16 floats, 16-byte aligned) or null: copied with the tile, so that the
  // item's epilogue does not wait on a DRAM read after its products (Mxfp4StagedBias).
  const float* bias = nullptr;
};
struct Mxfp4StreamInput {  // what a consumer multiplies a stage by
  const uint4* x;          // the token's staged row, + t: every lane's B column is the token
  float factor;            // the tile's weight in the item's sum
};

// bias + row0 as a tile's Mxfp4StreamTile::bias: null when there is none or the bulk copy cannot
// take it (not 16-byte aligned), so the epilogue reads it from global memory.
__device__ __forceinline__ const float* mxfp4_stageable_bias(const float* bias, int64_t row0) {
  return bias && reinterpret_cast<uintptr_t>(bias + row0) % 16 == 0 ? bias + row0 : nullptr;
}

// No block-wide work after the PDL wait (mxfp4_stream's default `after_wait`).
struct Mxfp4NoPrologue {
  __device__ void operator()() const {}
};
// No timeline probe (mxfp4_stream's default `probe`).
struct Mxfp4NoProbe {
  __device__ void operator()(int) const {}
};
// Nothing read ahead for the epilogue (mxfp4_stream's default `preload`).
struct Mxfp4NoPreload {
  __device__ float operator()(int64_t) const { return 0.f; }
};

// The block's share of `items` (items blockIdx.x, + gridDim.x, ...), each `L` tiles through the
// ring of `stages`. Warps 0..W-1 consume, warp W produces. Every thread of the block calls it
// after staging what it needs before the PDL wait; the producer issues the first `stages` tiles
// before its wait when kEarly (source may then read only what was written two launches back).
//   source(item, l) -> Mxfp4StreamTile   (producer)
//   input(item, l) -> Mxfp4StreamInput   (consumers, after the wait)
//   epilogue(item, partial, staged, pre) (the item's last consumer warp; partial[w][row]: warp w's
//                                         sum; staged: the biases its tiles' sources gave; pre:
//                                         what preload returned to this lane)
//   preload(item) -> float                (every consumer lane, after the wait, as it starts the
//                                         item: a global read the epilogue needs, e.g. the output
//                                         row it adds to, issued before the products so that its
//                                         round trip is not the item's last step)
//   after_wait()                         (every thread, after the wait and the first `stages` tiles
//                                         issued (kEarly), before any consumer reads a stage: what
//                                         the block stages from its predecessor, e.g. a normalised x;
//                                         it may synchronise the block)
//   probe(event)                         (the consumers, for the timeline (kernels/timeline.cuh;
//                                         empty in normal builds): 0 as their wait returns without
//                                         after_wait, 1 + j once tile j of the block has landed
//                                         (j < 4), 8 once the block's products are done)
// kClaim (without after_wait: not kEarly; with it: L = 1): items past the static ones are claimed,
// after the wait, from claim[0];
// claim[1] counts the blocks done claiming, and the last of them sets both back to 0 for the next
// launch (so they must be 0 before the first). Why: with a static share, blocks of 4 tiles and of
// 3 (gpt-oss's gate/up: 1440 tiles over 396 blocks) and the memory system's uneven service left
// the grid's last block ending ~6 µs after its median one (in-kernel timeline, H100).
template <int W, bool kEarly, bool kGlobalX, int kSite = kPdlNoSite, bool kClaim = false, typename Source,
          typename Input, typename Epilogue, typename AfterWait = Mxfp4NoPrologue, typename Probe = Mxfp4NoProbe,
          typename Preload = Mxfp4NoPreload>
__device__ __forceinline__ void mxfp4_stream(int64_t items, int L, int64_t k, int stages, Source&& source,
                                             Input&& input, Epilogue&& epilogue, AfterWait&& after_wait = {},
                                             Probe&& probe = {}, unsigned* claim = nullptr, Preload&& preload = {}) {
  constexpr bool kPrologue = !std::is_same_v<std::decay_t<AfterWait>, Mxfp4NoPrologue>;
  static_assert(!kClaim || kPrologue || !kEarly, "claimed items without after_wait: the producer starts after the wait");
  uint8_t* ring = dynamic_smem();
  const int64_t stage_bytes = mxfp4_stream_stage_bytes(k), stride = mxfp4_stream_row_stride(k);
  const int64_t scale_bytes = 16 * mxfp4_scale_stride(k);
  auto* full = reinterpret_cast<uint64_t*>(ring + stages * stage_bytes);
  uint64_t* empty = full + stages;
  auto* sums = reinterpret_cast<float(*)[W][16]>(empty + stages);
  auto* counts = reinterpret_cast<uint32_t*>(sums + stages + 2);
  int32_t* stage_item = reinterpret_cast<int32_t*>(counts) + 1;  // [4 s]: stage s's item (kClaim), -1: none left
  uint32_t* stage_biased = counts + 2;                              // [4 s]: stage s holds its tile's biases
  auto* staged = reinterpret_cast<Mxfp4StagedBias*>(counts + 4 * (stages + 2));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], W);
    for (int s = 0; s < stages + 2; ++s) counts[4 * s] = 0;
    fence_barrier_init();
  }
  __syncthreads();  // the barriers, and whatever the caller staged
  const int64_t mine = items > blockIdx.x ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0, total = mine * L;

  // The producer warp's copies of one tile into stage s, completed on its `full` barrier.
  // The flag is written before the arrive, which the consumers' wait on the stage acquires.
  auto copy_tile = [&](int s, const Mxfp4StreamTile& src, uint64_t policy) {
    const bool biased = src.bias != nullptr;
    if (lane == 0) {
      stage_biased[4 * s] = biased;
      mbarrier_arrive_expect(&full[s], uint32_t(16 * (k / 2) + scale_bytes + (biased ? 64 : 0)));
    }
    __syncwarp();
    uint8_t* stage = ring + s * stage_bytes;
    if (lane < 16)
      bulk_load(stage + lane * stride, src.w.codes + (src.tile0 + lane) * (k / 2), uint32_t(k / 2), &full[s], policy);
    else if (lane == 16)
      bulk_load(stage + 16 * stride, src.w.scales + src.tile0 * mxfp4_scale_stride(k), uint32_t(scale_bytes),
                &full[s], policy);
    else if (lane == 17 && biased)
      bulk_load(stage + 16 * stride + scale_bytes, src.bias, 64u, &full[s], policy);
  };
  // kClaim's producer from the block's n-th item (`item`, its first tile j) on: each claim is
  // issued as the previous item's copies go out, so its round trip overlaps the wait for a free
  // stage. The item goes into the stage's slot before the copies' arrive, which the consumers'
  // wait on the stage acquires. Then the consumers find -1 in the next stage, and the block counts
  // itself done claiming.
  auto produce_claimed = [&](int64_t n, int64_t item, int64_t j, uint64_t policy) {
    const int64_t first = (stages + L - 1) / L;
    for (; item < items; ++n) {
      unsigned ticket = 0;
      if (n + 1 >= first && lane == 0) ticket = atomicAdd(claim, 1u);
      for (int l = 0; l < L; ++l, ++j) {
        const int s = int(j % stages);
        if (j >= stages) mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
        if (lane == 0) stage_item[4 * s] = int32_t(item);
        copy_tile(s, source(item, l), policy);
      }
      item = n + 1 < first ? blockIdx.x + (n + 1) * gridDim.x
                           : first * gridDim.x + int64_t(__shfl_sync(~0u, ticket, 0));
    }
    const int s = int(j % stages);
    if (j >= stages) mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
    if (lane == 0) {
      stage_item[4 * s] = -1;
      mbarrier_arrive(&full[s]);
      __threadfence();  // this block's claims before its count
      if (atomicAdd(claim + 1, 1u) == gridDim.x - 1) claim[0] = 0, claim[1] = 0;
    }
  };
  if constexpr (kPrologue && kClaim) {
    // L = 1: the block's first `stages` items (blockIdx.x + n · gridDim.x) go out before the wait
    // (kEarly) or after it, the block stages its input, then the rest is claimed.
    const uint64_t policy = warp == W ? l2_evict_first_policy() : 0;
    int64_t n = 0, item = blockIdx.x;
    if (!kEarly) pdl_enter_at<kSite>();
    if (warp == W)
      for (; n < stages && item < items; ++n, item += gridDim.x) {
        if (lane == 0) stage_item[4 * n] = int32_t(item);
        copy_tile(int(n), source(item, 0), policy);
      }
    if (kEarly) pdl_enter_at<kSite>();
    after_wait();
    __syncthreads();  // what after_wait staged
    if (warp == W) {
      if (item < items) {  // all `stages` static items out: the next is claimed
        unsigned ticket = 0;
        if (lane == 0) ticket = atomicAdd(claim, 1u);
        item = stages * int64_t(gridDim.x) + int64_t(__shfl_sync(~0u, ticket, 0));
      }
      produce_claimed(n, item, n, policy);
      return;
    }
  } else if constexpr (kPrologue) {
    // Tile j of the block's share: item blockIdx.x + (j / L) · gridDim.x, tile j % L of it. The
    // first `stages` go out before the wait (kEarly) or after it, the block stages its input, then
    // the producer goes on as each stage is released.
    const uint64_t policy = warp == W ? l2_evict_first_policy() : 0;
    auto issue = [&](int64_t j) {
      copy_tile(int(j % stages), source(blockIdx.x + j / L * gridDim.x, int(j % L)), policy);
    };
    const int64_t early = total < stages ? total : stages;
    if (!kEarly) pdl_enter_at<kSite>();
    if (warp == W)
      for (int64_t j = 0; j < early; ++j) issue(j);
    if (kEarly) pdl_enter_at<kSite>();
    after_wait();
    __syncthreads();  // what after_wait staged
    if (warp == W) {
      for (int64_t j = early; j < total; ++j) {
        mbarrier_wait(&empty[j % stages], uint32_t((j / stages - 1) & 1));
        issue(j);
      }
      return;
    }
  } else if (warp == W) {  // producer
    const uint64_t policy = l2_evict_first_policy();
    if (!kEarly) pdl_enter_at<kSite>();
    if constexpr (kClaim) {
      produce_claimed(0, blockIdx.x, 0, policy);
      return;
    }
    int64_t j = 0;
    for (int64_t it = blockIdx.x; it < items; it += gridDim.x)
      for (int l = 0; l < L; ++l, ++j) {
        const int s = int(j % stages);
        if (kEarly && j == stages) pdl_enter_at<kSite>();
        if (j >= stages) mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
        copy_tile(s, source(it, l), policy);
      }
    if (kEarly && total <= stages) pdl_enter_at<kSite>();
    return;
  }

  if constexpr (!kPrologue) {
    pdl_enter_at<kSite>();
    probe(0);
  }
  const int g = lane / 4, t = lane % 4;
  // The consumers' tile j sits in stage cs = j % stages with phase parity cphase = (j / stages) & 1,
  // and their n-th item in slot n % (stages + 2): counters advanced a tile (an item) at a time, as
  // a 64-bit division by the runtime `stages` costs each warp tens of instructions a tile.
  int64_t j = 0;
  int cs = 0, slot = 0;
  uint32_t cphase = 0;
  auto next_tile = [&] {
    ++j;
    if (++cs == stages) cs = 0, cphase ^= 1u;
  };
  auto consume = [&](int64_t it) {  // the next item: its L tiles from stage cs on
    float acc[2] = {0.f, 0.f};
    const float pre = preload(it);
    Mxfp4StagedBias& item_bias = staged[slot];
    for (int l = 0; l < L; ++l, next_tile()) {
      const int s = cs;
      const Mxfp4StreamInput in = input(it, l);
      mbarrier_wait(&full[s], cphase);
      if (j < 4) probe(int(1 + j));
      float a[2] = {0.f, 0.f};
      uint8_t* stage = ring + s * stage_bytes;
      mxfp4_stage_dot<W, kGlobalX>(stage, k, warp, in.x, a);
      if (warp == 0 && l < kMxfp4StagedBiasTiles) {  // the biases leave the stage before it is released
        const bool biased = stage_biased[4 * s] != 0;
        if (biased && lane < 16)
          item_bias.v[l][lane] = reinterpret_cast<const float*>(stage + 16 * stride + scale_bytes)[lane];
        if (lane == 0) item_bias.mask = (l == 0 ? 0u : item_bias.mask) | (uint32_t(biased) << l);
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&empty[s]);
      acc[0] = fmaf(in.factor, a[0], acc[0]), acc[1] = fmaf(in.factor, a[1], acc[1]);
    }
    // Column 0 (the token) is in the lanes with t == 0. The last warp to finish the item sums it,
    // so no warp waits for the others. The ring keeps the fastest warp within `stages` tiles of
    // the slowest, so stages + 2 slots never hold two live items.
    float(&partial)[W][16] = sums[slot];
    if (t == 0) partial[warp][g] = acc[0], partial[warp][g + 8] = acc[1];
    __threadfence_block();
    __syncwarp();
    uint32_t arrived = 0;
    if (lane == 0) arrived = atomicAdd(&counts[4 * slot], 1u);  // W more each use
    if (__shfl_sync(~0u, arrived, 0) % W == W - 1) {
      __threadfence_block();
      epilogue(it, partial, static_cast<const Mxfp4StagedBias&>(item_bias), pre);
    }
    if (++slot == stages + 2) slot = 0;
  };
  if constexpr (kClaim) {
    for (;;) {  // the item in the next stage, once its copies (or the end) arrived
      mbarrier_wait(&full[cs], cphase);
      const int64_t it = stage_item[4 * cs];
      if (it < 0) break;
      consume(it);
    }
  } else {
    for (int64_t it = blockIdx.x; it < items; it += gridDim.x) consume(it);
  }
  probe(8);
  pdl_trigger_at<kSite>(kPdlAfterProducts);
}


// y[n] (+)= norm?(x[k]) · Wᵀ (+ b) for one token (m = 1) over the ring: an MXFP4 lm_head, whose
// thousands of tiles a block streams one after another. The weights need no predecessor, so each
// block's first `stages` tiles are copied before the PDL wait; after it the block stages x
// (normalised when kNorm) once. Why: the register GEMV read gpt-oss's 201088 x 2880 head at ~2.1-2.3
// TB/s, its warps' loads in flight bounded by their registers (BENCHMARKS.md).
// kPick: a greedy decode step's head also picks the token (pick.cuh GreedyPick): each thread keeps
// the best of the rows it stores, the blocks' bests meet in the last block to finish, so no argmax
// launch follows the head.
// kClaim: tiles past a block's first `stages` are claimed from claim[0..1] (mxfp4_stream; 0 before
// and after the launch): the head's last block had ended ~11 µs after its median one.
template <int W, bool kNorm, int kMinBlocks = 1, bool kPick = false, bool kClaim = false>
__global__ void __launch_bounds__(32 * (W + 1), kMinBlocks) gemv_mxfp4_stream_kernel(Mxfp4Weight w, const float* __restrict__ bias,
                                                                         const float* __restrict__ x,
                                                                         float* __restrict__ y, int64_t n, int64_t k,
                                                                         GemvIo io, int stages, GreedyPick pick,
                                                                         unsigned* __restrict__ claim) {
  NIBBLE_TIMELINE_BLOCK(kGemvInt4);
  __half* xs = reinterpret_cast<__half*>(dynamic_smem() + mxfp4_stream_extra_offset(k, stages, W));
  const uint4* xb = reinterpret_cast<const uint4*>(xs) + threadIdx.x % 4;
  ArgmaxBest best;  // kPick: of the rows this thread stores
  mxfp4_stream<W, true, false, kPdlNoSite, kClaim>(
      n / 16, 1, k, stages,
      [&](int64_t it, int) { return Mxfp4StreamTile{w, 16 * it, mxfp4_stageable_bias(bias, 16 * it)}; },
      [&](int64_t, int) { return Mxfp4StreamInput{xb, 1.f}; },
      [&](int64_t it, const float(&partial)[W][16], const Mxfp4StagedBias& staged, float) {
        const int r = threadIdx.x % 32;
        if (r >= 16) return;
        const int64_t row = 16 * it + r;
        float total = staged.mask & 1u ? staged.v[0][r] : bias ? bias[row] : 0.f;
#pragma unroll
        for (int i = 0; i < W; ++i) total += partial[i][r];
        total = io.accumulate ? y[row] + total : total;
        y[row] = total;
        if constexpr (kPick) best.merge(total, int32_t(row));
      },
      [&] {
        NIBBLE_TIMELINE_WAITED();
        XRows<1, kNorm> xr{x, k, 1, io.norm, {}};
        mxfp4_stage_x_normed(xr, k, io.eps, xs);
      },
      Mxfp4NoProbe{}, claim);
  if constexpr (kPick) {
    __shared__ ArgmaxBest s_best[32];
    greedy_pick_finish(best, pick, s_best, blockIdx.x, gridDim.x);
  }
}

}  // namespace nibble::kernels
