// MXFP4 (format/quant/mxfp4.h): the bit layout against FORMATS.md §5's worked example and the OCP
// value table, rounding to the nearest code with ties to even, the quantizer's scale choice and
// error bound on random rows, and LinearWeight's MXFP4 rows and byte count.
#include "format/quant/mxfp4.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/status.h"
#include "model/weights.h"

namespace nibble {
namespace {

TEST(Mxfp4, WorkedExampleFromTheFormatSpec) {
  // Byte 0x2A, scale 0x80 (2^1): low nibble 0xA -> -1.0 -> -2.0 (element 0); high nibble 0x2 ->
  // +1.0 -> +2.0 (element 1).
  std::vector<uint8_t> codes(16, 0), scales = {0x80};
  codes[0] = 0x2A;
  codes[15] = 0x7F;  // elements 30 (-6) and 31 (+6)
  std::vector<float> out(32);
  dequantize_mxfp4_row(codes.data(), scales.data(), 32, 0, out.data());
  EXPECT_EQ(out[0], -2.f);
  EXPECT_EQ(out[1], 2.f);
  EXPECT_EQ(out[2], 0.f);
  EXPECT_EQ(out[30], -12.f);
  EXPECT_EQ(out[31], 12.f);
  EXPECT_EQ(e8m0_to_f32(127), 1.f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(Mxfp4, NearestCodeTiesToEven) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(kE2m1Values[f32_to_e2m1(kE2m1Values[c])], kE2m1Values[c]) << c;
  EXPECT_EQ(f32_to_e2m1(0.25f), 0);    // between 0 (code 0) and 0.5 (code 1): even
  EXPECT_EQ(f32_to_e2m1(0.26f), 1);
  EXPECT_EQ(f32_to_e2m1(0.75f), 2);    // between 0.5 (1) and 1 (2)
  EXPECT_EQ(f32_to_e2m1(1.25f), 2);    // between 1 (2) and 1.5 (3)
  EXPECT_EQ(f32_to_e2m1(2.5f), 4);     // between 2 (4) and 3 (5)
  EXPECT_EQ(f32_to_e2m1(3.5f), 6);     // between 3 (5) and 4 (6)
  EXPECT_EQ(f32_to_e2m1(5.f), 6);      // between 4 (6) and 6 (7)
  EXPECT_EQ(f32_to_e2m1(5.01f), 7);
  EXPECT_EQ(f32_to_e2m1(100.f), 7);    // saturates
  EXPECT_EQ(f32_to_e2m1(-2.4f), 8 | 4);
  EXPECT_EQ(f32_to_e2m1(-5.5f), 8 | 7);
}

TEST(Mxfp4, QuantizerScalesAndErrorBound) {
  const int64_t n = 7, k = 96;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> w(size_t(n * k));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < k; ++i) w[size_t(r * k + i)] = normal(rng) * std::ldexp(1.f, int(r) - 3);
  for (int64_t i = 0; i < 32; ++i) w[size_t(2 * k + 32 + i)] = 0.f;  // an all-zero block
  w[size_t(3 * k)] = 12.f;                                             // a block max of exactly 6 * 2
  Mxfp4Matrix m = quantize_mxfp4(n, k, [&](int64_t row, float* out) {
    std::copy_n(w.data() + row * k, k, out);
  });
  ASSERT_EQ(m.codes.size(), size_t(n * k / 2));
  ASSERT_EQ(m.scales.size(), size_t(n * k / 32));
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < n; ++r) {
    dequantize_mxfp4_row(m.codes.data(), m.scales.data(), k, r, row.data());
    for (int64_t b = 0; b < k / 32; ++b) {
      float amax = 0;
      for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(w[size_t(r * k + b * 32 + i)]));
      const float scale = e8m0_to_f32(m.scales[size_t(r * (k / 32) + b)]);
      if (amax > 0) {
        // The smallest power of two that keeps the block within ±6: nothing saturates.
        EXPECT_LE(amax, 6 * scale) << r << "," << b;
        EXPECT_GT(amax, 3 * scale) << r << "," << b;
      }
      for (int64_t i = 0; i < 32; ++i) {
        const float x = w[size_t(r * k + b * 32 + i)], y = row[size_t(b * 32 + i)];
        // Round to nearest: at most half the widest step (4 -> 6) of the block, and exactly the
        // nearest code (no other E2M1 value is closer).
        EXPECT_LE(std::fabs(x - y), scale) << r << "," << b << "," << i;
        for (float v : kE2m1Values) EXPECT_LE(std::fabs(x - y), std::fabs(x - v * scale) + 1e-6f * scale);
      }
    }
  }
  EXPECT_EQ(m.scales[size_t(2 * 3 + 1)], 0);  // the zero block: the smallest scale, codes 0
  EXPECT_EQ(m.scales[size_t(3 * 3)], 128);     // max 12 = 6 * 2^1
  dequantize_mxfp4_row(m.codes.data(), m.scales.data(), k, 3, row.data());
  EXPECT_EQ(row[0], 12.f);
  // Quantizing the dequantized values gives the same values back.
  std::vector<float> deq(size_t(n * k));
  for (int64_t r = 0; r < n; ++r) dequantize_mxfp4_row(m.codes.data(), m.scales.data(), k, r, deq.data() + r * k);
  Mxfp4Matrix again = quantize_mxfp4(n, k, [&](int64_t r, float* out) { std::copy_n(deq.data() + r * k, k, out); });
  for (int64_t r = 0; r < n; ++r) {
    dequantize_mxfp4_row(again.codes.data(), again.scales.data(), k, r, row.data());
    for (int64_t i = 0; i < k; ++i) ASSERT_EQ(row[size_t(i)], deq[size_t(r * k + i)]) << r << "," << i;
  }
  EXPECT_THROW(quantize_mxfp4(1, 40, [](int64_t, float*) {}), Error);
}

TEST(Mxfp4, LinearWeightRowsAndBytes) {
  const int64_t n = 3, k = 64;
  std::vector<float> w(size_t(n * k));
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(float(i)) * 0.3f;
  LinearWeight lw = mxfp4_weight("x", quantize_mxfp4(n, k, [&](int64_t r, float* out) {
    std::copy_n(w.data() + r * k, k, out);
  }));
  EXPECT_EQ(lw.format, WeightFormat::kMxfp4);
  EXPECT_STREQ(weight_format_name(lw.format), "MXFP4");
  EXPECT_EQ(lw.bytes(), size_t(n * k / 2 + n * k / 32));  // 4.25 bits a weight
  std::vector<float> row(static_cast<size_t>(k)), want(static_cast<size_t>(k));
  for (int64_t r = 0; r < n; ++r) {
    lw.row_f32(r, row.data());
    dequantize_mxfp4_row(lw.mxfp4.codes, lw.mxfp4.scales, k, r, want.data());
    EXPECT_EQ(row, want);
  }
}

TEST(Mxfp4, ClampedSwigluActivation) {
  // gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
  auto ref = [](double gate, double up) {
    const double g = std::min(gate, 7.0), u = std::clamp(up, -7.0, 7.0);
    return (u + 1) * g / (1 + std::exp(-1.702 * g));
  };
  for (float gate : {-9.f, -1.f, 0.f, 0.5f, 6.9f, 7.f, 12.f})
    for (float up : {-20.f, -7.5f, -1.f, 0.f, 3.f, 7.f, 8.f})
      EXPECT_NEAR(moe_activation(MoeActivation::kClampedSwiglu, gate, up, 1.702f, 7.f), ref(gate, up),
                  1e-5 * (1 + std::fabs(ref(gate, up))))
          << gate << "," << up;
  EXPECT_NEAR(moe_activation(MoeActivation::kSiluMul, 2.f, 3.f, 0, 0), 2.0 / (1 + std::exp(-2.0)) * 3, 1e-6);
}

}  // namespace
}  // namespace nibble
