// Microbenchmark of gpt-oss's MXFP4 MoE decode kernels (kernels/moe_mxfp4.cuh) at batch 1: the
// gate/up and down launches over top_k experts drawn at random per launch from E (so the weights
// come from DRAM, as in a decode step), each launch shape timed alone. Not a test, not a benchmark
// of record: a tool for choosing launch shapes. The CUDA build makes build/cuda/moe_mxfp4_bench;
// on the GPU:
//   moe_mxfp4_bench [experts=32] [hidden=2880] [inter=2880] [top_k=4]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/moe_mxfp4.cuh"
#include "kernels/moe_mxfp4_stream.cuh"
#include "bench_common.cuh"

using namespace nibble::kernels;
using kernel_bench::fill_bytes_kernel;

Mxfp4Device make_matrix(int64_t n, int64_t k, uint32_t seed) {
  uint8_t *codes, *scales;
  float* bias;
  const int64_t code_bytes = n * k / 2, scale_bytes = n * mxfp4_scale_stride(k);
  BENCH_CHECK(cudaMalloc(&codes, code_bytes));
  BENCH_CHECK(cudaMalloc(&scales, scale_bytes));
  BENCH_CHECK(cudaMalloc(&bias, n * 4));
  BENCH_CHECK(cudaMemset(bias, 0, n * 4));
  fill_bytes_kernel<<<512, 256>>>(codes, code_bytes, seed, 0, 256);
  fill_bytes_kernel<<<64, 256>>>(scales, scale_bytes, seed + 1, 110, 20);  // biased E8M0, finite
  return {codes, scales, bias};
}

int main(int argc, char** argv) {
  const int64_t E = argc > 1 ? atoll(argv[1]) : 32, hidden = argc > 2 ? atoll(argv[2]) : 2880;
  const int64_t inter = argc > 3 ? atoll(argv[3]) : 2880, top_k = argc > 4 ? atoll(argv[4]) : 4;
  std::vector<Mxfp4Device> gu(E), dn(E);
  for (int64_t e = 0; e < E; ++e) gu[e] = make_matrix(2 * inter, hidden, 11 * e), dn[e] = make_matrix(hidden, inter, 13 * e + 5);
  Mxfp4Device *d_gu, *d_dn;
  BENCH_CHECK(cudaMalloc(&d_gu, E * sizeof(Mxfp4Device)));
  BENCH_CHECK(cudaMalloc(&d_dn, E * sizeof(Mxfp4Device)));
  BENCH_CHECK(cudaMemcpy(d_gu, gu.data(), E * sizeof(Mxfp4Device), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(d_dn, dn.data(), E * sizeof(Mxfp4Device), cudaMemcpyHostToDevice));
  const int sets = 64;
  std::vector<int32_t> ids(sets * top_k);
  std::vector<float> weights(sets * top_k, 1.f / float(top_k));
  std::mt19937 rng(42);
  for (int s = 0; s < sets; ++s)
    for (int64_t j = 0; j < top_k; ++j) {
      int32_t e;
      bool fresh;
      do {
        e = int32_t(rng() % E);
        fresh = true;
        for (int64_t i = 0; i < j; ++i) fresh = fresh && ids[s * top_k + i] != e;
      } while (!fresh);
      ids[s * top_k + j] = e;
    }
  int32_t* d_ids;
  float *d_w, *x, *out;
  __half* act;
  BENCH_CHECK(cudaMalloc(&d_ids, ids.size() * 4));
  BENCH_CHECK(cudaMalloc(&d_w, weights.size() * 4));
  BENCH_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(d_w, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMalloc(&x, hidden * 4));
  BENCH_CHECK(cudaMalloc(&out, hidden * 4));
  BENCH_CHECK(cudaMalloc(&act, top_k * inter * 2));
  std::vector<float> hx(hidden, 0.25f);
  BENCH_CHECK(cudaMemcpy(x, hx.data(), hidden * 4, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemset(act, 0, top_k * inter * 2));
  const double gu_bytes = double(top_k) * (2 * inter * hidden / 2 + 2 * inter * mxfp4_scale_stride(hidden));
  const double dn_bytes = double(top_k) * (hidden * inter / 2 + hidden * mxfp4_scale_stride(inter));
  auto time = [&](const char* name, double bytes, auto&& launch) {
    kernel_bench::time_launches(name, bytes, sets, 10, [&](int i) { launch(i % sets); });
  };
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("E=%lld hidden=%lld inter=%lld top_k=%lld, %d SMs; gate/up %.1f MB, down %.1f MB a launch\n", (long long)E,
              (long long)hidden, (long long)inter, (long long)top_k, sms, gu_bytes / 1e6, dn_bytes / 1e6);
  const size_t gu_smem = size_t(moe_mxfp4_gate_up_smem(hidden, E));
  auto gate_up = [&](auto kernel, int ks, int ntb, const char* name) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(gu_smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * ks * ntb, gu_smem);
    const dim3 grid(unsigned((2 * inter / 16 + ntb - 1) / ntb), unsigned(top_k));
    char label[96];
    std::snprintf(label, sizeof label, "%s (%u blocks, %d/SM)", name, grid.x * grid.y, per_sm);
    time(label, gu_bytes, [&](int s) {
      kernel<<<grid, 32 * ks * ntb, gu_smem>>>(d_gu, E, d_ids + s * top_k, x, act, top_k, inter, hidden, 1.702f, 7.f);
    });
  };
  gate_up(moe_mxfp4_gate_up_kernel<2, 4, false>, 2, 4, "gate/up KS2 NTB4 (default)");
  gate_up(moe_mxfp4_gate_up_kernel<2, 4, true>, 2, 4, "gate/up KS2 NTB4 double");
  gate_up(moe_mxfp4_gate_up_kernel<4, 2, false>, 4, 2, "gate/up KS4 NTB2");
  gate_up(moe_mxfp4_gate_up_kernel<8, 1, false>, 8, 1, "gate/up KS8 NTB1");
  gate_up(moe_mxfp4_gate_up_kernel<2, 4, true, 2>, 2, 4, "gate/up KS2 NTB4 double B2");
  gate_up(moe_mxfp4_gate_up_kernel<8, 1, true, 2>, 8, 1, "gate/up KS8 NTB1 double B2");
  gate_up(moe_mxfp4_gate_up_kernel<8, 1, false, 2>, 8, 1, "gate/up KS8 NTB1 B2");
  gate_up(moe_mxfp4_gate_up_kernel<8, 1, true, 1>, 8, 1, "gate/up KS8 NTB1 double B1");
  gate_up(moe_mxfp4_gate_up_kernel<2, 2, false>, 2, 2, "gate/up KS2 NTB2");
  gate_up(moe_mxfp4_gate_up_kernel<4, 1, false>, 4, 1, "gate/up KS4 NTB1");
  gate_up(moe_mxfp4_gate_up_kernel<2, 1, false>, 2, 1, "gate/up KS2 NTB1");
  const size_t dn_smem = size_t(mxfp4_x_bytes(top_k, inter));
  auto down = [&](auto kernel, const char* name) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dn_smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kMoeMxfp4DownWarps, dn_smem);
    char label[96];
    std::snprintf(label, sizeof label, "%s (%lld blocks, %d/SM)", name, (long long)(hidden / 16), per_sm);
    time(label, dn_bytes, [&](int s) {
      kernel<<<dim3(unsigned(hidden / 16), 1), 32 * kMoeMxfp4DownWarps, dn_smem>>>(d_dn, d_ids + s * top_k,
                                                                                  d_w + s * top_k, act, out, top_k,
                                                                                  inter, hidden, true);
    });
  };
  // Streamed kernels (kernels/moe_mxfp4_stream.cuh): W consumer warps, `stages` tiles a block, at
  // most per_sm blocks an SM (0: as many as fit).
  auto stream_grid = [&](auto kernel, int w, size_t smem, int64_t items, int per_sm_cap, int* per_sm) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, 32 * (w + 1), smem);
    if (per_sm_cap > 0 && *per_sm > per_sm_cap) *per_sm = per_sm_cap;
    return unsigned(std::min<int64_t>(items, int64_t(*per_sm) * sms));
  };
  auto gate_up_stream = [&](auto kernel, int w, int stages, int cap) {
    const size_t smem = size_t(mxfp4_stream_smem(hidden, stages, w, mxfp4_x_bytes(1, hidden)));
    int per_sm = 0;
    const unsigned grid = stream_grid(kernel, w, smem, top_k * (2 * inter / 16), cap, &per_sm);
    char label[96];
    std::snprintf(label, sizeof label, "gate/up stream W%d S%d (%u blocks, %d/SM, %zu KB)", w, stages, grid, per_sm,
                  smem / 1024);
    time(label, gu_bytes, [&](int s) {
      kernel<<<grid, 32 * (w + 1), smem>>>(d_gu, d_ids + s * top_k, nullptr, 0, x, nullptr, nullptr, act, top_k, top_k,
                                           inter, hidden, 1.702f, 7.f, stages, RouterAcc{}, nullptr, nullptr, kMxfp4EarlyAll);
    });
  };
  for (int stages : {2, 3, 4}) gate_up_stream(moe_mxfp4_gate_up_stream_kernel<8>, 8, stages, 0);
  for (int stages : {2, 3}) gate_up_stream(moe_mxfp4_gate_up_stream_kernel<8, 3>, 8, stages, 0);
  gate_up_stream(moe_mxfp4_gate_up_stream_kernel<8, 4>, 8, 2, 0);
  gate_up_stream(moe_mxfp4_gate_up_stream_kernel<4>, 4, 2, 0);
  gate_up_stream(moe_mxfp4_gate_up_stream_kernel<4, 6>, 4, 2, 0);
  gate_up_stream(moe_mxfp4_gate_up_stream_kernel<12>, 12, 2, 0);
  gate_up_stream(moe_mxfp4_gate_up_stream_kernel<16>, 16, 2, 0);
  auto down_stream = [&](auto kernel, int w, int stages, int cap) {
    const size_t smem = size_t(mxfp4_stream_smem(inter, stages, w, 0));
    int per_sm = 0;
    const unsigned grid = stream_grid(kernel, w, smem, hidden / 16, cap, &per_sm);
    char label[96];
    std::snprintf(label, sizeof label, "down stream W%d S%d (%u blocks, %d/SM, %zu KB)", w, stages, grid, per_sm,
                  smem / 1024);
    time(label, dn_bytes, [&](int s) {
      kernel<<<grid, 32 * (w + 1), smem>>>(d_dn, d_ids + s * top_k, d_w + s * top_k, nullptr, 0, false, act, out, 1,
                                           top_k, inter, hidden, true, stages, RouterAcc{}, nullptr, kMxfp4EarlyAll);
    });
  };
  for (int stages : {2, 3, 4}) down_stream(moe_mxfp4_down_stream_kernel<8>, 8, stages, 0);
  for (int stages : {2, 3}) down_stream(moe_mxfp4_down_stream_kernel<8, 4>, 8, stages, 0);
  down_stream(moe_mxfp4_down_stream_kernel<12>, 12, 2, 0);
  down_stream(moe_mxfp4_down_stream_kernel<16>, 16, 2, 0);
  down(moe_mxfp4_down_kernel<false>, "down (default)");
  down(moe_mxfp4_down_kernel<true>, "down double");
  down(moe_mxfp4_down_kernel<true, 2>, "down double B2");
  down(moe_mxfp4_down_kernel<true, 1>, "down double B1");
  down(moe_mxfp4_down_kernel<false, 2>, "down B2");
  down(moe_mxfp4_down_kernel<false, 8>, "down B8");
  return 0;
}
