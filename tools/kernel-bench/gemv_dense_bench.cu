// Microbenchmark of the decode GEMVs for dense BF16 weights (kernels/gemv_dense_mma.cuh against
// gemv.cuh's CUDA-core kernel and a plain streaming read of the same bytes), one shape at a time,
// on weights that are not in L2 (a ring of copies larger than it). Not a test, not a benchmark of
// record: a tool for choosing launch shapes. The CUDA build makes build/cuda/gemv_dense_bench
// (or: nvcc -std=c++20 -O3 -arch=sm_90a -Isrc tools/kernel-bench/gemv_dense_bench.cu); on the GPU:
//   gemv_dense_bench 5120 2880 1 [norm]     # n k m, with the fused RMS norm when a 4th argument
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "kernels/gemv_dense_mma.cuh"
#include "bench_common.cuh"

using namespace nibble::kernels;
using kernel_bench::time_launches;

__global__ void fill_kernel(__nv_bfloat16* w, int64_t count, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    w[i] = __float2bfloat16((float(h & 0xFFFF) / 65536.f - 0.5f) * 0.2f);
  }
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 5120, k = argc > 2 ? atoll(argv[2]) : 2880;
  const int m = argc > 3 ? atoi(argv[3]) : 1;
  const bool norm = argc > 4;
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t bytes = n * k * 2;
  const int copies = kernel_bench::copies_past_l2(bytes);
  std::vector<__nv_bfloat16*> w(copies);
  for (auto& p : w) {
    BENCH_CHECK(cudaMalloc(&p, bytes));
    fill_kernel<<<1024, 256>>>(p, n * k, 7);
  }
  float *x = kernel_bench::device_floats(m * k, 0.5f), *nw = kernel_bench::device_floats(k, 0.5f);
  float* y = kernel_bench::device_floats(m * n, 0.f);
  auto time = [&](const char* name, auto&& launch) {
    time_launches(name, double(bytes), copies, 20, [&](int i) { launch(w[i % copies]); });
  };
  const GemvIo io{norm ? nw : nullptr, 1e-6f, false};
  const size_t smem = size_t(dense_mma_x_bytes(m, k));
  const int64_t tiles = (n + 7) / 8;
  auto mma = [&](auto kernel, int ks, int ntb, const char* name) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * ks * ntb, smem);
    const int64_t blocks = std::min<int64_t>((tiles + ntb - 1) / ntb, int64_t(per_sm) * sms);
    char label[96];
    std::snprintf(label, sizeof label, "%s (%lld blocks, %d/SM)", name, (long long)blocks, per_sm);
    time(label, [&](const __nv_bfloat16* p) {
      kernel<<<unsigned(blocks), 32 * ks * ntb, smem>>>(p, nullptr, x, y, m, n, k, io);
    });
  };
  time("stream read (132 x 8 blocks of 256)", [&](const __nv_bfloat16* p) {
    kernel_bench::stream_read_kernel<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(p), bytes / 16, y);
  });
  time("stream read (132 x 4 blocks of 256)", [&](const __nv_bfloat16* p) {
    kernel_bench::stream_read_kernel<<<sms * 4, 256>>>(reinterpret_cast<const uint4*>(p), bytes / 16, y);
  });
  auto variants = [&](auto kNorm) {
    constexpr bool N = decltype(kNorm)::value;
    mma(gemv_bf16_mma_kernel<N, 2, 1, 8>, 2, 1, "mma KS2 U8");
    mma(gemv_bf16_mma_kernel<N, 4, 1, 8>, 4, 1, "mma KS4 U8");
    mma(gemv_bf16_mma_kernel<N, 8, 1, 8>, 8, 1, "mma KS8 U8");
    mma(gemv_bf16_mma_kernel<N, 4, 1, 4>, 4, 1, "mma KS4 U4");
    mma(gemv_bf16_mma_kernel<N, 8, 1, 4>, 8, 1, "mma KS8 U4");
    mma(gemv_bf16_mma_kernel<N, 4, 1, 16>, 4, 1, "mma KS4 U16");
    mma(gemv_bf16_mma_kernel<N, 2, 4, 8>, 2, 4, "mma KS2 NTB4 U8");
    mma(gemv_bf16_mma_kernel<N, 2, 1, 16>, 2, 1, "mma KS2 U16");
    mma(gemv_bf16_mma_kernel<N, 8, 1, 16>, 8, 1, "mma KS8 U16");
  };
  if (norm)
    variants(std::true_type{});
  else
    variants(std::false_type{});
  auto old = [&](auto kernel, int rows, const char* name) {
    const int64_t blocks = std::min<int64_t>((n + 4 * rows - 1) / (4 * rows), 8 * sms);
    time(name, [&](const __nv_bfloat16* p) { kernel<<<unsigned(blocks), 128>>>(p, nullptr, x, y, m, n, k, io); });
  };
  if (norm) {
    old(gemv_dense_kernel<DenseType::kBF16, 1, 2, true>, 2, "cuda-core R2 norm");
  } else {
    old(gemv_dense_kernel<DenseType::kBF16, 1, 1, false>, 1, "cuda-core R1");
    old(gemv_dense_kernel<DenseType::kBF16, 1, 2, false>, 2, "cuda-core R2");
    old(gemv_dense_kernel<DenseType::kBF16, 1, 4, false>, 4, "cuda-core R4");
  }
  return 0;
}
