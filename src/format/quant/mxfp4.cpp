#include "format/quant/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/status.h"

namespace nibble {

float e8m0_to_f32(uint8_t byte) {
  if (byte == 255) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.f, int(byte) - 127);
}

uint8_t f32_to_e2m1(float x) {
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  const float a = std::fabs(x);
  // Midpoints between the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; at a midpoint the even code wins.
  static constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.f};
  uint8_t code = 0;
  while (code < 7 && (a > kMid[code] || (a == kMid[code] && code % 2 == 1))) ++code;
  return uint8_t(sign | code);
}

void dequantize_mxfp4_row(const uint8_t* codes, const uint8_t* scales, int64_t k, int64_t row, float* out) {
  const uint8_t* c = codes + row * (k / 2);
  const uint8_t* s = scales + row * (k / kMxfp4Block);
  for (int64_t b = 0; b < k / kMxfp4Block; ++b) {
    const float scale = e8m0_to_f32(s[b]);
    for (int64_t j = 0; j < kMxfp4Block / 2; ++j) {
      const uint8_t byte = c[b * kMxfp4Block / 2 + j];
      out[b * kMxfp4Block + 2 * j] = kE2m1Values[byte & 15] * scale;
      out[b * kMxfp4Block + 2 * j + 1] = kE2m1Values[byte >> 4] * scale;
    }
  }
}

Mxfp4Matrix quantize_mxfp4(int64_t n, int64_t k, const std::function<void(int64_t row, float* out)>& row_f32) {
  NIBBLE_CHECK(k % kMxfp4Block == 0, "MXFP4: {} inputs is not a multiple of the block size {}", k, kMxfp4Block);
  Mxfp4Matrix m;
  m.n = n;
  m.k = k;
  m.codes.resize(size_t(n * k / 2));
  m.scales.resize(size_t(n * k / kMxfp4Block));
#pragma omp parallel if (n * k >= (1 << 20))
  {
    std::vector<float> row(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      row_f32(r, row.data());
      for (int64_t b = 0; b < k / kMxfp4Block; ++b) {
        const float* x = row.data() + b * kMxfp4Block;
        float amax = 0.f;
        for (int64_t j = 0; j < kMxfp4Block; ++j) amax = std::max(amax, std::fabs(x[j]));
        // E8M0 covers 2^-127 .. 2^127; an all-zero block takes the smallest scale.
        int e = amax > 0.f ? int(std::ceil(std::log2(double(amax) / 6.0))) : -127;
        e = std::clamp(e, -127, 127);
        if (amax > 0.f && std::ldexp(6.0, e - 1) >= double(amax)) --e;  // log2 rounding at exact powers
        e = std::max(e, -127);
        const float inv = std::ldexp(1.f, -e);
        m.scales[size_t(r * (k / kMxfp4Block) + b)] = uint8_t(e + 127);
        uint8_t* dst = m.codes.data() + r * (k / 2) + b * kMxfp4Block / 2;
        for (int64_t j = 0; j < kMxfp4Block / 2; ++j)
          dst[j] = uint8_t(f32_to_e2m1(x[2 * j] * inv) | f32_to_e2m1(x[2 * j + 1] * inv) << 4);
      }
    }
  }
  return m;
}

}  // namespace nibble
