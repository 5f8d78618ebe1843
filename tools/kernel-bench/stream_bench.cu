// How fast weights stream from DRAM into shared memory through bulk copies (cp.async.bulk, the
// TMA) into a ring of stages, as the streamed MXFP4 MoE kernels read them
// (kernels/mxfp4_stream.cuh), against plain register loads of the same bytes. The question
// behind it: those kernels stream at ~1.8 TB/s of 3.0 while their consumer warps wait for stages
// (BENCHMARKS.md), so is it the copies (bytes in flight, copies a tile) or the consumers' time on
// a stage? Here the consumers only read the stage and do `work` rounds of dummy arithmetic a
// 16-byte unit, so the two can be told apart.
//
// Each launch streams one layer's expert bytes (by default gpt-oss-20b's gate/up: 4 experts x 5760
// rows x 1440 bytes + scales, as 24 KB tiles; other shapes from the command line), rotating over
// copies that together exceed L2, so every launch reads DRAM. Prints µs a launch and GB/s for each shape: blocks an SM x stages x bulk copies a tile x
// work, then the first tile issued ahead of the others (a gap, or until it lands), then the
// register-load reference. Run by hand on the GPU:
//   build/cuda/stream_bench [tiles tile_bytes]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_common.cuh"
#include "kernels/bulk_copy.cuh"

namespace {

using namespace nibble::kernels;

constexpr int kConsumers = 8;            // consumer warps a block, as the MoE kernels

// Blocks take tiles blockIdx.x, + gridDim.x, ...; warp kConsumers produces, the others consume.
// gap_ns > 0: the producer sleeps that long after its first tile's copies before the next ones;
// gap_ns < 0: it waits until its first tile has landed (does issuing every block's first tile
// ahead of the second ones shorten the ramp?).
__global__ void __launch_bounds__(32 * (kConsumers + 1)) stream_kernel(const uint8_t* src, int64_t tiles, int copies,
                                                                        int stages, int work, uint32_t* sink,
                                                                        int gap_ns, int tile_bytes) {
  extern __shared__ __align__(128) uint8_t smem[];
  auto* full = reinterpret_cast<uint64_t*>(smem + int64_t(stages) * tile_bytes);
  uint64_t* empty = full + stages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) mbarrier_init(&full[s], 1), mbarrier_init(&empty[s], kConsumers);
    fence_barrier_init();
  }
  __syncthreads();
  const int64_t mine = tiles > blockIdx.x ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  if (warp == kConsumers) {
    const uint64_t policy = l2_evict_first_policy();
    const int piece = tile_bytes / copies;
    for (int64_t j = 0; j < mine; ++j) {
      const int s = int(j % stages);
      if (j >= stages) mbarrier_wait(&empty[s], uint32_t((j / stages - 1) & 1));
      const uint8_t* tile = src + (blockIdx.x + j * gridDim.x) * int64_t(tile_bytes);
      if (lane == 0) mbarrier_arrive_expect(&full[s], uint32_t(tile_bytes));
      __syncwarp();
      for (int c = lane; c < copies; c += 32)
        bulk_load(smem + int64_t(s) * tile_bytes + c * piece, tile + c * piece, uint32_t(piece), &full[s], policy);
      if (j == 0 && gap_ns > 0) __nanosleep(unsigned(gap_ns));
      if (j == 0 && gap_ns < 0) mbarrier_wait(&full[0], 0u);
    }
    return;
  }
  uint32_t acc = 0;
  const int units = tile_bytes / 16;
  for (int64_t j = 0; j < mine; ++j) {
    const int s = int(j % stages);
    mbarrier_wait(&full[s], uint32_t((j / stages) & 1));
    const uint4* stage = reinterpret_cast<const uint4*>(smem + int64_t(s) * tile_bytes);
    for (int u = warp * 32 + lane; u < units; u += 32 * kConsumers) {
      const uint4 v = stage[u];
      uint32_t h = v.x ^ v.y ^ v.z ^ v.w;
      for (int i = 0; i < work; ++i) h = h * 2654435761u + (h >> 7);
      acc += h;
    }
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&empty[s]);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // never, but the compiler cannot know
}

// The reference: every thread loads 16-byte units straight into registers, 8 in flight.
__global__ void __launch_bounds__(256) register_kernel(const uint4* src, int64_t units, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t u = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = u + i * stride < units ? __ldcs(src + u + i * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  // [tiles tile_bytes]: default one gpt-oss-20b layer's gate/up, 1440 tiles of 24 KB (~ a 16-row
  // tile's 23 KB of codes and its scales); Qwen3-30B-A3B INT4's is 768 of 16896, its down 1024 of
  // 6400.
  const int64_t n_tiles = argc > 2 ? std::atoll(argv[1]) : 1440;
  const int tile_bytes = argc > 2 ? std::atoi(argv[2]) : 24 * 1024;
  if (n_tiles < 1 || tile_bytes < 256 || tile_bytes % 256 != 0) {
    std::fprintf(stderr, "stream_bench [tiles tile_bytes]: tile_bytes must be a positive multiple of 256\n");
    return 2;
  }
  const int64_t bytes = n_tiles * tile_bytes;
  int sms = 0, optin = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  BENCH_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  const int rotations = kernel_bench::copies_past_l2(bytes);
  uint8_t* buf = nullptr;
  BENCH_CHECK(cudaMalloc(&buf, bytes * rotations));
  kernel_bench::fill_bytes_kernel<<<1024, 256>>>(buf, bytes * rotations, 7u, 0u, 256u);
  uint32_t* sink = nullptr;
  BENCH_CHECK(cudaMalloc(&sink, 4));
  BENCH_CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  const int64_t tiles = bytes / tile_bytes;
  std::printf("%d SMs; %lld bytes a launch in %lld tiles of %d; %d copies past L2\n", sms, (long long)bytes,
              (long long)tiles, tile_bytes, rotations);
  for (int work : {0, 8, 24})
    for (int stages : {2, 3, 4, 6})
      for (int per_sm : {1, 2, 3, 4, 6})
        for (int copies : {1, 16}) {
          const size_t smem = size_t(stages) * tile_bytes + 16 * stages;
          int resident = 0;
          BENCH_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, stream_kernel, 32 * (kConsumers + 1),
                                                                    smem));
          if (int(smem) > optin || resident < per_sm) continue;
          char name[96];
          std::snprintf(name, sizeof name, "bulk: %d/SM x %d stages, %2d copies, work %2d", per_sm, stages, copies, work);
          kernel_bench::time_launches(name, double(bytes), rotations, 20, [&](int i) {
            stream_kernel<<<per_sm * sms, 32 * (kConsumers + 1), smem>>>(buf + (i % rotations) * bytes, tiles, copies,
                                                                           stages, work, sink, 0, tile_bytes);
          });
        }
  for (int work : {0, 24})
    for (int stages : {2, 3})
      for (int gap : {0, 250, 500, 1000, 2000, -1}) {
        const int per_sm = stages == 2 ? 3 : 2;
        const size_t smem = size_t(stages) * tile_bytes + 16 * stages;
        char name[96];
        std::snprintf(name, sizeof name, "bulk: %d/SM x %d stages, gap %5d ns, work %2d", per_sm, stages, gap, work);
        kernel_bench::time_launches(name, double(bytes), rotations, 20, [&](int i) {
          stream_kernel<<<per_sm * sms, 32 * (kConsumers + 1), smem>>>(buf + (i % rotations) * bytes, tiles, 16,
                                                                         stages, work, sink, gap, tile_bytes);
        });
      }
  for (int per_sm : {4, 8})
    kernel_bench::time_launches(per_sm == 4 ? "registers: 4 blocks/SM of 256" : "registers: 8 blocks/SM of 256",
                                double(bytes), rotations, 20, [&](int i) {
                                  register_kernel<<<per_sm * sms, 256>>>(
                                      reinterpret_cast<const uint4*>(buf + (i % rotations) * bytes), bytes / 16, sink);
                                });
  BENCH_CHECK(cudaFree(buf));
  BENCH_CHECK(cudaFree(sink));
  return 0;
}
