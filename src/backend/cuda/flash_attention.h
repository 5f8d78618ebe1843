// Launcher of the tensor-core flash-attention prefill kernel (kernels/flash_attention.cuh);
// callable from plain C++, default stream, the caller checks cudaGetLastError() as for launch.h.
#pragma once

#include <cstdint>

#include "backend/kv_pages.h"

namespace nibble::cuda {

// The shapes the kernel takes: head_dim 64 or 128, a GQA group (n_head / n_head_kv) of at most 8.
constexpr bool flash_attention_supports(int64_t n_head, int64_t n_head_kv, int64_t head_dim) {
  return (head_dim == 64 || head_dim == 128) && n_head_kv > 0 && n_head % n_head_kv == 0 &&
         n_head / n_head_kv <= 8;
}

// Causal attention of m query tokens against the paged K/V cache, as CudaBackend::attention (q [m,
// n_head, head_dim], out [m, n_head, head_dim] f32; token t attends positions 0..positions[t], the
// last `window` of them when window > 0; sinks: a logit per q head in each softmax's denominator,
// or null).
// Q, K, V, P are rounded to f16 for the tensor cores (f32 accumulation): relative error about
// 1e-3, not exact f32. Returns false (launching nothing) for a shape outside
// flash_attention_supports or pointers that are not 16-byte aligned.
bool flash_attention(const float* q, const KvPages& kv, float* out, int64_t m, const int32_t* positions,
                     int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, const float* sinks,
                     int64_t window);

}  // namespace nibble::cuda
