// Does instruction fetch cost a decode kernel microseconds while the weights stream? (BENCHMARKS.md:
// every piece of once-per-block code added to a layer's critical path cost far more than its
// instructions.) One warp a block runs N instructions of straight-line code (independent FMAs, so
// issue-bound at ~1 a cycle when its code is cached) twice in a row over the same addresses:
// the first pass fetches the code, the second finds it cached. Before each timed launch an
// evictor kernel with 256 KB of other code runs on the same SMs, so the first pass starts as a
// decode kernel does, its code in L2 (or DRAM) but not on the SM. Timed alone, then while a
// streaming kernel on another stream keeps DRAM busy on the other SMs (as a weight burst does).
// Prints the median block's µs for each pass and N. Run by hand on the GPU:
//   build/cuda90/ifetch_bench
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench_common.cuh"

namespace {

// N FMAs in 8 independent chains, straight-line, run twice; t[3 a block]: start, after pass 1, after pass 2.
template <int N>
__global__ void __launch_bounds__(32) straight_kernel(float* out, unsigned long long* t) {
  float x[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) x[c] = float(threadIdx.x + c);
  const float a = 1.0001f, b = 0.5f;
  unsigned long long stamp[3];
  stamp[0] = kernel_bench::globaltimer_ns();
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(x[i % 8]) : "f"(a), "f"(b));
    stamp[pass + 1] = kernel_bench::globaltimer_ns();
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) s += x[c];
  out[blockIdx.x * 32 + threadIdx.x] = s;
  if (threadIdx.x == 0)
    for (int i = 0; i < 3; ++i) t[blockIdx.x * 3 + i] = stamp[i];
}

// Other code to push the timed kernel's out of the SMs' instruction caches (256 KB of FMAs).
__global__ void __launch_bounds__(32) evict_kernel(float* out) {
  float x[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) x[c] = float(threadIdx.x + c);
#pragma unroll
  for (int i = 0; i < 16384; ++i) asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(x[i % 8]));
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) s += x[c];
  out[blockIdx.x * 32 + threadIdx.x] = s;
}

// Reads `bytes` from src (evict-first, into registers) `rounds` times: DRAM busy for as long as it runs.
__global__ void __launch_bounds__(1024) stream_kernel(const uint4* __restrict__ src, int64_t units, int rounds,
                                                      float* out) {
  extern __shared__ uint8_t hold[];  // only to keep one block an SM
  uint32_t acc = 0;
  for (int r = 0; r < rounds; ++r)
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < units; i += int64_t(gridDim.x) * blockDim.x) {
      const uint4 v = __ldcs(src + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  if (acc == 0x12345678u) out[0] = float(hold[0]);
}

template <int N>
void measure(const char* label, int blocks, cudaStream_t s, float* out, unsigned long long* t) {
  std::vector<double> first, second;
  std::vector<unsigned long long> h(size_t(blocks) * 3);
  for (int trial = 0; trial < 20; ++trial) {
    evict_kernel<<<blocks, 32, 0, s>>>(out);
    straight_kernel<N><<<blocks, 32, 0, s>>>(out, t);
    BENCH_CHECK(cudaMemcpyAsync(h.data(), t, h.size() * 8, cudaMemcpyDeviceToHost, s));
    BENCH_CHECK(cudaStreamSynchronize(s));
    for (int b = 0; b < blocks; ++b) {
      first.push_back(double(h[b * 3 + 1] - h[b * 3]) / 1e3);
      second.push_back(double(h[b * 3 + 2] - h[b * 3 + 1]) / 1e3);
    }
  }
  const double a = kernel_bench::median(first), b = kernel_bench::median(second);
  std::printf("| %s | %d | %d KB | %.2f | %.2f | %.2f |\n", label, N, N * 16 / 1024, a, b, a - b);
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, timed_blocks = 16, stream_blocks = sms - timed_blocks;
  float* out = nullptr;
  unsigned long long* t = nullptr;
  BENCH_CHECK(cudaMalloc(&out, size_t(sms) * 1024 * 4));
  BENCH_CHECK(cudaMalloc(&t, size_t(sms) * 3 * 8));
  const int64_t bytes = int64_t(2) << 30;  // 2 GB: far past L2
  uint4* src = nullptr;
  BENCH_CHECK(cudaMalloc(&src, bytes));
  BENCH_CHECK(cudaMemset(src, 1, bytes));
  const int smem = int(prop.sharedMemPerMultiprocessor / 2 + 1024);  // one streaming block an SM
  BENCH_CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaStream_t a, b;
  BENCH_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  BENCH_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  std::printf("%s, %d SMs: %d timed blocks of one warp; the stream on %d SMs\n\n", prop.name, sms, timed_blocks,
              stream_blocks);
  std::printf("| DRAM | FMAs | code | first pass µs | second pass µs | fetch µs |\n|---|---:|---:|---:|---:|---:|\n");
  auto all = [&](const char* label) {
    measure<256>(label, timed_blocks, b, out, t);
    measure<1024>(label, timed_blocks, b, out, t);
    measure<4096>(label, timed_blocks, b, out, t);
  };
  all("idle");
  // The stream runs for the whole loaded measurement (its rounds sized generously), then is waited for.
  cudaEvent_t e0, e1;
  BENCH_CHECK(cudaEventCreate(&e0));
  BENCH_CHECK(cudaEventCreate(&e1));
  BENCH_CHECK(cudaEventRecord(e0, a));
  stream_kernel<<<stream_blocks, 1024, smem, a>>>(src, bytes / 16, 40, out);
  BENCH_CHECK(cudaEventRecord(e1, a));
  all("streaming");
  const cudaError_t running = cudaEventQuery(e1);
  BENCH_CHECK(cudaEventSynchronize(e1));
  float ms = 0.f;
  BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  std::printf("\nstream: %.1f GB/s over %.1f ms (%s when the loaded measurements ended)\n",
              double(bytes) * 40 / (ms * 1e-3) / 1e9, ms, running == cudaErrorNotReady ? "still running" : "DONE");
  return 0;
}
