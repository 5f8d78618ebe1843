// Microbenchmark of the INT4 decode GEMV at one token on a long matrix (a 4-bit lm_head: Qwen3's
// 151,936 x 2048, group 128), on weights that are not in L2: the strided kernel
// (kernels::gemv_int4_mma_strided_kernel) at 2, 4 and 8 warps a block, the one-pass kernel, and a
// plain read of the codes. (The shapes with 2 or 4 warps a tile it measured, BENCHMARKS.md, are
// in 7a5fe23's tree.) Not a test, not a benchmark of record: a tool for telling a load limit from
// an issue limit. The CUDA build makes build/cuda/gemv_int4_bench; on the GPU:
//   gemv_int4_bench [n k]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "bench_common.cuh"
#include "kernels/gemv_mma.cuh"

using namespace nibble::kernels;
using kernel_bench::time_launches;

constexpr int CPG = 4, kWarps = 4;  // group 128; the head's shape (ops.cu)

__global__ void fill_scales_kernel(__half* s, int64_t count) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    s[i] = __float2half(0.01f + 0.0001f * float(i % 97));
}

int main(int argc, char** argv) {
  const int64_t n = argc > 2 ? atoll(argv[1]) : 151936, k = argc > 2 ? atoll(argv[2]) : 2048;
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t groups = k / 128, code_bytes = n * k / 2, bytes = code_bytes + n * groups * 3;
  const int copies = kernel_bench::copies_past_l2(bytes);
  std::vector<Int4Weight> w(copies);
  for (auto& m : w) {
    uint8_t *codes, *zeros;
    __half* scales;
    BENCH_CHECK(cudaMalloc(&codes, code_bytes));
    BENCH_CHECK(cudaMalloc(&zeros, n * groups));
    BENCH_CHECK(cudaMalloc(&scales, n * groups * 2));
    kernel_bench::fill_bytes_kernel<<<1024, 256>>>(codes, code_bytes, 7, 0, 256);
    kernel_bench::fill_bytes_kernel<<<1024, 256>>>(zeros, n * groups, 9, 0, 16);
    fill_scales_kernel<<<1024, 256>>>(scales, n * groups);
    m = Int4Weight{codes, scales, zeros, 7, groups};
  }
  float *x = kernel_bench::device_floats(k, 0.5f), *nw = kernel_bench::device_floats(k, 0.5f);
  float* y = kernel_bench::device_floats(n, 0.f);
  const size_t smem = size_t(mma_x_bytes(1, k));
  const int64_t tiles = (n + 15) / 16;
  auto time = [&](const char* name, auto&& launch) {
    time_launches(name, double(bytes), copies, 20, [&](int i) { launch(w[i % copies]); });
  };
  time("stream read (132 x 8 blocks of 256)", [&](const Int4Weight& m) {
    kernel_bench::stream_read_kernel<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(m.codes), code_bytes / 16, y);
  });
  const GemvIo io{nw, 1e-6f, false};
  auto strided = [&](auto kernel, int warps, const char* name) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * warps, smem);
    const int64_t blocks = std::min<int64_t>((tiles + warps - 1) / warps, int64_t(per_sm) * sms);
    char label[128];
    std::snprintf(label, sizeof label, "%s (%d/SM)", name, per_sm);
    time(label, [&](const Int4Weight& m) { kernel<<<unsigned(blocks), 32 * warps, smem>>>(m, nullptr, x, y, n, k, io); });
  };
  strided(gemv_int4_mma_strided_kernel<CPG, true, kWarps>, kWarps, "strided as shipped: 4 warps a block");
  strided(gemv_int4_mma_strided_kernel<CPG, false, kWarps>, kWarps, "the same without the norm");
  strided(gemv_int4_mma_strided_kernel<CPG, true, 2>, 2, "strided, 2 warps a block");
  strided(gemv_int4_mma_strided_kernel<CPG, true, 8>, 8, "strided, 8 warps a block");
  {
    // Two warps along K a tile, two tiles a block (the dispatch's shape at one token without the
    // strided kernel).
    const auto kernel = gemv_int4_mma_kernel<CPG, true, 2, 2>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    const unsigned blocks = unsigned((tiles + 1) / 2);
    time("one pass", [&](const Int4Weight& m) {
      kernel<<<blocks, 128, smem>>>(m, nullptr, x, y, 1, n, k, io, RouterFold{});
    });
  }
  return 0;
}
