// How long does a decode kernel take from its PDL wait to its input row in shared memory, and
// what shortens it? (BENCHMARKS.md: every decode kernel stages its input row 1.5-2.2 µs after its
// wait, where an L2 hit under a weight burst takes ~0.4 µs.)
//
// A chain of PDL launches captured as a graph (as nibble replays a decode step: every launch its
// own parameters), 48 layers of 6 phases. Each phase has one block of 4 warps an SM (128 blocks),
// issues 32 KB of cold weight loads a block (evict-first, a 1.2 GB pool, so L2 turns over as in a
// step) before its wait, stages the previous phase's 16 KB f32 row (every block reads the same
// lines) into shared memory after it, releases its successor, and writes 32 floats a block of its
// own row. Variants of the staging:
//   far        the row pointer a kernel parameter 424 bytes in (its own constant line), used where
//              the compiler puts it (after the wait), 16-byte loads and stores (ptxas issues them
//              in two rounds, 3 + 5)
//   far+reg    the pointer laundered through an asm before the wait (it becomes a generic pointer:
//              LD, not LDG, and all 8 loads in one round)
//   far+touch  its constant line read at the kernel's start; near: the pointer beside the
//              weights' (a line read before the wait) — whether a constant-cache miss is the cost
//   one round  8 volatile ld.global (ptxas still splits them); generic loads: 8 ld (one round)
//   own copy   each block its own 16 KB copy (not the lines every block reads; not kept in L2)
//   f16 row    8 KB instead of 16 (4 loads a thread)
//   bulk copy  one cp.async.bulk of the row by thread 0 into shared memory, an mbarrier
//   multicast  a cluster of 4 blocks, each bulk-copying a quarter to all four (the cluster launch
//              costs more than the copy saves)
//   ..., no weights: the chain alone
// Prints µs a phase (the graph's median replay over 288 launches) and thread 0's wait → row
// staged, median and p90 over the last replay's blocks. Run by hand on the GPU (sm_90):
//   build/cuda90/param_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_common.cuh"
#include "kernels/bulk_copy.cuh"

namespace {

constexpr int kBlocks = 128, kThreads = 128, kRow = 4096;
constexpr int kWeightUnits = 16;                                 // 16-byte loads a thread: 32 KB a block
constexpr int64_t kPhaseBytes = int64_t(kBlocks) * kThreads * kWeightUnits * 16;  // 4 MB
constexpr int kPhases = 48 * 6;

template <int PAD>
struct Params {
  const uint4* weights;
  unsigned long long* stamps;  // [blocks][2]: wait, staged (ns)
  const float* x_near;
  float* y;
  const float* x_private;
  unsigned pad[PAD];
  const float* x_far;
};

enum Variant { kFar, kFarReg, kFarTouch, kNear, kOneRound, kHalf, kPrivate, kBulk, kMulticast, kGeneric, kGenericHalf, kBulkHalf };
constexpr int kCluster = 4;  // kMulticast: blocks a cluster, each copying a quarter of the row to all

namespace kernels = nibble::kernels;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ float4 ld_f4(const float* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

// The same through a generic address (LD, not LDG).
__device__ __forceinline__ float4 ld_generic_f4(const float* p) {
  float4 v;
  asm volatile("ld.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#endif

template <int PAD, int V, bool kWeights>
__global__ void __launch_bounds__(kThreads) phase_kernel(Params<PAD> p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // PDL, bulk copies and clusters: sm_90+ (main checks)
  __shared__ alignas(128) float row[kRow];
  __shared__ uint64_t bar;
  const int tid = threadIdx.x;
  uint64_t policy = 0;
  if constexpr (V == kBulk || V == kMulticast || V == kBulkHalf) {  // before the wait: the barrier armed for the row's bytes
    if (tid == 0) {
      kernels::mbarrier_init(&bar, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      kernels::mbarrier_arrive_expect(&bar, V == kBulkHalf ? kRow * 2 : kRow * 4);
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    }
    if constexpr (V == kMulticast) cluster_sync();  // peers' barriers armed before any copy lands
    else __syncthreads();
  }
  if constexpr (V == kFarTouch) {
    const unsigned s = unsigned(reinterpret_cast<uintptr_t>(p.x_far));
    asm volatile("" ::"r"(s));
  }
  uint4 w[kWeightUnits];
  if constexpr (kWeights) {
    const uint4* wp = p.weights + int64_t(blockIdx.x) * kThreads * kWeightUnits + tid;
#pragma unroll
    for (int i = 0; i < kWeightUnits; ++i) w[i] = __ldcs(wp + i * kThreads);
  }
  const float* x = V == kNear ? p.x_near : p.x_far;
  if constexpr (V == kFarReg) asm volatile("mov.b64 %0, %0;" : "+l"(x));
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const unsigned long long t_wait = kernel_bench::globaltimer_ns();
  if constexpr (V == kOneRound || V == kPrivate) {
    // All 8 loads issued before any is used (ordered volatile loads): one L2 round trip. kPrivate
    // reads a 16 KB copy of its own (written once, in L2), not the lines every block reads.
    const float* src = V == kPrivate ? p.x_private + int64_t(blockIdx.x) * kRow : x;
    float4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = ld_f4(src + 4 * (tid + j * kThreads));
#pragma unroll
    for (int j = 0; j < 8; ++j) reinterpret_cast<float4*>(row)[tid + j * kThreads] = v[j];
  } else if constexpr (V == kGeneric || V == kGenericHalf) {
    constexpr int kLoads = V == kGeneric ? 8 : 4;
    float4 v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) v[j] = ld_generic_f4(x + 4 * (tid + j * kThreads));
#pragma unroll
    for (int j = 0; j < kLoads; ++j) reinterpret_cast<float4*>(row)[tid + j * kThreads] = v[j];
  } else if constexpr (V == kHalf) {
    // The row as f16 (8 KB, 4 loads a thread), as a row staged in f16 by its producer would be.
    float4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = ld_f4(x + 4 * (tid + j * kThreads));
#pragma unroll
    for (int j = 0; j < 4; ++j) reinterpret_cast<float4*>(row)[tid + j * kThreads] = v[j];
  } else if constexpr (V == kBulk || V == kMulticast || V == kBulkHalf) {
    if (tid == 0) {
      if constexpr (V != kMulticast) {
        kernels::bulk_load(row, x, V == kBulk ? kRow * 4 : kRow * 2, &bar, policy);
      } else {
        const uint32_t r = cluster_rank(), part = kRow / kCluster;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::"r"(
                kernels::shared_address(row + r * part)),
            "l"(x + r * part), "r"(part * 4), "r"(kernels::shared_address(&bar)), "h"(uint16_t((1u << kCluster) - 1))
            : "memory");
      }
    }
    kernels::mbarrier_wait(&bar, 0);
  } else {
    float4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = reinterpret_cast<const float4*>(x)[tid + j * kThreads];
#pragma unroll
    for (int j = 0; j < 8; ++j) reinterpret_cast<float4*>(row)[tid + j * kThreads] = v[j];
  }
  const unsigned long long t_staged = kernel_bench::globaltimer_ns();
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;");
  unsigned acc = 0;
  if constexpr (kWeights)
#pragma unroll
    for (int i = 0; i < kWeightUnits; ++i) acc ^= w[i].x ^ w[i].y ^ w[i].z ^ w[i].w;
  if (tid < 32) {
    const int o = blockIdx.x * 32 + tid;
    p.y[o] = 0.5f * row[o] + 0.25f * row[(o + 1) % kRow] + float(acc & 1u) * 1e-20f;
  }
  if constexpr (V == kMulticast) cluster_sync();  // no block leaves while a peer's copy may land in it
  if (tid == 0) {
    p.stamps[2 * blockIdx.x] = t_wait;
    p.stamps[2 * blockIdx.x + 1] = t_staged;
  }
#else
  __trap();
#endif
}

struct Result {
  double us_phase, wait_staged_p50, wait_staged_p90;
};

template <int PAD, int V, bool kWeights>
Result run(cudaStream_t stream, const uint4* pool, int64_t pool_units, float* act, unsigned long long* stamps,
           const float* private_rows) {
  cudaGraph_t graph;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int ph = 0; ph < kPhases; ++ph) {
    cudaLaunchAttribute attr[2]{};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = kCluster, attr[1].val.clusterDim.y = 1, attr[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(kBlocks);
    config.blockDim = dim3(kThreads);
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = V == kMulticast ? 2 : 1;
    Params<PAD> p{};
    const int64_t units = kPhaseBytes / 16;
    p.weights = pool + (int64_t(ph) * units) % (pool_units - units + 1);
    p.stamps = stamps + int64_t(ph) * 2 * kBlocks;
    p.x_near = p.x_far = act + int64_t(ph % 8) * kRow;
    p.y = act + int64_t((ph + 1) % 8) * kRow;
    p.x_private = private_rows;
    for (int i = 0; i < PAD; ++i) p.pad[i] = unsigned(i);
    BENCH_CHECK(cudaLaunchKernelEx(&config, phase_kernel<PAD, V, kWeights>, p));
  }
  BENCH_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) BENCH_CHECK(cudaGraphLaunch(exec, stream));
  BENCH_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> replays;
  for (int r = 0; r < 15; ++r) {
    cudaEventRecord(a, stream);
    BENCH_CHECK(cudaGraphLaunch(exec, stream));
    cudaEventRecord(b, stream);
    BENCH_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    replays.push_back(1000.0 * ms / kPhases);
  }
  BENCH_CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::vector<unsigned long long> h(size_t(kPhases) * 2 * kBlocks);
  BENCH_CHECK(cudaMemcpy(h.data(), stamps, h.size() * 8, cudaMemcpyDeviceToHost));
  std::vector<double> d;
  for (int ph = 6; ph < kPhases; ++ph)
    for (int bl = 0; bl < kBlocks; ++bl) {
      const size_t i = (size_t(ph) * kBlocks + bl) * 2;
      d.push_back(double(h[i + 1] - h[i]) / 1000.0);
    }
  std::sort(d.begin(), d.end());
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  return {kernel_bench::median(replays), d[d.size() / 2], d[d.size() * 9 / 10]};
}

}  // namespace

int main() {
  int device = 0, major = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  BENCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) {
    std::fprintf(stderr, "param_bench: needs sm_90 or newer (PDL, bulk copies, clusters)\n");
    return 1;
  }
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t pool_bytes = int64_t(300) * kPhaseBytes;  // 1.26 GB: L2 turns over every step
  uint8_t* pool = nullptr;
  BENCH_CHECK(cudaMalloc(&pool, pool_bytes));
  kernel_bench::fill_bytes_kernel<<<1024, 256>>>(pool, pool_bytes, 7u, 0u, 256u);
  float* act = kernel_bench::device_floats(8 * kRow, 0.5f);
  unsigned long long* stamps = nullptr;
  BENCH_CHECK(cudaMalloc(&stamps, size_t(kPhases) * 2 * kBlocks * 8));
  const auto* units = reinterpret_cast<const uint4*>(pool);
  const float* priv = kernel_bench::device_floats(int64_t(kBlocks) * kRow, 0.25f);
  const int64_t n_units = pool_bytes / 16;
  std::printf("Params<96>: row pointer at byte %zu; Params<0>: near pointer at byte %zu\n",
              offsetof(Params<96>, x_far), offsetof(Params<0>, x_near));
  std::printf("%-26s %12s %22s %10s\n", "variant", "us a phase", "wait->staged p50 us", "p90 us");
  auto show = [](const char* name, Result r) {
    std::printf("%-26s %12.3f %22.3f %10.3f\n", name, r.us_phase, r.wait_staged_p50, r.wait_staged_p90);
  };
  for (int round = 0; round < 2; ++round) {
    show("far", run<96, kFar, true>(stream, units, n_units, act, stamps, priv));
    show("far+reg", run<96, kFarReg, true>(stream, units, n_units, act, stamps, priv));
    show("far+touch", run<96, kFarTouch, true>(stream, units, n_units, act, stamps, priv));
    show("near", run<0, kNear, true>(stream, units, n_units, act, stamps, priv));
    show("one round", run<96, kOneRound, true>(stream, units, n_units, act, stamps, priv));
    show("one round, own copy", run<96, kPrivate, true>(stream, units, n_units, act, stamps, priv));
    show("f16 row (8 KB)", run<96, kHalf, true>(stream, units, n_units, act, stamps, priv));
    show("bulk copy", run<96, kBulk, true>(stream, units, n_units, act, stamps, priv));
    show("multicast, cluster of 4", run<96, kMulticast, true>(stream, units, n_units, act, stamps, priv));
    show("generic loads", run<96, kGeneric, true>(stream, units, n_units, act, stamps, priv));
    show("generic loads, f16 row", run<96, kGenericHalf, true>(stream, units, n_units, act, stamps, priv));
    show("bulk copy, f16 row", run<96, kBulkHalf, true>(stream, units, n_units, act, stamps, priv));
    show("one round, no weights", run<96, kOneRound, false>(stream, units, n_units, act, stamps, priv));
    show("own copy, no weights", run<96, kPrivate, false>(stream, units, n_units, act, stamps, priv));
    show("multicast, no weights", run<96, kMulticast, false>(stream, units, n_units, act, stamps, priv));
    show("far, no weights", run<96, kFar, false>(stream, units, n_units, act, stamps, priv));
    show("near, no weights", run<0, kNear, false>(stream, units, n_units, act, stamps, priv));
  }
  return 0;
}
