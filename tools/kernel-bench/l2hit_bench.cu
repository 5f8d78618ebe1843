// Does an L2 hit wait behind the DRAM misses its SM has in flight? (BENCHMARKS.md: every decode
// kernel issues its weight loads before its PDL wait, and afterwards the few small reads on its
// critical path — the input row, routing sums, attention's q and K/V — take ~1-1.4 µs each, where
// an idle L2 hit takes a fraction of that.) One block an SM: warp 0 is the probe, which times a
// chain of dependent L2 hits (__ldcg, 8 lines in L2 since the last launch); warps 1..W are the
// weight warps, which issue L 16-byte loads a lane of cold bytes (DRAM, evict-first) and then
// consume them. The probe starts once every weight warp has issued its loads (a named barrier),
// so it asks for its lines behind them, as a decode kernel's staging does. Modes:
//   idle        no weight loads anywhere
//   same SM     the weight warps of the probe's own block (registers, ld.global.cs)
//   same warp   the probe warp itself issues L loads a lane first (as MmaTile::start before a wait)
//   other SMs   the weight loads on the other SMs only; the probes' SMs load nothing
//   same SM nc  the weight warps' loads through the read-only path (ld.global.nc)
//   same SM tma the weight warps' bytes as bulk copies into shared memory (cp.async.bulk)
// Prints, per mode and L, the probe's median µs a dependent hit and the median time from the
// block's start until its weight warps had all their bytes. Run by hand on the GPU (sm_90):
//   build/cuda90/l2hit_bench [spin ns, default 1000; then again with 0]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_common.cuh"
#include "kernels/bulk_copy.cuh"

namespace {

namespace kernels = nibble::kernels;

enum Mode { kIdle, kSameSm, kSameWarp, kOtherSms, kSameSmNc, kSameSmTma, kModes };
const char* const kModeNames[kModes] = {"idle", "same SM", "same warp", "other SMs", "same SM nc", "same SM tma"};

constexpr int kWeightWarps = 7, kChain = 8;
constexpr int kHotStride = 32;  // uint32 entries: 128 bytes, a line each

// t[3 a block]: the probe's chain ns, the weights' landing ns after the block's start, the chain's result.
template <int L>
__global__ void __launch_bounds__(32 * (1 + kWeightWarps)) probe_kernel(const uint4* __restrict__ cold,
                                                                         int64_t cold_units, int64_t offset,
                                                                         const uint32_t* __restrict__ hot, int mode,
                                                                         int probe_blocks, int spin_ns, unsigned long long* t,
                                                                         float* out) {
  extern __shared__ __align__(128) uint8_t stage[];
  __shared__ __align__(8) uint64_t bar;
  __shared__ unsigned long long s_landed;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned long long t0 = kernel_bench::globaltimer_ns();
  const bool probe_block = int(blockIdx.x) < probe_blocks;
  const bool loads_here = mode == kSameSm || mode == kSameSmNc || mode == kSameSmTma || (mode == kOtherSms && !probe_block);
  if (threadIdx.x == 0) {
    s_landed = 0;
    if (mode == kSameSmTma) {
      kernels::mbarrier_init(&bar, kWeightWarps);
      kernels::fence_barrier_init();
    }
  }
  __syncthreads();
  // This warp's cold units: lane-interleaved, so a warp's load instruction covers 512 contiguous bytes.
  auto unit = [&](int w, int i) {
    const int64_t u = offset + ((int64_t(blockIdx.x) * (kWeightWarps + 1) + w) * L + i) * 32 + lane;
    return cold + u;  // the caller keeps offset + a launch's units within cold_units
  };
  uint4 v[L];
  uint32_t acc = 0;
  if (warp > 0 && loads_here) {
    if (mode == kSameSmTma) {
      const uint32_t bytes = 32u * L * 16u;
      if (lane == 0) {
        kernels::mbarrier_arrive_expect(&bar, bytes);
        kernels::bulk_load(stage + (warp - 1) * bytes, unit(warp, 0) - lane, bytes, &bar, kernels::l2_evict_first_policy());
      }
    } else {
#pragma unroll
      for (int i = 0; i < L; ++i) v[i] = mode == kSameSmNc ? __ldg(unit(warp, i)) : __ldcs(unit(warp, i));
    }
  }
  if (warp == 0 && mode == kSameWarp && probe_block) {
#pragma unroll
    for (int i = 0; i < L; ++i) v[i] = __ldcs(unit(0, i));
  }
  // Every weight load issued before the probe asks for its first line.
  asm volatile("bar.sync 1, %0;" ::"n"(32 * (1 + kWeightWarps)) : "memory");
  if (warp == 0) {
    // spin_ns: let the other SMs' blocks issue theirs too (they start within a few hundred ns of
    // each other); 0: the probe's first line asked for right behind its block's weights.
    while (kernel_bench::globaltimer_ns() - t0 < unsigned(spin_ns)) {
    }
    uint32_t idx = 0;
    const unsigned long long a = kernel_bench::globaltimer_ns();
    if (lane == 0)
#pragma unroll 1
      for (int c = 0; c < kChain; ++c) idx = __ldcg(hot + idx * kHotStride);
    idx = __shfl_sync(0xffffffffu, idx, 0);
    const unsigned long long b = kernel_bench::globaltimer_ns();
    if (lane == 0 && probe_block) t[blockIdx.x * 3 + 0] = b - a, t[blockIdx.x * 3 + 2] = idx;
    if (mode == kSameWarp && probe_block) {
#pragma unroll
      for (int i = 0; i < L; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
      if (lane == 0) atomicMax(&s_landed, kernel_bench::globaltimer_ns() - t0);
    }
  } else if (loads_here) {
    if (mode == kSameSmTma) {
      kernels::mbarrier_wait(&bar, 0);
      acc = reinterpret_cast<const uint32_t*>(stage)[threadIdx.x];
    } else {
#pragma unroll
      for (int i = 0; i < L; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    }
    if (lane == 0) atomicMax(&s_landed, kernel_bench::globaltimer_ns() - t0);
  }
  __syncthreads();
  if (threadIdx.x == 0 && probe_block) t[blockIdx.x * 3 + 1] = s_landed;
  if (acc == 0x12345678u) out[0] = 1.f;
}

template <int L>
void measure(int sms, int spin_ns, const uint4* cold, int64_t cold_units, const uint32_t* hot, unsigned long long* t, float* out) {
  // At least 120 KB, so one block an SM whatever the mode (the TMA mode's stage is 7 · 512 · L bytes).
  const int smem = std::max(kWeightWarps * 32 * L * 16, 120 * 1024);
  BENCH_CHECK(cudaFuncSetAttribute(probe_kernel<L>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t per_launch = int64_t(sms) * (kWeightWarps + 1) * L * 32;
  int64_t offset = 0;
  for (int mode = 0; mode < kModes; ++mode) {
    const int probe_blocks = mode == kOtherSms ? 16 : sms;
    std::vector<double> chain, landed;
    std::vector<unsigned long long> h(size_t(sms) * 3);
    for (int trial = 0; trial < 30; ++trial) {
      probe_kernel<L><<<sms, 32 * (1 + kWeightWarps), smem>>>(cold, cold_units, offset, hot, mode, probe_blocks, spin_ns, t, out);
      offset = offset + 2 * per_launch > cold_units ? 0 : offset + per_launch;
      BENCH_CHECK(cudaMemcpy(h.data(), t, h.size() * 8, cudaMemcpyDeviceToHost));
      if (trial < 3) continue;  // warm-up
      for (int b = 0; b < probe_blocks; ++b) {
        chain.push_back(double(h[b * 3]) / 1e3 / kChain);
        landed.push_back(double(h[b * 3 + 1]) / 1e3);
      }
    }
    const double mb = double(per_launch) * 16 * kWeightWarps / (kWeightWarps + 1) / 1e6;
    std::printf("| %s | %d | %.1f | %.3f |", kModeNames[mode], L, mode == kIdle ? 0.0 : mb,
                kernel_bench::median(chain));
    if (mode == kIdle || mode == kOtherSms)
      std::printf("  |\n");  // no weight warps on the probes' SMs
    else
      std::printf(" %.2f |\n", kernel_bench::median(landed));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int spin_ns = argc > 1 ? std::atoi(argv[1]) : 1000;  // the probe's start after its block's
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const int64_t bytes = int64_t(2) << 30;  // 2 GB: far past L2
  uint4* cold = nullptr;
  BENCH_CHECK(cudaMalloc(&cold, bytes));
  BENCH_CHECK(cudaMemset(cold, 1, bytes));
  // The hot chain: entry i (a line each) names the next, 8 lines visited.
  std::vector<uint32_t> hh(size_t(kChain) * kHotStride, 0);
  for (int c = 0; c < kChain; ++c) hh[size_t(c) * kHotStride] = uint32_t((c + 1) % kChain);
  uint32_t* hot = nullptr;
  BENCH_CHECK(cudaMalloc(&hot, hh.size() * 4));
  BENCH_CHECK(cudaMemcpy(hot, hh.data(), hh.size() * 4, cudaMemcpyHostToDevice));
  unsigned long long* t = nullptr;
  float* out = nullptr;
  BENCH_CHECK(cudaMalloc(&t, size_t(sms) * 3 * 8));
  BENCH_CHECK(cudaMalloc(&out, 64));
  std::printf("%s, %d SMs, one block an SM: a probe warp and %d weight warps\n\n", prop.name, sms, kWeightWarps);
  for (const int spin : {spin_ns, 0}) {
    std::printf("\nthe probe starts %d ns after its block\n\n", spin);
    std::printf("| weight loads | L (16 B a lane) | MB a launch | µs a dependent L2 hit | weights landed µs |\n");
    std::printf("|---|---:|---:|---:|---:|\n");
    measure<8>(sms, spin, cold, bytes / 16, hot, t, out);
    measure<16>(sms, spin, cold, bytes / 16, hot, t, out);
    measure<32>(sms, spin, cold, bytes / 16, hot, t, out);
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  return 0;
}
