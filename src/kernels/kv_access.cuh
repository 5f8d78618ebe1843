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

}  // namespace nibble::kernels
