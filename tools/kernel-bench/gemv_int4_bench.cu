// Microbenchmark of the INT4 decode GEMV at one token on a long matrix (a 4-bit lm_head: Qwen3's
// 151,936 x 2048, group 128), on weights that are not in L2: the strided kernel
// (kernels::gemv_int4_mma_strided_kernel) in several shapes, its loop without the barriers and
// sums (each warp's sums kept to the end: what they cost), the one-pass kernel, and a plain read
// of the codes. Not a test, not a benchmark of record: a tool for telling a load limit from
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

constexpr int CPG = 4, KS = 2, NTB = 2, SUB = 1;  // group 128; the head's shape (ops.cu)

__global__ void fill_scales_kernel(__half* s, int64_t count) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += int64_t(gridDim.x) * blockDim.x)
    s[i] = __float2half(0.01f + 0.0001f * float(i % 97));
}

// The strided kernel's loop without the barriers, the sums and the stores (each warp's sums kept
// to the end): what they cost.
__global__ void __launch_bounds__(32 * KS * NTB, kInt4StridedMinBlocks)
    strided_no_sums_kernel(Int4Weight w, const float* __restrict__ x, float* __restrict__ y, int64_t n, int64_t k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int nt = warp / KS, kw = warp % KS;
  const int64_t tiles = (n + 15) / 16, stride = int64_t(gridDim.x) * NTB;
  int64_t base = int64_t(blockIdx.x) * NTB;
  MmaTile<CPG, KS, true, SUB> tile;
  tile.start(w, (base + nt) * 16, n, k, kw);
  XRows<1, false> xr{x, k, 1, nullptr, {}};
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  mma_stage_x_normed(xr, int(k), 1e-6f, xs, int(mma_x_stride(k)));
  __syncthreads();
  const uint2* xb = mma_x_units(xs, k, 1);
  float acc[kMmaChains][4] = {};
  for (; base < tiles; base += stride) {
    tile.finish(w, xb, acc);
    if (base + stride < tiles) tile.start(w, (base + stride + nt) * 16, n, k, kw);
  }
  const float4 d = mma_chains_sum(acc);
  if (d.x == 1234.5f) y[blockIdx.x * 16 + g] = d.x + float(t);
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
  auto grid = [&](auto kernel, int threads) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
    return std::min<int64_t>((tiles + NTB - 1) / NTB, int64_t(per_sm) * sms);
  };
  time("stream read (132 x 8 blocks of 256)", [&](const Int4Weight& m) {
    kernel_bench::stream_read_kernel<<<sms * 8, 256>>>(reinterpret_cast<const uint4*>(m.codes), code_bytes / 16, y);
  });
  const GemvIo io{nw, 1e-6f, false};
  constexpr int threads = 32 * KS * NTB;
  auto shape = [&](auto kernel, int ks, int ntb, const char* name) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * ks * ntb, smem);
    const int64_t blocks = std::min<int64_t>((tiles + ntb - 1) / ntb, int64_t(per_sm) * sms);
    char label[128];
    std::snprintf(label, sizeof label, "%s (%d/SM)", name, per_sm);
    time(label, [&](const Int4Weight& m) { kernel<<<unsigned(blocks), 32 * ks * ntb, smem>>>(m, nullptr, x, y, n, k, io); });
  };
  shape(gemv_int4_mma_strided_kernel<CPG, true, 2, 2, 1>, 2, 2, "strided as shipped: KS2 NTB2 SUB1");
  shape(gemv_int4_mma_strided_kernel<CPG, false, 2, 2, 1>, 2, 2, "the same without the norm");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 4, 2, 2>, 4, 2, "strided KS4 NTB2 SUB2");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 4, 1, 2>, 4, 1, "strided KS4 NTB1 SUB2");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 8, 1, 4>, 8, 1, "strided KS8 NTB1 SUB4");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 2, 1, 1>, 2, 1, "strided KS2 NTB1 SUB1");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 2, 3, 1>, 2, 3, "strided KS2 NTB3 SUB1");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 1, 4, 1>, 1, 4, "strided KS1 NTB4 SUB1");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 1, 2, 1>, 1, 2, "strided KS1 NTB2 SUB1");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 1, 8, 1>, 1, 8, "strided KS1 NTB8 SUB1");
  shape(gemv_int4_mma_strided_kernel<CPG, true, 2, 2, 2>, 2, 2, "strided KS2 NTB2 SUB2 (a tile's half over 2 warps)");
  {
    const auto kernel = strided_no_sums_kernel;
    const int64_t blocks = grid(kernel, threads);
    time("strided as shipped, no barriers nor sums", [&](const Int4Weight& m) {
      kernel<<<unsigned(blocks), threads, smem>>>(m, x, y, n, k);
    });
  }
  {
    const auto kernel = gemv_int4_mma_kernel<CPG, true, KS, NTB, false, SUB>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    const int64_t blocks = (tiles + NTB - 1) / NTB;
    time("one pass (4,748 blocks)", [&](const Int4Weight& m) {
      kernel<<<unsigned(blocks), threads, smem>>>(m, nullptr, x, y, 1, n, k, io, RouterFold{});
    });
  }
  return 0;
}
