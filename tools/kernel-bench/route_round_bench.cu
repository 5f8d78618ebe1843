// What the expert kernels' routing costs, and what slows it (BENCHMARKS.md: in a decode step each
// of a slot's s + 1 arg-max rounds takes ~0.16-0.2 µs, gate/up's slot-7 blocks knowing their expert
// ~1.1 µs after slot 0's). Three parts, clock64 cycles:
//   1. One warp a block, 128 experts (4 a lane), choice s = 0..7 alone: the shipped rounds
//      (moe_route.cuh route_round: expert lane + 32 i, a warp max of the keys, a warp min of the
//      experts holding it) against a ballot form (expert 4 · lane + i; each lane's best kept apart,
//      a warp max, the lowest lane holding it by a ballot). Every choice is checked against the
//      shipped rounds on random logits with ties (exit status 1 on a mismatch).
//   2. Three blocks an SM as gate/up runs them, warp 0 routing (choice 7) beside three warps that
//      load cold bytes before the rounds, during them, or not at all; the rounds by shuffles and
//      16 dependent shared-memory round trips the same ways: which operations wait on the loads.
//   3. 396 blocks reading the same folded router sums (one L2 trip) from 1, 8 or 64 copies.
// Run by hand on the GPU: build/cuda90/route_round_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "bench_common.cuh"
#include "kernels/moe_route.cuh"

namespace {

namespace kernels = nibble::kernels;

// The s-th choice, expert 4 · lane + i in key[i]: the ballot rounds.
__device__ __forceinline__ int32_t choice_ballot(uint32_t (&key)[4], int s) {
  const int lane = threadIdx.x % 32;
  int winner = 0, wi = 0;
  for (int j = 0; j <= s; ++j) {
    uint32_t best = key[0];
    int bi = 0;
#pragma unroll
    for (int i = 1; i < 4; ++i)
      if (key[i] > best) best = key[i], bi = i;  // strict: the lowest i on ties
    const uint32_t m = __reduce_max_sync(0xffffffffu, best);
    winner = __ffs(__ballot_sync(0xffffffffu, best == m)) - 1;  // the lowest lane: the lowest expert
    if (lane == winner) {
      wi = bi;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (i == bi) key[i] = 0u;
    }
  }
  return 4 * winner + __shfl_sync(0xffffffffu, wi, winner);
}

// out[trial][s][variant] = the expert; cycles[trial][s][variant].
__global__ void __launch_bounds__(32) rounds_kernel(const float* __restrict__ logits, int trials, int32_t* out,
                                                    long long* cycles) {
  const int lane = threadIdx.x;
  for (int trial = blockIdx.x; trial < trials; trial += gridDim.x) {
    const float* l = logits + trial * 128;
    for (int s = 0; s < 8; ++s) {
      // shipped: expert lane + 32 i
      uint32_t ka[4], kb[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) ka[i] = kernels::route_key(l[lane + 32 * i]);
      const float4 v = reinterpret_cast<const float4*>(l)[lane];
      kb[0] = kernels::route_key(v.x), kb[1] = kernels::route_key(v.y);
      kb[2] = kernels::route_key(v.z), kb[3] = kernels::route_key(v.w);
      // Empty volatile asm that use the values pin the work between the clock reads.
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(ka[i]), "r"(kb[i]));
      __syncwarp();
      const long long t0 = clock64();
      const int32_t ea = kernels::route_choice_from_keys(ka, 4, s, nullptr);
      asm volatile("" ::"r"(ea));
      const long long t1 = clock64();
      const int32_t eb = choice_ballot(kb, s);
      asm volatile("" ::"r"(eb));
      const long long t2 = clock64();
      if (lane == 0) {
        out[(trial * 8 + s) * 2 + 0] = ea, out[(trial * 8 + s) * 2 + 1] = eb;
        cycles[(trial * 8 + s) * 2 + 0] = t1 - t0, cycles[(trial * 8 + s) * 2 + 1] = t2 - t1;
      }
    }
  }
}

// The same rounds as three gate/up blocks an SM run them: 4 warps a block, warp 0 routing (choice
// 7, 8 rounds). loads: 0, the other warps wait at a barrier; 1, they first issue 32 16-byte loads a
// lane of cold bytes (DRAM, evict-first, as MmaTile::start does) and the rounds start once those
// are issued; 2 and 3, the rounds by shuffles instead of warp reductions (route_round's older
// form) with and without the loads; 4 and 5, 16 dependent shared-memory round trips instead, without
// and with: which of a critical path's operations wait behind the weights' fills; 6, the rounds
// while the other warps issue their loads (as slot 7's blocks route while slot 0's load).
__device__ __forceinline__ int32_t choice_shuffles(uint32_t (&key)[4], int s) {
  const int lane = threadIdx.x % 32;
  int32_t e = 0;
  for (int j = 0; j <= s; ++j) {
    uint32_t best = 0;
    int bi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (key[i] > best) best = key[i], bi = i;
    // (key, complement of the expert) as one 64-bit value: the max is the best key, lowest expert.
    unsigned long long v = (static_cast<unsigned long long>(best) << 32) | (0xffffffffu - uint32_t(lane + 32 * bi));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long u = __shfl_xor_sync(0xffffffffu, v, o);
      v = u > v ? u : v;
    }
    e = int32_t(0xffffffffu - uint32_t(v));
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (lane + 32 * i == e) key[i] = 0u;
  }
  return e;
}

__global__ void __launch_bounds__(128) contended_kernel(const float* __restrict__ logits, const uint4* __restrict__ cold,
                                                        int64_t offset, int mode, int32_t* out, long long* cycles) {
  const bool loads = mode == 1 || mode == 2 || mode == 5;
  const bool during = mode == 6;  // the other warps issue their loads while the rounds run
  extern __shared__ uint8_t hold[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int L = 32;
  uint4 v[L];
  if (warp > 0 && loads) {
    const uint4* src = cold + offset + ((int64_t(blockIdx.x) * 3 + warp - 1) * L) * 32 + lane;
#pragma unroll
    for (int i = 0; i < L; ++i) v[i] = __ldcs(src + 32 * i);
  }
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (warp > 0 && during) {
    const uint4* src = cold + offset + ((int64_t(blockIdx.x) * 3 + warp - 1) * L) * 32 + lane;
#pragma unroll
    for (int i = 0; i < L; ++i) v[i] = __ldcs(src + 32 * i);
  }
  if (warp == 0) {
    const float* l = logits + (blockIdx.x % 64) * 128;
    uint32_t ka[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) ka[i] = kernels::route_key(l[lane + 32 * i]);
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(ka[i]));
    const long long t0 = clock64();
    int32_t e;
    if (mode == 2 || mode == 3) {
      e = choice_shuffles(ka, 7);
    } else if (mode >= 4) {  // 16 dependent shared-memory round trips (a store, a barrier of the warp, a load)
      uint32_t x = ka[0];
      volatile uint32_t* sm = reinterpret_cast<volatile uint32_t*>(hold);
#pragma unroll 1
      for (int r = 0; r < 16; ++r) {
        sm[(lane + r) % 32] = x + 1;
        __syncwarp();
        x = sm[(lane + 1 + r) % 32];
        __syncwarp();
      }
      e = int32_t(x);
    } else {
      e = kernels::route_choice_from_keys(ka, 4, 7, nullptr);
    }
    asm volatile("" ::"r"(e));
    const long long t1 = clock64();
    if (lane == 0) out[blockIdx.x] = e + hold[0] * 0, cycles[blockIdx.x] = t1 - t0;
  } else if (loads || during) {
    uint32_t acc = 0;
#pragma unroll
    for (int i = 0; i < L; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    if (acc == 0x12345678u) out[0] = 0;
  }
}

// Hundreds of blocks reading the same folded router sums at once (moe_route.cuh
// router_acc_lane_logits: 4 experts' 64-bit sums a lane and Σh², one L2 trip): warp 0 of each
// of three blocks an SM loads them from copy blockIdx.x mod copies and times the trip; t[block] =
// (start ns, trip cycles), to see whether the copies' readers queue on the lines.
__global__ void __launch_bounds__(128) hot_sums_kernel(const unsigned long long* __restrict__ sums, int copies,
                                                       long long* t) {
  extern __shared__ uint8_t hold[];
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  const unsigned long long* c = sums + (blockIdx.x % copies) * 160;
  const long long t0 = clock64();
  unsigned long long raw[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) raw[i] = __ldcg(c + lane + 32 * i);
  const unsigned long long ss = __ldcg(c + 128);
  unsigned long long x = ss;
#pragma unroll
  for (int i = 0; i < 4; ++i) x ^= raw[i];
  asm volatile("" ::"l"(x));
  const long long t1 = clock64();
  if (lane == 0) t[2 * blockIdx.x] = (long long)start, t[2 * blockIdx.x + 1] = t1 - t0 + hold[0] * 0 + (x == 7 ? 1 : 0);
}

}  // namespace

int main() {
  constexpr int kTrials = 4096;
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> h(size_t(kTrials) * 128);
  for (int t = 0; t < kTrials; ++t)
    for (int e = 0; e < 128; ++e) {
      // Every 4th trial rounds to a coarse grid, so many logits tie.
      const float x = nd(rng);
      h[size_t(t) * 128 + e] = t % 4 == 0 ? std::round(x * 4.f) / 4.f : x;
    }
  float* d = nullptr;
  int32_t* out = nullptr;
  long long* cyc = nullptr;
  BENCH_CHECK(cudaMalloc(&d, h.size() * 4));
  BENCH_CHECK(cudaMalloc(&out, size_t(kTrials) * 16 * 4));
  BENCH_CHECK(cudaMalloc(&cyc, size_t(kTrials) * 16 * 8));
  BENCH_CHECK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  rounds_kernel<<<64, 32>>>(d, kTrials, out, cyc);
  BENCH_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> ho(size_t(kTrials) * 16);
  std::vector<long long> hc(size_t(kTrials) * 16);
  BENCH_CHECK(cudaMemcpy(ho.data(), out, ho.size() * 4, cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(hc.data(), cyc, hc.size() * 8, cudaMemcpyDeviceToHost));
  int mismatches = 0;
  for (int i = 0; i < kTrials * 8; ++i) mismatches += ho[size_t(i) * 2] != ho[size_t(i) * 2 + 1];
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: %d choices, %d differ from the shipped rounds\n\n", prop.name, kTrials * 8, mismatches);
  std::printf("| choice s (s + 1 rounds) | shipped cycles | ballot cycles |\n|---:|---:|---:|\n");
  for (int s = 0; s < 8; ++s) {
    std::vector<long long> a, b;
    for (int t = 0; t < kTrials; ++t) a.push_back(hc[size_t(t * 8 + s) * 2]), b.push_back(hc[size_t(t * 8 + s) * 2 + 1]);
    std::printf("| %d | %lld | %lld |\n", s, kernel_bench::median(a), kernel_bench::median(b));
  }
  // Three blocks an SM (shared memory), a wave of them.
  const int blocks = 3 * prop.multiProcessorCount, smem = int(prop.sharedMemPerMultiprocessor / 3 - 2048);
  BENCH_CHECK(cudaFuncSetAttribute(contended_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<long long> hk(static_cast<size_t>(blocks));
  long long* kc = nullptr;
  int32_t* ko = nullptr;
  BENCH_CHECK(cudaMalloc(&kc, size_t(blocks) * 8));
  BENCH_CHECK(cudaMalloc(&ko, size_t(blocks) * 4));
  const int64_t cold_units = (int64_t(2) << 30) / 16, per_launch = int64_t(blocks) * 3 * 32 * 32;
  uint4* cold = nullptr;
  BENCH_CHECK(cudaMalloc(&cold, cold_units * 16));
  BENCH_CHECK(cudaMemset(cold, 1, cold_units * 16));
  int64_t offset = 0;
  const char* names[7] = {"rounds by warp reductions, no loads", "rounds by warp reductions, after 3 warps' loads",
                          "rounds by shuffles, after 3 warps' loads", "rounds by shuffles, no loads",
                          "16 shared-memory round trips, no loads", "16 shared-memory round trips, after 3 warps' loads",
                          "rounds by warp reductions, while 3 warps issue their loads"};
  std::printf("\n| 3 blocks an SM, choice 7 (8 rounds) | median cycles | max |\n|---|---:|---:|\n");
  for (int loads = 0; loads < 7; ++loads) {
    std::vector<long long> all;
    for (int rep = 0; rep < 20; ++rep) {
      contended_kernel<<<blocks, 128, smem>>>(d, cold, offset, loads, ko, kc);
      offset = offset + 2 * per_launch > cold_units ? 0 : offset + per_launch;
      BENCH_CHECK(cudaMemcpy(hk.data(), kc, hk.size() * 8, cudaMemcpyDeviceToHost));
      all.insert(all.end(), hk.begin(), hk.end());
    }
    std::sort(all.begin(), all.end());
    std::printf("| %s | %lld | %lld |\n", names[loads], all[all.size() / 2], all.back());
  }
  {
    unsigned long long* sums = nullptr;
    BENCH_CHECK(cudaMalloc(&sums, 64 * 160 * 8));
    BENCH_CHECK(cudaMemset(sums, 3, 64 * 160 * 8));
    BENCH_CHECK(cudaFuncSetAttribute(hot_sums_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<long long> ht(size_t(2 * blocks));
    long long* dt = nullptr;
    BENCH_CHECK(cudaMalloc(&dt, ht.size() * 8));
    std::printf("\n| %d blocks read the sums, copies | trip cycles p50 | p90 | max | blocks' start spread ns |\n|---:|---:|---:|---:|---:|\n", blocks);
    for (const int copies : {1, 8, 64}) {
      std::vector<long long> trip;
      double spread = 0;
      for (int rep = 0; rep < 20; ++rep) {
        hot_sums_kernel<<<blocks, 128, smem>>>(sums, copies, dt);
        BENCH_CHECK(cudaMemcpy(ht.data(), dt, ht.size() * 8, cudaMemcpyDeviceToHost));
        long long lo = ht[0], hi = ht[0];
        for (int b = 0; b < blocks; ++b) {
          trip.push_back(ht[2 * b + 1]);
          lo = std::min(lo, ht[2 * b]), hi = std::max(hi, ht[2 * b]);
        }
        spread += double(hi - lo) / 20;
      }
      std::sort(trip.begin(), trip.end());
      std::printf("| %d | %lld | %lld | %lld | %.0f |\n", copies, trip[trip.size() / 2], trip[trip.size() * 9 / 10],
                  trip.back(), spread);
    }
  }
  return mismatches == 0 ? 0 : 1;
}
