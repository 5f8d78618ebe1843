// Launch sequence of the device sampler (kernels/sampling.cuh); see launch.h.
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/launch.h"
#include "kernels/sampling.cuh"

namespace nibble::cuda {

namespace {
// Scratch layout: max (16 B), weights and ids, sorted weights and ids, chunk sums, then CUB's
// temporary storage.
size_t align16(size_t b) { return (b + 15) / 16 * 16; }
int64_t n_chunks(int64_t n) { return (n + kernels::kSampleThreads - 1) / kernels::kSampleThreads; }
size_t radix_temp_bytes(int64_t n) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, static_cast<const float*>(nullptr),
                                            static_cast<float*>(nullptr), static_cast<const int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), int(n));
  return bytes;
}
}  // namespace

int64_t sample_scratch_bytes(int64_t n) {
  return int64_t(16 + 4 * align16(size_t(n) * 4) + align16(size_t(n_chunks(n)) * 8) + radix_temp_bytes(n));
}

void sample(const float* x, int64_t n, const SampleInputs* in, int32_t* out, void* scratch) {
  auto* base = static_cast<uint8_t*>(scratch);
  float* max_value = reinterpret_cast<float*>(base);
  const size_t row = align16(size_t(n) * 4);
  float* w = reinterpret_cast<float*>(base + 16);
  int32_t* ids = reinterpret_cast<int32_t*>(base + 16 + row);
  float* w_sorted = reinterpret_cast<float*>(base + 16 + 2 * row);
  int32_t* ids_sorted = reinterpret_cast<int32_t*>(base + 16 + 3 * row);
  double* chunk_sums = reinterpret_cast<double*>(base + 16 + 4 * row);
  void* temp = base + 16 + 4 * row + align16(size_t(n_chunks(n)) * 8);
  size_t temp_bytes = radix_temp_bytes(n);
  kernels::sample_max_kernel<<<1, kernels::kSampleThreads>>>(x, n, max_value);
  kernels::sample_weights_kernel<<<unsigned((n + 255) / 256), 256>>>(x, n, max_value, in, w, ids);
  cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, w, w_sorted, ids, ids_sorted, int(n), 0, 32,
                                            cudaStreamPerThread);
  kernels::sample_chunk_sums_kernel<<<unsigned(n_chunks(n)), kernels::kSampleThreads>>>(w_sorted, n, chunk_sums);
  kernels::sample_draw_kernel<<<1, kernels::kSampleThreads>>>(w_sorted, chunk_sums, ids_sorted, n, in, out);
}

void apply_penalties(float* logits, int64_t n, const PenaltyRow* rows, int64_t n_rows, const PenaltyToken* tokens) {
  if (n_rows == 0) return;
  kernels::penalties_kernel<<<dim3(unsigned(n_rows), 4), 256>>>(logits, n, rows, tokens);
}

}  // namespace nibble::cuda
