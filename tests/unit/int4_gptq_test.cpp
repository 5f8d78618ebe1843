// GPTQ INT4: the checkpoint layout of FORMATS.md §1 read into Int4Matrix, nibble's RTN quantizer
// writing that layout, and the errors a malformed checkpoint must produce. Tensors are TensorInfo
// views over std::vectors, as a mapped safetensors file would provide them.
#include "format/quant/int4_gptq.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace nibble {
namespace {

template <typename T>
TensorInfo view(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
  return TensorInfo{.name = name, .dtype = dtype, .shape = std::move(shape),
                    .data = reinterpret_cast<const uint8_t*>(v.data()), .nbytes = v.size() * sizeof(T),
                    .file = "test.safetensors"};
}

// The four tensors of one quantized Linear [n, k], owned together with their views.
struct Packed {
  GptqPacked p;
  TensorInfo qweight, qzeros, scales, g_idx;
  Packed(GptqPacked packed, int64_t n, int64_t k) : p(std::move(packed)) {
    qweight = view("w.qweight", DType::I32, {k / 8, n}, p.qweight);
    qzeros = view("w.qzeros", DType::I32, {p.n_groups, n / 8}, p.qzeros);
    scales = view("w.scales", DType::F16, {p.n_groups, n}, p.scales);
    g_idx = view("w.g_idx", DType::I32, {k}, p.g_idx);
  }
  GptqTensorSet set(bool with_g_idx = true) const {
    return {&qweight, &qzeros, &scales, with_g_idx ? &g_idx : nullptr};
  }
};

std::vector<float> dequantize(const Int4Matrix& m) {
  std::vector<float> out(size_t(m.n * m.k));
  for (int64_t r = 0; r < m.n; ++r) m.dequantize_row(r, out.data() + r * m.k);
  return out;
}

// FORMATS.md: W[n, k] = (q[k, n] - zero[g, n]) * scales[g, n], straight from the checkpoint words.
float reference_w(const GptqPacked& p, int64_t n, int64_t col, int64_t kk, int64_t group, bool minus_one) {
  const int64_t g = kk / group;
  const uint32_t qw = uint32_t(p.qweight[size_t((kk / 8) * n + col)]);
  const int q = int((qw >> (4 * (kk % 8))) & 0xF);
  const uint32_t qz = uint32_t(p.qzeros[size_t(g * (n / 8) + col / 8)]);
  int z = int((qz >> (4 * (col % 8))) & 0xF);
  if (minus_one) z = (z + 1) & 0xF;
  return float(q - z) * f16_to_f32(p.scales[size_t(g * n + col)]);
}

TEST(Int4Gptq, FormatsWorkedExample) {
  // K=8, N=8, G=8, sym, v1: qweight[0,0] = 0x76543210, zeros stored 7 (true 8), scale 0.5.
  std::mt19937 rng(11);
  GptqPacked p;
  p.n_groups = 1;
  p.qweight.resize(8);
  for (auto& w : p.qweight) w = int32_t(rng());  // other columns: arbitrary codes
  p.qweight[0] = 0x76543210;
  p.qzeros = {0x77777777};
  p.scales.assign(8, 0x3800);
  ASSERT_EQ(f16_to_f32(0x3800), 0.5f);
  p.g_idx.assign(8, 0);
  Packed t(p, 8, 8);
  Int4Matrix m = int4_from_gptq(t.set(), 8, 8, 8, /*zero_minus_one=*/true, "w");
  std::vector<float> row(8);
  m.dequantize_row(0, row.data());
  EXPECT_EQ(row, (std::vector<float>{-4, -3.5, -3, -2.5, -2, -1.5, -1, -0.5}));
  EXPECT_EQ(m.zeros[0], 8);
  auto all = dequantize(m);  // and every other column follows the same formula
  for (int64_t c = 0; c < 8; ++c)
    for (int64_t kk = 0; kk < 8; ++kk) ASSERT_EQ(all[size_t(c * 8 + kk)], reference_w(p, 8, c, kk, 8, true));

  // v2 (gptq_v2, AutoRound's own packer): the stored nibble 7 is the true zero.
  Int4Matrix v2 = int4_from_gptq(t.set(), 8, 8, 8, /*zero_minus_one=*/false, "w");
  v2.dequantize_row(0, row.data());
  EXPECT_EQ(row, (std::vector<float>{-3.5, -3, -2.5, -2, -1.5, -1, -0.5, 0}));
}

TEST(Int4Gptq, RandomWordsMatchReferenceAndV1V2Agree) {
  // Arbitrary checkpoint words (not produced by our quantizer) against the FORMATS.md formula, for
  // both zero conventions; and GPTQModel's v1->v2 conversion (+0x11111111 per qzeros word) must
  // decode to the same matrix.
  std::mt19937 rng(12);
  const int64_t n = 24, k = 96, group = 32;
  GptqPacked p;
  p.n_groups = k / group;
  for (int64_t i = 0; i < k / 8 * n; ++i) p.qweight.push_back(int32_t(rng()));
  for (int64_t i = 0; i < p.n_groups * n / 8; ++i) {
    uint32_t w = 0;
    for (int j = 0; j < 8; ++j) w |= uint32_t(rng() % 15) << (4 * j);  // 0..14: +1 cannot carry
    p.qzeros.push_back(int32_t(w));
  }
  std::uniform_real_distribution<float> sd(0.001f, 0.1f);
  for (int64_t i = 0; i < p.n_groups * n; ++i) p.scales.push_back(f32_to_f16(sd(rng)));
  for (int64_t i = 0; i < k; ++i) p.g_idx.push_back(int32_t(i / group));
  Packed v1(p, n, k);
  GptqPacked p2 = p;
  for (auto& w : p2.qzeros) w = int32_t(uint32_t(w) + 0x11111111u);
  Packed v2(p2, n, k);
  auto a = dequantize(int4_from_gptq(v1.set(), n, k, group, true, "w"));
  auto b = dequantize(int4_from_gptq(v2.set(false), n, k, group, false, "w"));
  auto c = dequantize(int4_from_gptq(v1.set(), n, k, group, false, "w"));
  for (int64_t col = 0; col < n; ++col)
    for (int64_t kk = 0; kk < k; ++kk) {
      const size_t i = size_t(col * k + kk);
      ASSERT_EQ(a[i], reference_w(p, n, col, kk, group, true)) << col << "," << kk;
      ASSERT_EQ(b[i], a[i]) << col << "," << kk;
      ASSERT_EQ(c[i], reference_w(p, n, col, kk, group, false)) << col << "," << kk;
    }
}

struct RoundTripCase {
  int64_t n, k;
  int group;
  bool sym;
};

class Int4GptqRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(Int4GptqRoundTrip, ErrorWithinHalfStep) {
  const auto [n, k, group, sym] = GetParam();
  const int64_t g_size = group > 0 ? group : k;
  std::mt19937 rng(uint32_t(n * 1000 + k * 10 + group + sym));
  // Rows of very different magnitude and an offset, so asymmetric ranges really differ from
  // symmetric ones.
  std::uniform_real_distribution<float> u(-1.f, 1.f), mag(0.01f, 3.f), off(-0.5f, 0.5f);
  std::vector<float> w(size_t(n * k));
  for (int64_t r = 0; r < n; ++r) {
    const float m = mag(rng), o = off(rng);
    for (int64_t i = 0; i < k; ++i) w[size_t(r * k + i)] = m * (u(rng) + o);
  }
  Packed t(quantize_gptq_int4(w.data(), n, k, group, sym), n, k);
  ASSERT_EQ(t.p.n_groups, (k + g_size - 1) / g_size);
  Int4Matrix m = int4_from_gptq(t.set(), n, k, group, true, "w");
  ASSERT_EQ(m.n_groups, t.p.n_groups);
  auto dq = dequantize(m);

  if (sym) {  // GPTQ v1 symmetric: true zero 8 stored as 7 in every nibble
    for (int32_t word : t.p.qzeros) ASSERT_EQ(uint32_t(word), 0x77777777u);
  }

  double err2 = 0, ref2 = 0, noise2 = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < k; ++i) {
      const int64_t g = i / g_size;
      const float s = f16_to_f32(t.p.scales[size_t(g * n + r)]);
      const int z = m.zeros[size_t(r * m.n_groups + g)];
      if (sym) {
        ASSERT_EQ(z, 8);
      }
      const float x = w[size_t(r * k + i)], y = dq[size_t(r * k + i)];
      const double e = std::fabs(double(x) - y);
      // Inside the grid's reach [(0-z-1/2)s, (15-z+1/2)s] rounding is to the nearest step.
      const bool inside = x >= (-z - 0.5f) * s && x <= (15 - z + 0.5f) * s;
      if (inside) {
        ASSERT_LE(e, 0.5 * s * (1 + 1e-5) + 1e-6 * std::fabs(x)) << r << "," << i << " s=" << s;
      } else {  // only the range ends, pushed out by rounding the scale to f16 (<= 15 * 2^-11)
        ASSERT_LE(e, s * (0.5 + 15.0 / 2048) + 1e-6) << r << "," << i << " s=" << s;
      }
      err2 += e * e;
      ref2 += double(x) * x;
      noise2 += double(s) * s / 12;  // uniform rounding noise
    }
  }
  const double rel = std::sqrt(err2 / ref2);
  EXPECT_LT(rel, 0.1);
  EXPECT_GT(rel, 0.005);  // it is a 4-bit code, not a copy
  EXPECT_NEAR(err2 / noise2, 1.0, 0.15) << "error should look like rounding noise s^2/12";
}

INSTANTIATE_TEST_SUITE_P(
    Int4Gptq, Int4GptqRoundTrip,
    ::testing::Values(RoundTripCase{64, 256, 32, true}, RoundTripCase{64, 256, 32, false},
                      RoundTripCase{48, 256, 64, true}, RoundTripCase{48, 256, 64, false},
                      RoundTripCase{32, 384, 128, true}, RoundTripCase{32, 384, 128, false},
                      RoundTripCase{40, 200, -1, true}, RoundTripCase{40, 200, -1, false},
                      // K not a multiple of the group: the last group has 32 inputs
                      RoundTripCase{64, 96, 64, true}, RoundTripCase{64, 96, 64, false},
                      RoundTripCase{16, 328, 128, false}));

std::string error_of(const GptqTensorSet& set, int64_t n, int64_t k, int group) {
  try {
    int4_from_gptq(set, n, k, group, true, "model.layers.3.mlp.down_proj");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Int4Gptq, MalformedCheckpointErrorsNameTheTensor) {
  std::mt19937 rng(13);
  const int64_t n = 16, k = 64;
  const int group = 32;
  std::vector<float> w(size_t(n * k));
  std::normal_distribution<float> d;
  for (auto& x : w) x = d(rng);
  Packed t(quantize_gptq_int4(w.data(), n, k, group, false), n, k);
  const std::string pre = "model.layers.3.mlp.down_proj";
  ASSERT_EQ(error_of(t.set(), n, k, group), "(no error)");

  TensorInfo transposed = t.qweight;  // [N, K/8] instead of [K/8, N]
  transposed.shape = {n, k / 8};
  EXPECT_NE(error_of({&transposed, &t.qzeros, &t.scales, &t.g_idx}, n, k, group).find(pre + ".qweight"),
            std::string::npos) << error_of({&transposed, &t.qzeros, &t.scales, &t.g_idx}, n, k, group);

  TensorInfo as_f32 = t.qweight;
  as_f32.dtype = DType::F32;
  std::string e = error_of({&as_f32, &t.qzeros, &t.scales, &t.g_idx}, n, k, group);
  EXPECT_NE(e.find(pre + ".qweight"), std::string::npos) << e;

  e = error_of({&t.qweight, &t.qzeros, nullptr, &t.g_idx}, n, k, group);
  EXPECT_NE(e.find(pre + ".scales"), std::string::npos) << e;

  e = error_of({&t.qweight, nullptr, &t.scales, &t.g_idx}, n, k, group);
  EXPECT_NE(e.find(pre + ".qzeros"), std::string::npos) << e;

  // desc_act: a permuted g_idx (still a valid group per input) is refused.
  std::vector<int32_t> perm = t.p.g_idx;
  std::swap(perm[1], perm[40]);
  TensorInfo g_perm = view("w.g_idx", DType::I32, {k}, perm);
  e = error_of({&t.qweight, &t.qzeros, &t.scales, &g_perm}, n, k, group);
  EXPECT_NE(e.find(pre + ".g_idx"), std::string::npos) << e;
  EXPECT_NE(e.find("desc_act"), std::string::npos) << e;

  // N or K not a multiple of 8.
  e = error_of(t.set(), 12, k, group);
  EXPECT_NE(e.find(pre), std::string::npos) << e;
  e = error_of(t.set(), n, 60, group);
  EXPECT_NE(e.find(pre), std::string::npos) << e;

  // scales of the wrong shape (per-output instead of per-group).
  TensorInfo flat = t.scales;
  flat.shape = {n};
  e = error_of({&t.qweight, &t.qzeros, &flat, &t.g_idx}, n, k, group);
  EXPECT_NE(e.find(pre + ".scales"), std::string::npos) << e;
}

TEST(Int4Gptq, F32ScalesAccepted) {
  // Some writers keep scales in the layer dtype; the value read must be the same.
  std::mt19937 rng(14);
  const int64_t n = 8, k = 64;
  std::vector<float> w(size_t(n * k));
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (auto& x : w) x = u(rng);
  Packed t(quantize_gptq_int4(w.data(), n, k, 32, true), n, k);
  std::vector<float> s32;
  for (uint16_t h : t.p.scales) s32.push_back(f16_to_f32(h));
  TensorInfo f32 = view("w.scales", DType::F32, {t.p.n_groups, n}, s32);
  auto a = dequantize(int4_from_gptq(t.set(), n, k, 32, true, "w"));
  auto b = dequantize(int4_from_gptq({&t.qweight, &t.qzeros, &f32, nullptr}, n, k, 32, true, "w"));
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace nibble
