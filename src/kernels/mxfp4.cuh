// The MXFP4 decode layout's device-side pieces shared by the decode kernels (kernels/gemv_mxfp4.cuh,
// moe_mxfp4.cuh, which describe the layout) and the prefill GEMMs (moe_mxfp4_prefill.cuh): the
// weight handles, the biased E8M0 scale, the staged activation unit. No kernels here, so any
// launcher file may include it.
#pragma once

#include <cstdint>

#include "kernels/mma.cuh"

namespace nibble::kernels {

struct Mxfp4Weight {  // decode layout
  const uint8_t* codes;
  const uint8_t* scales;
};

// The decode layout's scale bytes are E8M0 + 14, saturated at 255 (made at upload): a byte moved to
// bits 23..30 is then the f32 2^(e - 127 + 14) that the codes' value · 2^-14 needs (an E8M0 of 241
// and above gives infinity; 255 is NaN in the format). Byte b of a group's scale word in two
// operations instead of five.
__host__ __device__ constexpr uint8_t mxfp4_decode_scale(uint8_t e8m0) { return uint8_t(e8m0 > 241 ? 255 : e8m0 + 14); }
// (b: a constant once the callers' loops unroll.)
__device__ __forceinline__ float mxfp4_group_scale(uint32_t word, int b) {
  return __uint_as_float((b == 3 ? word >> 1 : word << (23 - 8 * b)) & 0x7F800000u);
}

// 8 consecutive inputs as one 16-byte unit of a staged row, f16 in mxfp4_x_half order (8t, 8t + 4,
// 8t + 1, 8t + 5, ...: pairs (j, j + 4)), the B operand of a block's two mma steps.
__device__ __forceinline__ uint4 mxfp4_staged_unit(const float (&f)[8]) {
  return make_uint4(pack_f16x2(f[0], f[4]), pack_f16x2(f[1], f[5]), pack_f16x2(f[2], f[6]), pack_f16x2(f[3], f[7]));
}

// One expert's matrix in device memory, decode layout; bias [n] (or null).
struct Mxfp4Device {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* bias;
};

}  // namespace nibble::kernels
