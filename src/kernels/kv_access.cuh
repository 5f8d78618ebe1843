// Element access to a paged KV pool (backend/kv_pages.h) from kernels templated on the element
// type: f32 pools (exact reference runs) and f16 pools (the default) share one code path.
#pragma once

#include <cuda_fp16.h>

#include "backend/kv_pages.h"

namespace nibble::kernels {

__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }

// Host side: calls f(T()) with T the pool's element type (__half for F16, else float), so a
// launcher instantiates its kernel for both without repeating the branch.
template <typename F>
void with_kv_element(DType dtype, F&& f) {
  if (dtype == DType::F16)
    f(__half());
  else
    f(float());
}

}  // namespace nibble::kernels
