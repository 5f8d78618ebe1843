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

// Warps along K (KS) of a block, which takes one 8-row tile, and the 16-byte units a thread loads
// a batch (U): enough warps to keep ~16 an SM streaming, K split no finer than its batches.
// gpt-oss's q/k/v (640 tiles) take KS 4, its o projection (360) 8, U 4: the fastest of KS 2/4/8
// x tiles a block 1/4 x units 4/8/16 on those shapes (tools/kernel-bench, H100).
// A long matrix (an lm_head: tens of thousands of tiles, the blocks striding over them) takes KS 4
// and 8 KB batches a warp (U 16) where they split K evenly over the 4 warps, else 4 KB (U 8): a
// warp's second batch of a tile is loaded only after its first one's products, so the fewer and
// larger the batches the more of a tile is in flight. In isolation (gemv_dense_bench, H200, one
// row, fused norm), against KS 8 and U 4 before: Qwen3's head (151,936 x 2048) 168.0 -> 145.7 µs
// (U 8: 146.9), 4.27 TB/s where a plain read streams 4.38; gpt-oss's (201,088 x 2880) 324.2 ->
// 284.1 (U 16: 295.9); MiniMax-M2.5's (200,064 x 3072) 326.9 -> 298.6 (U 16: 301.8). In a Qwen3
// INT4 decode step the head went 165.8 -> 142.8 µs, tg128 +1.3% (BENCHMARKS.md).
template <typename Fn>
void dispatch_dense_mma_split(int64_t tiles, int64_t pairs, Fn&& fn) {
  using std::integral_constant;
  const int64_t sms = int64_t(sm_count());
  const bool few_tiles = tiles * 4 < 16 * sms, many_tiles = tiles >= 32 * sms;
  auto batches = [&](int64_t units) { return (pairs + units - 1) / units; };
  static const bool long_shape = [] {  // NIBBLE_DENSE_LONG=0: a long matrix as before (KS 8, U 4), for A/B runs
    const char* e = std::getenv("NIBBLE_DENSE_LONG");
    return !e || std::atoi(e) != 0;
  }();
  if (long_shape && many_tiles && batches(16) % 4 == 0)
    fn(integral_constant<int, 4>{}, integral_constant<int, 16>{});
  else if (long_shape && many_tiles && batches(8) >= 4)
    fn(integral_constant<int, 4>{}, integral_constant<int, 8>{});
  else if (batches(kernels::kDenseMmaUnits) >= 8 && (few_tiles || many_tiles))
    fn(integral_constant<int, 8>{}, integral_constant<int, kernels::kDenseMmaUnits>{});
  else if (batches(kernels::kDenseMmaUnits) >= 4)
    fn(integral_constant<int, 4>{}, integral_constant<int, kernels::kDenseMmaUnits>{});
  else
    fn(integral_constant<int, 2>{}, integral_constant<int, kernels::kDenseMmaUnits>{});
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
  const int64_t pairs = (k + 31) / 32;  // 32-k pairs a row
  const auto* weights = static_cast<const __nv_bfloat16*>(w);
  const kernels::GemvIo kio{io.norm, io.eps, io.accumulate};
  auto go = [&](auto kNorm) {
    dispatch_dense_mma_split(tiles, pairs, [&](auto KS, auto U) {
      const auto kernel = kernels::gemv_bf16_mma_kernel<kNorm.value, KS.value, 1, U.value>;
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
