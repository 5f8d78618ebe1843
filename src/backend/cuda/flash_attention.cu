// Launch configuration of the flash-attention prefill kernel; see flash_attention.h.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/flash_attention.h"
#include "kernels/flash_attention.cuh"

namespace nibble::cuda {

bool flash_attention(const float* q, const KvPages& kv, float* out, int64_t m, const int32_t* positions,
                     int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, const float* sinks,
                     int64_t window) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // One sequence per launch: a tile's queries share the K/V tiles they stage (several sequences
  // in a step run their prompt chunks one launch each).
  if (kv.seq_rows || !flash_attention_supports(n_head, n_head_kv, head_dim) || !aligned(q) || !aligned(kv.k) || !aligned(kv.v) ||
      !aligned(out))
    return false;
  if (m == 0) return true;
  const int group = int(n_head / n_head_kv);
  const int64_t tokens = kernels::kFlashRows / group;
  const dim3 grid(unsigned((m + tokens - 1) / tokens), unsigned(n_head_kv));
  const float scale_log2 = scale * 1.4426950408889634f;
  auto go = [&](auto kernel, auto element, int smem) {
    using T = decltype(element);
    kernel<<<grid, kernels::kFlashThreads, smem>>>(q, static_cast<const T*>(kv.k), static_cast<const T*>(kv.v),
                                                    kv.block_table, kv.block_size_log2, out, positions, int(m),
                                                    int(n_head), int(n_head_kv), group, scale_log2,
                                                    sinks, int(window));
  };
  kernels::with_kv_element(kv.dtype, [&](auto element) {
    using T = decltype(element);
    if (head_dim == 64)
      go(kernels::flash_attention_prefill_kernel<64, T>, element, kernels::FlashTile<64>::kSmemBytes);
    else
      go(kernels::flash_attention_prefill_kernel<128, T>, element, kernels::FlashTile<128>::kSmemBytes);
  });
  return true;
}

}  // namespace nibble::cuda
