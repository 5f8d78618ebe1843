// How fast can B blocks read a decode attention's K/V (16.8 MB for Qwen3-30B-A3B at depth 8192)
// when they are the blocks of thread-block clusters, against the same blocks launched plainly?
// (BENCHMARKS.md: a pair's splits as one cluster of 16 lost 8% at depth 8192, where 4 clusters of
// 16 are 64 blocks; a cluster lives in one GPC, so 4 clusters of 16 read through at most 4 of the
// GPU's GPCs, while 64 plain blocks spread over all of them.) Each block reads a contiguous share
// of the bytes with D 16-byte loads a thread in flight (L2 only, __ldcg), from DRAM (copies that
// together pass L2) or from L2 (the same copy each time); a block's start and end are stamped with
// the global timer, and a launch's time is the last end minus the first start. Prints, per shape,
// the median µs, GB/s, and how many distinct SMs held the blocks. Run by hand on the GPU (sm_90):
//   build/cuda90/cluster_stream_bench [MB, default 16.8]
// Then the same bytes as decode attention lays them out (rows of 256 bytes, one of 4 heads' at a
// 1 KB stride), read by 16-byte loads or by one bulk copy a row into a ring of shared memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#include "bench_common.cuh"
#include "kernels/bulk_copy.cuh"

namespace {

constexpr int kThreads = 256;

// Every kernel here: (bytes, count, per_head, t, out), and t[3 a block] = start ns, end ns, SM id.
__device__ __forceinline__ void stamp_block(unsigned long long* t, unsigned long long t0) {
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    t[3 * blockIdx.x] = t0;
    t[3 * blockIdx.x + 1] = kernel_bench::globaltimer_ns();
    t[3 * blockIdx.x + 2] = sm;
  }
}

// Contiguous bytes: block b reads units [b, b + 1) · units_per_block (per_head unused).
template <int D>
__global__ void __launch_bounds__(kThreads) stream_kernel(const uint4* __restrict__ src, int64_t units_per_block,
                                                          int, unsigned long long* t, float* out) {
  const unsigned long long t0 = kernel_bench::globaltimer_ns();
  const uint4* p = src + int64_t(blockIdx.x) * units_per_block;
  uint32_t acc = 0;
  for (int64_t u0 = threadIdx.x; u0 < units_per_block; u0 += int64_t(D) * kThreads) {
    uint4 r[D];
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int64_t u = u0 + int64_t(j) * kThreads;
      r[j] = u < units_per_block ? __ldcg(p + u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < D; ++j) acc += r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  }
  __syncthreads();
  if (acc == 0x12345678u) out[blockIdx.x] = float(acc);  // keeps the loads
  stamp_block(t, t0);
}

// The attention's own pattern: 4 heads, a row of 256 bytes a (position, head) at a 1 KB stride;
// block b reads head b / per_head's rows of its split. kRows: 16-byte loads, D a thread in flight
// (16 threads a row); kBulk: one cp.async.bulk a row into a ring of S stages of 64 rows (16 KB),
// every stage in flight at the start, each refilled once the block has read it.
constexpr int kHeads = 4, kRowBytes = 256, kStageRows = 64;

template <int D>
__global__ void __launch_bounds__(kThreads) rows_kernel(const uint4* __restrict__ src, int64_t rows, int per_head,
                                                        unsigned long long* t, float* out) {
  const unsigned long long t0 = kernel_bench::globaltimer_ns();
  const int head = int(blockIdx.x) / per_head, split = int(blockIdx.x) % per_head;
  const int64_t per = (rows + per_head - 1) / per_head, r0 = split * per, r1 = ::min(rows, r0 + per);
  constexpr int kUnits = kRowBytes / 16;
  const int64_t n = (r1 - r0) * kUnits;
  uint32_t acc = 0;
  for (int64_t i0 = threadIdx.x; i0 < n; i0 += int64_t(D) * kThreads) {
    uint4 r[D];
#pragma unroll
    for (int j = 0; j < D; ++j) {
      const int64_t i = i0 + int64_t(j) * kThreads;
      r[j] = i < n ? __ldcg(src + ((r0 + i / kUnits) * kHeads + head) * kUnits + i % kUnits) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < D; ++j) acc += r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
  }
  __syncthreads();
  if (acc == 0x12345678u) out[blockIdx.x] = float(acc);
  stamp_block(t, t0);
}

template <int S>
__global__ void __launch_bounds__(kThreads) bulk_rows_kernel(const uint4* __restrict__ src, int64_t rows,
                                                             int per_head, unsigned long long* t, float* out) {
  namespace k = nibble::kernels;
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[S];
  const unsigned long long t0 = kernel_bench::globaltimer_ns();
  const int head = int(blockIdx.x) / per_head, split = int(blockIdx.x) % per_head;
  const int64_t per = (rows + per_head - 1) / per_head, r0 = split * per, r1 = ::min(rows, r0 + per);
  const int stages = int((r1 - r0 + kStageRows - 1) / kStageRows);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) k::mbarrier_init(&full[s], 1);
    k::fence_barrier_init();
  }
  __syncthreads();
  // Warp 0 issues a stage: lane l the rows l, l + 32; lane 0 arms the barrier first.
  auto issue = [&](int st) {
    const int slot = st % S;
    const int64_t a = r0 + int64_t(st) * kStageRows, b = ::min(r1, a + kStageRows);
    if (tid == 0) k::mbarrier_arrive_expect(&full[slot], uint32_t((b - a) * kRowBytes));
    __syncwarp();
    for (int64_t r = a + tid; r < b; r += 32)
      k::bulk_load(ring + (size_t(slot) * kStageRows + size_t(r - a)) * kRowBytes,
                   src + (r * kHeads + head) * (kRowBytes / 16), kRowBytes, &full[slot]);
  };
  if (tid < 32)
    for (int st = 0; st < ::min(S, stages); ++st) issue(st);
  uint32_t acc = 0;
  for (int st = 0; st < stages; ++st) {
    const int slot = st % S;
    k::mbarrier_wait(&full[slot], uint32_t(st / S) & 1u);
    const uint4* u = reinterpret_cast<const uint4*>(ring + size_t(slot) * kStageRows * kRowBytes);
    for (int i = tid; i < kStageRows * kRowBytes / 16; i += kThreads) acc += u[i].x ^ u[i].w;
    __syncthreads();  // the stage read: refill it
    if (tid < 32 && st + S < stages) issue(st + S);
  }
  if (acc == 0x12345678u) out[blockIdx.x] = float(acc);
  stamp_block(t, t0);
}

// kAsync: the same rows by cp.async (16 bytes a thread, no registers held) into a thread's own
// slots of S stages of U units, S - 1 stages in flight while the thread reads one: a rolling
// pipeline, as decode attention's loop could keep its K/V tiles.
template <int S, int U>
__global__ void __launch_bounds__(kThreads) async_rows_kernel(const uint4* __restrict__ src, int64_t rows,
                                                              int per_head, unsigned long long* t, float* out) {
  extern __shared__ __align__(128) uint8_t ring[];
  const unsigned long long t0 = kernel_bench::globaltimer_ns();
  const int head = int(blockIdx.x) / per_head, split = int(blockIdx.x) % per_head;
  const int64_t per = (rows + per_head - 1) / per_head, r0 = split * per, r1 = ::min(rows, r0 + per);
  constexpr int kUnits = kRowBytes / 16;
  const int64_t n = (r1 - r0) * kUnits;
  const int tid = threadIdx.x;
  uint4* slots = reinterpret_cast<uint4*>(ring);  // [S][U][kThreads]
  const int64_t batches = (n + int64_t(U) * kThreads - 1) / (int64_t(U) * kThreads);
  auto issue = [&](int64_t b) {
    if (b < batches) {
      const int slot = int(b % S);
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int64_t i = (b * U + j) * kThreads + tid;
        if (i < n) {
          const uint4* g = src + ((r0 + i / kUnits) * kHeads + head) * kUnits + i % kUnits;
          const uint32_t d = nibble::kernels::shared_address(&slots[(slot * U + j) * kThreads + tid]);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(g) : "memory");
        }
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int b = 0; b < S - 1; ++b) issue(b);
  uint32_t acc = 0;
  for (int64_t b = 0; b < batches; ++b) {
    issue(b + S - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
    const int slot = int(b % S);
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const uint4 u = slots[(slot * U + j) * kThreads + tid];
      acc += u.x ^ u.y ^ u.z ^ u.w;
    }
  }
  __syncthreads();
  if (acc == 0x12345678u) out[blockIdx.x] = float(acc);
  stamp_block(t, t0);
}

struct Timing {
  double us;   // median of the launches: the last block's end minus the first block's start
  size_t sms;  // distinct SMs that held the blocks
  int fit;     // clusters of this size resident at once (0 without clusters)
};

// Times kernel(copy, count, per_head, ...) on `blocks` of kThreads (clusters of `cluster` when more
// than 1, `smem` bytes of dynamic shared memory), the copies taken in turn: 4 launches of warm-up,
// then 40.
template <typename Kernel>
Timing time_grid(Kernel kernel, int blocks, unsigned cluster, size_t smem, const uint4* const* copies, int n_copies,
                 int64_t count, int per_head, unsigned long long* d_t, float* d_out) {
  if (cluster > 8) BENCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  if (smem > 48 * 1024) BENCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim = {cluster, 1, 1};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.attrs = cluster > 1 ? &attr : nullptr;
  config.numAttrs = cluster > 1 ? 1 : 0;
  Timing r{0., 0, 0};
  if (cluster > 1) {
    cudaLaunchConfig_t probe = config;
    probe.gridDim = dim3(cluster);
    if (cudaOccupancyMaxActiveClusters(&r.fit, kernel, &probe) != cudaSuccess) r.fit = 0;
    cudaGetLastError();
  }
  std::vector<double> us;
  std::vector<unsigned long long> h(size_t(3 * blocks));
  std::set<unsigned> sms;
  for (int rep = 0; rep < 44; ++rep) {
    BENCH_CHECK(cudaLaunchKernelEx(&config, kernel, copies[rep % n_copies], count, per_head, d_t, d_out));
    BENCH_CHECK(cudaMemcpy(h.data(), d_t, h.size() * 8, cudaMemcpyDeviceToHost));
    if (rep < 4) continue;
    unsigned long long first = ~0ull, last = 0;
    for (int b = 0; b < blocks; ++b) {
      first = std::min(first, h[3 * b]);
      last = std::max(last, h[3 * b + 1]);
      sms.insert(unsigned(h[3 * b + 2]));
    }
    us.push_back(double(last - first) / 1e3);
  }
  r.us = kernel_bench::median(us);
  r.sms = sms.size();
  return r;
}

// Attention's rows (kHeads heads, blocks / kHeads splits a head); prints a row.
template <typename Kernel>
void time_rows(const char* name, Kernel kernel, size_t smem, const uint4* const* copies, int n_copies, int64_t rows,
               int blocks, unsigned cluster, unsigned long long* d_t, float* d_out) {
  const Timing r = time_grid(kernel, blocks, cluster, smem, copies, n_copies, rows, blocks / kHeads, d_t, d_out);
  std::printf("%-16s blocks %3d cluster %2u  %7.2f us  %7.1f GB/s  %3zu SMs\n", name, blocks, cluster, r.us,
              double(rows * kHeads * kRowBytes) / r.us / 1e3, r.sms);
}

// Contiguous bytes, D loads a thread in flight; prints a row.
template <int D>
void run_shape(const char* source, const uint4* const* copies, int n_copies, int64_t units, int blocks,
               unsigned cluster, unsigned long long* d_t, float* d_out) {
  const int64_t per = units / blocks;
  const Timing r = time_grid(stream_kernel<D>, blocks, cluster, 0, copies, n_copies, per, 0, d_t, d_out);
  std::printf("%-5s D=%2d blocks %3d cluster %2u (%3d clusters, %2d fit)  %7.2f us  %7.1f GB/s  %3zu SMs\n", source, D,
              blocks, cluster, cluster > 1 ? blocks / int(cluster) : 0, r.fit, r.us,
              double(per * blocks * 16) / r.us / 1e3, r.sms);
}

}  // namespace

int main(int argc, char** argv) {
  const double mb = argc > 1 ? std::atof(argv[1]) : 16.8;
  const int64_t units = int64_t(mb * 1e6 / 16) / 147840 * 147840;  // divisible by every grid below (2^7 3 5 7 11)
  const int64_t bytes = units * 16;
  const int n_copies = kernel_bench::copies_past_l2(bytes);
  std::vector<uint4*> copies(static_cast<size_t>(n_copies), nullptr);
  for (auto& c : copies) {
    BENCH_CHECK(cudaMalloc(&c, size_t(bytes)));
    kernel_bench::fill_bytes_kernel<<<1024, 256>>>(reinterpret_cast<uint8_t*>(c), bytes, 7, 0, 256);
  }
  unsigned long long* d_t = nullptr;
  float* d_out = nullptr;
  BENCH_CHECK(cudaMalloc(&d_t, 3 * 1024 * 8));
  BENCH_CHECK(cudaMalloc(&d_out, 1024 * 4));
  BENCH_CHECK(cudaDeviceSynchronize());
  int sm_count = 0;
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0);
  std::printf("%.1f MB a launch, %d SMs, %d copies past L2\n", double(bytes) / 1e6, sm_count, n_copies);
  struct Shape {
    int blocks;
    unsigned cluster;
  };
  const Shape shapes[] = {{32, 1}, {64, 1}, {96, 1}, {112, 1}, {128, 1}, {132, 1}, {264, 1}, {32, 8},  {64, 8},
                          {96, 8}, {120, 8}, {64, 16}, {112, 16}, {64, 4}, {128, 4}, {64, 2}, {128, 2}};
  for (const bool dram : {true, false}) {
    const char* source = dram ? "DRAM" : "L2";
    const int n = dram ? n_copies : 1;
    for (const Shape& s : shapes) {
      run_shape<4>(source, copies.data(), n, units, s.blocks, s.cluster, d_t, d_out);
      run_shape<16>(source, copies.data(), n, units, s.blocks, s.cluster, d_t, d_out);
    }
  }
  // The attention's pattern: rows of 256 bytes, 4 heads, (blocks / 4) splits a head.
  const int64_t rows = bytes / (kHeads * kRowBytes);
  std::printf("\nrows: %lld positions x %d heads x %d bytes\n", (long long)rows, kHeads, kRowBytes);
  struct RowShape {
    int blocks;
    unsigned cluster;
  };
  const RowShape row_shapes[] = {{64, 16}, {128, 4}, {132, 1}, {264, 1}};
  for (const bool dram : {true, false}) {
    const int n = dram ? n_copies : 1;
    for (const RowShape& s : row_shapes) {
      char name[32];
      std::snprintf(name, sizeof name, "%s ld D=8", dram ? "DRAM" : "L2");
      time_rows(name, rows_kernel<8>, 0, copies.data(), n, rows, s.blocks, s.cluster, d_t, d_out);
      std::snprintf(name, sizeof name, "%s ld D=16", dram ? "DRAM" : "L2");
      time_rows(name, rows_kernel<16>, 0, copies.data(), n, rows, s.blocks, s.cluster, d_t, d_out);
      std::snprintf(name, sizeof name, "%s async 3x8", dram ? "DRAM" : "L2");
      time_rows(name, async_rows_kernel<3, 8>, size_t(3) * 8 * 16 * kThreads, copies.data(), n, rows, s.blocks,
                s.cluster, d_t, d_out);
      std::snprintf(name, sizeof name, "%s async 3x16", dram ? "DRAM" : "L2");
      time_rows(name, async_rows_kernel<3, 16>, size_t(3) * 16 * 16 * kThreads, copies.data(), n, rows, s.blocks,
                s.cluster, d_t, d_out);
      std::snprintf(name, sizeof name, "%s async 6x8", dram ? "DRAM" : "L2");
      time_rows(name, async_rows_kernel<6, 8>, size_t(6) * 8 * 16 * kThreads, copies.data(), n, rows, s.blocks,
                s.cluster, d_t, d_out);
      std::snprintf(name, sizeof name, "%s async 2x8", dram ? "DRAM" : "L2");
      time_rows(name, async_rows_kernel<2, 8>, size_t(2) * 8 * 16 * kThreads, copies.data(), n, rows, s.blocks,
                s.cluster, d_t, d_out);
      if (s.blocks > 200) continue;  // two bulk-copy blocks do not fit an SM
      std::snprintf(name, sizeof name, "%s bulk 64K", dram ? "DRAM" : "L2");
      time_rows(name, bulk_rows_kernel<4>, size_t(4) * kStageRows * kRowBytes, copies.data(), n, rows, s.blocks,
                s.cluster, d_t, d_out);
    }
  }
  return 0;
}
