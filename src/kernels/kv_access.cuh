// Element access to a paged KV pool (backend/kv_pages.h) from kernels templated on the element
// type: f32 pools (exact reference runs), f16 pools (the default) and FP8 E4M3 pools
// (--kv-cache-dtype fp8: half the bytes; stored with saturation to +-448 and no scale, as vLLM's
// uncalibrated fp8 cache) share one code path.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/kv_pages.h"

namespace nibble::kernels {

__device__ __forceinline__ float kv_load(const float* p) { return *p; }
__device__ __forceinline__ float kv_load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ float kv_load(const __nv_fp8_e4m3* p) { return float(*p); }
__device__ __forceinline__ void kv_store(__nv_fp8_e4m3* p, float x) { *p = __nv_fp8_e4m3(x); }

// Two E4M3 values (the low byte first) as an f16 pair: exact, every E4M3 value is an f16 value.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// 8 consecutive elements at p (16-byte aligned for f16, 8-byte for E4M3) as 8 f16 values in a
// uint4, the tensor-core kernels' operand unit.
__device__ __forceinline__ uint4 kv_load8_f16(const __half* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint4 kv_load8_f16(const __nv_fp8_e4m3* p) {
  const uint2 b = *reinterpret_cast<const uint2*>(p);
  return make_uint4(e4m3x2_to_f16x2(uint16_t(b.x)), e4m3x2_to_f16x2(uint16_t(b.x >> 16)),
                    e4m3x2_to_f16x2(uint16_t(b.y)), e4m3x2_to_f16x2(uint16_t(b.y >> 16)));
}

// Host side: calls f(T()) with T the pool's element type (__half for F16, __nv_fp8_e4m3 for
// F8_E4M3, else float), so a launcher instantiates its kernel for each without repeating the branch.
template <typename F>
void with_kv_element(DType dtype, F&& f) {
  if (dtype == DType::F16)
    f(__half());
  else if (dtype == DType::F8_E4M3)
    f(__nv_fp8_e4m3());
  else
    f(float());
}

}  // namespace nibble::kernels
