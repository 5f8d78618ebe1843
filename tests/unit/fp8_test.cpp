// The host's FP8 E4M3 conversions (core/fp8.h), the CPU reference of an FP8 KV cache: every code
// decodes to the value the format defines and encodes back to itself; rounding is to nearest even
// (midpoints between neighbouring codes), magnitudes past 448 saturate, NaN stays NaN.
#include "core/fp8.h"

#include <gtest/gtest.h>

#include <cmath>

namespace nibble {
namespace {

TEST(Fp8, EveryCodeRoundTrips) {
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const float x = e4m3_to_f32(uint8_t(code));
    if ((code & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(x)) << code;
      EXPECT_EQ(f32_to_e4m3(x), 0x7F);
      continue;
    }
    ++finite;
    EXPECT_EQ(f32_to_e4m3(x), uint8_t(code)) << "code " << code << " value " << x;
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.f);
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.f, -6));  // smallest normal
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x38), 1.f);
  EXPECT_EQ(e4m3_to_f32(0xB8), -1.f);
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  // Positive codes in order are increasing values: each midpoint goes to the even code, and
  // anything between a midpoint and a code goes to that code.
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = e4m3_to_f32(uint8_t(code)), hi = e4m3_to_f32(uint8_t(code + 1)), mid = (lo + hi) / 2;
    EXPECT_EQ(f32_to_e4m3(mid), uint8_t(code % 2 == 0 ? code : code + 1)) << "midpoint above code " << code;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(mid, lo)), uint8_t(code)) << code;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(mid, hi)), uint8_t(code + 1)) << code;
    EXPECT_EQ(f32_to_e4m3(-mid), uint8_t(0x80 | (code % 2 == 0 ? code : code + 1))) << code;
  }
  for (float big : {448.f, 449.f, 464.f, 500.f, 1e6f, INFINITY}) {
    EXPECT_EQ(f32_to_e4m3(big), 0x7E) << big;
    EXPECT_EQ(f32_to_e4m3(-big), 0xFE) << big;
  }
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.f, -11)), 0x00);  // below half the smallest subnormal
  EXPECT_EQ(f32_to_e4m3(-0.f), 0x80);
}

}  // namespace
}  // namespace nibble
