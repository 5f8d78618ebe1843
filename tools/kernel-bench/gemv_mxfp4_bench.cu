// Microbenchmark of the MXFP4 decode GEMV (kernels/gemv_mxfp4.cuh: gpt-oss's q/k/v, o and lm_head
// when quantized at load) over its launch shapes, on weights that are not in L2 (a ring of copies
// larger than it). Not a test, not a benchmark of record: a tool for choosing launch shapes. The
// CUDA build makes build/cuda/gemv_mxfp4_bench; on the GPU:
//   gemv_mxfp4_bench 5120 2880 1 [norm]     # n k m, with the fused RMS norm when a 4th argument
// With m = 1, n % 16 == 0 and k % 32 == 0 it also times the streamed kernel (kernels/mxfp4_stream.cuh)
// at several consumer-warp and stage counts.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/gemv_mxfp4.cuh"
#include "kernels/mxfp4_stream.cuh"
#include "bench_common.cuh"

using namespace nibble::kernels;
using kernel_bench::fill_bytes_kernel;
using kernel_bench::time_launches;

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 5120, k = argc > 2 ? atoll(argv[2]) : 2880;
  const int m = argc > 3 ? atoi(argv[3]) : 1;
  const bool norm = argc > 4;
  const int64_t code_bytes = n * k / 2, scale_bytes = n * mxfp4_scale_stride(k), bytes = code_bytes + scale_bytes;
  const int copies = kernel_bench::copies_past_l2(bytes);
  std::vector<Mxfp4Weight> w(copies);
  for (int c = 0; c < copies; ++c) {
    uint8_t *codes, *scales;
    BENCH_CHECK(cudaMalloc(&codes, code_bytes));
    BENCH_CHECK(cudaMalloc(&scales, scale_bytes));
    fill_bytes_kernel<<<512, 256>>>(codes, code_bytes, 3 * c, 0, 256);
    fill_bytes_kernel<<<64, 256>>>(scales, scale_bytes, 3 * c + 1, 110, 20);
    w[c] = {codes, scales};
  }
  float *x = kernel_bench::device_floats(m * k, 0.5f), *nw = kernel_bench::device_floats(k, 0.5f);
  float* y = kernel_bench::device_floats(m * n, 0.f);
  auto time = [&](const char* name, auto&& launch) {
    time_launches(name, double(bytes), copies, 20, [&](int i) { launch(w[i % copies]); });
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
    time(label, [&](const Mxfp4Weight& wt) { kernel<<<blocks, 32 * ks * ntb, smem>>>(wt, nullptr, x, y, m, n, k, io, RouterFold{}); });
  };
  auto variants = [&](auto kNorm) {
    constexpr bool N = decltype(kNorm)::value;
    run(gemv_mxfp4_mma_kernel<N, 8, 1, false>, 8, 1, "KS8 NTB1");
    run(gemv_mxfp4_mma_kernel<N, 4, 2, false>, 4, 2, "KS4 NTB2");
    run(gemv_mxfp4_mma_kernel<N, 2, 4, false>, 2, 4, "KS2 NTB4");
    run(gemv_mxfp4_mma_kernel<N, 1, 8, false>, 1, 8, "KS1 NTB8");
    run(gemv_mxfp4_mma_kernel<N, 4, 1, false>, 4, 1, "KS4 NTB1");
    run(gemv_mxfp4_mma_kernel<N, 4, 1, false, 6>, 4, 1, "KS4 NTB1 B6");
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
  if (m != 1 || n % 16 != 0 || k % 32 != 0) return 0;
  auto stream = [&](auto kernel, int warps, int stages) {
    const size_t ssmem = size_t(mxfp4_stream_smem(k, stages, warps, mxfp4_x_bytes(1, k)));
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ssmem)) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    int per_sm = 0, sms = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * (warps + 1), ssmem);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    if (per_sm == 0) return;
    const unsigned blocks = unsigned(std::min<int64_t>(n / 16, int64_t(per_sm) * sms));
    char label[96];
    std::snprintf(label, sizeof label, "stream W%d stages %d (%u blocks, %d/SM)", warps, stages, blocks, per_sm);
    time(label, [&](const Mxfp4Weight& wt) {
      kernel<<<blocks, 32 * (warps + 1), ssmem>>>(wt, nullptr, x, y, n, k, io, stages, GreedyPick{}, nullptr);
    });
  };
  auto streams = [&](auto kNorm) {
    constexpr bool N = decltype(kNorm)::value;
    for (int stages : {2, 3, 4}) stream(gemv_mxfp4_stream_kernel<8, N>, 8, stages);
    for (int stages : {2, 3}) stream(gemv_mxfp4_stream_kernel<8, N, 3>, 8, stages);  // registers for 3 an SM
    for (int stages : {2, 3}) stream(gemv_mxfp4_stream_kernel<4, N>, 4, stages);
    for (int stages : {2, 3}) stream(gemv_mxfp4_stream_kernel<4, N, 5>, 4, stages);
    for (int stages : {2, 3}) stream(gemv_mxfp4_stream_kernel<12, N>, 12, stages);
    for (int stages : {2, 3}) stream(gemv_mxfp4_stream_kernel<16, N>, 16, stages);
    for (int stages : {1, 2}) stream(gemv_mxfp4_stream_kernel<8, N, 4>, 8, stages);
  };
  if (norm)
    streams(std::true_type{});
  else
    streams(std::false_type{});
  return 0;
}
