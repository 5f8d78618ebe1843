// FP8 E4M3 (the OCP "fn" variant: bias 7, no infinities, 0x7F/0xFF NaN, largest finite 448) on
// the host, rounding as the CUDA conversion does (__nv_cvt_float_to_fp8 with __NV_SATFINITE:
// nearest even, magnitudes past 448 saturate to 448, NaN stays NaN): the CPU reference of an FP8
// KV cache stores the bits a GPU would store for the same value.
#pragma once

#include <cmath>
#include <cstdint>

namespace nibble {

inline float e4m3_to_f32(uint8_t b) {
  const float sign = (b & 0x80) ? -1.f : 1.f;
  const int exp = (b >> 3) & 0xF, mant = b & 0x7;
  if (exp == 0xF && mant == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(mant), -9);  // subnormal: mant x 2^-9
  return sign * std::ldexp(float(8 + mant), exp - 10);      // (1 + mant / 8) x 2^(exp - 7)
}

inline uint8_t f32_to_e4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7E;  // saturate (infinities too)
  if (a < std::ldexp(1.f, -6)) {       // subnormal range: steps of 2^-9, nearest even
    const float q = std::nearbyint(a * 512.f);  // 0..8; 8 is the smallest normal, code 0x08
    return sign | uint8_t(q);
  }
  int e;
  std::frexp(a, &e);  // a = f x 2^e, f in [0.5, 1): the exponent of a is e - 1
  const int exp = e - 1;
  float q = std::nearbyint(std::ldexp(a, 3 - exp));  // 8..16 in steps of one mantissa unit
  int biased = exp + 7;
  if (q == 16.f) q = 8.f, ++biased;
  const int code = (biased << 3) | (int(q) - 8);
  return sign | uint8_t(code > 0x7E ? 0x7E : code);
}

}  // namespace nibble
