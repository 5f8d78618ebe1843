// Launch configuration of the tensor-core BF16 decode GEMV (kernels/gemv_dense_mma.cuh); see
// launch.h. The CUDA-core GEMVs of ops.cu remain for f32/f16 weights, the routers (at most one row
// per SM: split along K) and shapes this kernel does not take.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "backend/cuda/launch.h"
#include "backend/cuda/launch_pdl.cuh"
#include "backend/cuda/smem_optin.cuh"
#include "kernels/gemv_dense_mma.cuh"

namespace nibble::cuda {
namespace {

// Staged activations above this size would leave one block an SM: the CUDA-core GEMV then.
constexpr int64_t kDenseMmaMaxSmem = 96 * 1024;

// Warps along K (KS) of a block, which takes one 8-row tile: enough warps to keep ~16 an SM
// streaming, K split no finer than its batches. gpt-oss's q/k/v (640 tiles) take 4, its o
// projection (360) and the lm_heads (tens of thousands of tiles, the blocks striding over them) 8:
// the fastest of KS 2/4/8 x tiles a block 1/4 x units 4/8/16 on those shapes (tools/kernel-bench,
// H100).
template <typename Fn>
void dispatch_dense_mma_split(int64_t tiles, int64_t batches, Fn&& fn) {
  using std::integral_constant;
  const int64_t sms = int64_t(sm_count());
  const bool few_tiles = tiles * 4 < 16 * sms, many_tiles = tiles >= 32 * sms;
  if (batches >= 8 && (few_tiles || many_tiles))
    fn(integral_constant<int, 8>{});
  else if (batches >= 4)
    fn(integral_constant<int, 4>{});
  else
    fn(integral_constant<int, 2>{});
}

}  // namespace

bool gemv_bf16_mma(const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k,
                   const GemvIo& io) {
  static const bool off = std::getenv("NIBBLE_NO_DENSE_MMA_GEMV") != nullptr;  // for A/B runs
  const size_t smem = size_t(kernels::dense_mma_x_bytes(m, k));
  if (off || m < 1 || m > kernels::kGemvMaxM || k % 8 != 0 || int64_t(smem) > kDenseMmaMaxSmem ||
      reinterpret_cast<uintptr_t>(w) % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0)
    return false;
  const int64_t tiles = (n + kernels::kDenseMmaTileRows - 1) / kernels::kDenseMmaTileRows;
  const int64_t batches = ((k + 31) / 32 + kernels::kDenseMmaUnits - 1) / kernels::kDenseMmaUnits;
  const auto* weights = static_cast<const __nv_bfloat16*>(w);
  const kernels::GemvIo kio{io.norm, io.eps, io.accumulate};
  auto go = [&](auto kNorm) {
    dispatch_dense_mma_split(tiles, batches, [&](auto KS) {
      const auto kernel = kernels::gemv_bf16_mma_kernel<kNorm.value, KS.value, 1>;
      const int threads = 32 * KS.value;
      allow_smem(kernel, smem);
      const int64_t resident = int64_t(resident_blocks(kernel, threads, smem)) * int64_t(sm_count());
      launch_pdl_smem(kernel, unsigned(std::min(tiles, resident)), threads, smem, weights, bias, x, y, int(m), n, k,
                      kio);
    });
  };
  if (io.norm)
    go(std::true_type{});
  else
    go(std::false_type{});
  return true;
}

}  // namespace nibble::cuda
