// Microbenchmark of the MXFP4 decode GEMV (kernels/gemv_mxfp4.cuh: gpt-oss's q/k/v, o and lm_head
// when quantized at load) over its launch shapes, on weights that are not in L2 (a ring of copies
// larger than it). Not a test, not a benchmark of record: a tool for choosing launch shapes. The
// CUDA build makes build/cuda/gemv_mxfp4_bench; on the GPU:
//   gemv_mxfp4_bench 5120 2880 1 [norm]     # n k m, with the fused RMS norm when a 4th argument
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/gemv_mxfp4.cuh"

using namespace nibble::kernels;

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

__global__ void fill_bytes_kernel(uint8_t* p, int64_t count, uint32_t seed, uint32_t lo, uint32_t span) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    p[i] = uint8_t(lo + (h >> 8) % span);
  }
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 5120, k = argc > 2 ? atoll(argv[2]) : 2880;
  const int m = argc > 3 ? atoi(argv[3]) : 1;
  const bool norm = argc > 4;
  const int64_t code_bytes = n * k / 2, scale_bytes = n * mxfp4_scale_stride(k), bytes = code_bytes + scale_bytes;
  const int copies = int(160'000'000 / bytes) + 2;
  std::vector<Mxfp4Weight> w(copies);
  for (int c = 0; c < copies; ++c) {
    uint8_t *codes, *scales;
    CHECK(cudaMalloc(&codes, code_bytes));
    CHECK(cudaMalloc(&scales, scale_bytes));
    fill_bytes_kernel<<<512, 256>>>(codes, code_bytes, 3 * c, 0, 256);
    fill_bytes_kernel<<<64, 256>>>(scales, scale_bytes, 3 * c + 1, 110, 20);
    w[c] = {codes, scales};
  }
  float *x, *y, *nw;
  CHECK(cudaMalloc(&x, m * k * 4));
  CHECK(cudaMalloc(&nw, k * 4));
  CHECK(cudaMalloc(&y, m * n * 4));
  std::vector<float> hx(m * k, 0.5f);
  CHECK(cudaMemcpy(x, hx.data(), m * k * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(nw, hx.data(), k * 4, cudaMemcpyHostToDevice));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto time = [&](const char* name, auto&& launch) {
    for (int i = 0; i < 3 * copies; ++i) launch(w[i % copies]);
    CHECK(cudaDeviceSynchronize());
    const int reps = 20 * copies;
    cudaEventRecord(a);
    for (int i = 0; i < reps; ++i) launch(w[i % copies]);
    cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b));
    CHECK(cudaGetLastError());
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    const double us = 1000.0 * ms / reps;
    std::printf("%-44s %8.2f us %7.0f GB/s\n", name, us, bytes / us / 1e3);
  };
  const GemvIo io{norm ? nw : nullptr, 1e-6f, false};
  const size_t smem = size_t(mxfp4_x_bytes(m, k));
  auto run = [&](auto kernel, int ks, int ntb, const char* name) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * ks * ntb, smem);
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const unsigned blocks = unsigned(std::min<int64_t>(((n + 15) / 16 + ntb - 1) / ntb, int64_t(per_sm) * sms));
    char label[96];
    std::snprintf(label, sizeof label, "%s (%u blocks, %d/SM)", name, blocks, per_sm);
    time(label, [&](const Mxfp4Weight& wt) { kernel<<<blocks, 32 * ks * ntb, smem>>>(wt, nullptr, x, y, m, n, k, io); });
  };
  auto variants = [&](auto kNorm) {
    constexpr bool N = decltype(kNorm)::value;
    run(gemv_mxfp4_mma_kernel<N, 8, 1, false>, 8, 1, "KS8 NTB1");
    run(gemv_mxfp4_mma_kernel<N, 4, 2, false>, 4, 2, "KS4 NTB2");
    run(gemv_mxfp4_mma_kernel<N, 2, 4, false>, 2, 4, "KS2 NTB4");
    run(gemv_mxfp4_mma_kernel<N, 1, 8, false>, 1, 8, "KS1 NTB8");
    run(gemv_mxfp4_mma_kernel<N, 4, 1, false>, 4, 1, "KS4 NTB1");
    run(gemv_mxfp4_mma_kernel<N, 2, 2, false>, 2, 2, "KS2 NTB2");
    run(gemv_mxfp4_mma_kernel<N, 2, 1, false>, 2, 1, "KS2 NTB1");
    run(gemv_mxfp4_mma_kernel<N, 8, 1, true>, 8, 1, "KS8 NTB1 double B2");
    run(gemv_mxfp4_mma_kernel<N, 4, 1, true>, 4, 1, "KS4 NTB1 double B2");
    run(gemv_mxfp4_mma_kernel<N, 2, 4, true>, 2, 4, "KS2 NTB4 double B2");
  };
  if (norm)
    variants(std::true_type{});
  else
    variants(std::false_type{});
  return 0;
}
