// What the kernel microbenchmarks (tools/kernel-bench/*.cu) share: the error check, a fill of
// random bytes on the device, the input rows, and the timing of one launch shape.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define BENCH_CHECK(x)                                                               \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace kernel_bench {

// p[i] = lo + a hash of (i, seed) mod span.
__global__ void fill_bytes_kernel(uint8_t* p, int64_t count, uint32_t seed, uint32_t lo, uint32_t span) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    p[i] = uint8_t(lo + (h >> 8) % span);
  }
}

// The bandwidth ceiling: each thread xors 16-byte units of its share of p (weights past L2).
__global__ void stream_read_kernel(const uint4* __restrict__ p, int64_t units, float* out) {
  uint32_t acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = 1.f;
}

// The device's nanosecond clock (%globaltimer), comparable across SMs, for in-kernel stamps.
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The median of v (reordered in place; v not empty).
template <typename T>
T median(std::vector<T>& v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Copies of a weight that together are more than L2 holds, so a launch reads from DRAM as in a
// decode step.
inline int copies_past_l2(int64_t bytes) { return int(160'000'000 / bytes) + 2; }

// A device array of n floats, all `value`.
inline float* device_floats(int64_t n, float value) {
  float* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, n * 4));
  std::vector<float> h(size_t(n), value);
  BENCH_CHECK(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice));
  return p;
}

// Times launch(i) for i = 0, 1, ... (the caller rotates weights or routings with i % rotations):
// a warm-up of 3 rotations, then reps_per_rotation rotations; prints µs per launch and GB/s of
// `bytes` a launch.
template <typename Launch>
void time_launches(const char* name, double bytes, int rotations, int reps_per_rotation, Launch&& launch) {
  for (int i = 0; i < 3 * rotations; ++i) launch(i);
  BENCH_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const int reps = reps_per_rotation * rotations;
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) launch(i);
  cudaEventRecord(b);
  BENCH_CHECK(cudaEventSynchronize(b));
  BENCH_CHECK(cudaGetLastError());
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  const double us = 1000.0 * ms / reps;
  std::printf("%-44s %8.2f us %7.0f GB/s\n", name, us, bytes / us / 1e3);
}

}  // namespace kernel_bench
