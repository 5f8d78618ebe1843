#include "format/quant/int4_gptq.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/status.h"

namespace nibble {

void dequantize_int4_row(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, int64_t k,
                         int64_t group_size, int64_t n_groups, int64_t row, float* out) {
  const uint8_t* c = codes + row * ((k + 1) / 2);
  const uint16_t* s = scales + row * n_groups;
  const uint8_t* z = zeros ? zeros + row * n_groups : nullptr;
  for (int64_t i = 0; i < k; ++i) {
    const int code = (c[i / 2] >> ((i & 1) * 4)) & 0xF;
    const int64_t g = i / group_size;
    out[i] = float(code - (z ? int(z[g]) : 8)) * f16_to_f32(s[g]);
  }
}

void Int4Matrix::dequantize_row(int64_t row, float* out) const {
  dequantize_int4_row(codes.data(), scales.data(), zeros.data(), k, group_size, n_groups, row, out);
}

namespace {

void expect(const TensorInfo* t, const std::string& name, DType dtype, std::vector<int64_t> shape) {
  NIBBLE_CHECK(t != nullptr, "checkpoint: tensor '{}' is missing", name);
  NIBBLE_CHECK(t->dtype == dtype, "{}: tensor '{}' has dtype {}, expected {}", t->file, name,
               dtype_name(t->dtype), dtype_name(dtype));
  NIBBLE_CHECK(t->shape == shape, "{}: tensor '{}' has shape {}, config expects {}", t->file, name,
               t->shape_str(), shape_str(shape));
}

template <typename T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

Int4Matrix int4_from_gptq(const GptqTensorSet& t, int64_t n, int64_t k, int group_size,
                          bool zero_minus_one, const std::string& prefix) {
  NIBBLE_CHECK(k % 8 == 0 && n % 8 == 0, "checkpoint: '{}' is [{}, {}]; GPTQ packing needs both "
               "dimensions to be multiples of 8", prefix, n, k);
  Int4Matrix m;
  m.n = n;
  m.k = k;
  m.group_size = group_size > 0 ? group_size : k;
  m.n_groups = (k + m.group_size - 1) / m.group_size;
  expect(t.qweight, prefix + ".qweight", DType::I32, {k / 8, n});
  expect(t.qzeros, prefix + ".qzeros", DType::I32, {m.n_groups, n / 8});
  NIBBLE_CHECK(t.scales != nullptr, "checkpoint: tensor '{}.scales' is missing", prefix);
  NIBBLE_CHECK(t.scales->dtype == DType::F16 || t.scales->dtype == DType::BF16 ||
               t.scales->dtype == DType::F32, "{}: tensor '{}.scales' has dtype {}, expected F16, "
               "BF16 or F32", t.scales->file, prefix, dtype_name(t.scales->dtype));
  expect(t.scales, prefix + ".scales", t.scales->dtype, {m.n_groups, n});
  if (t.g_idx) {
    expect(t.g_idx, prefix + ".g_idx", DType::I32, {k});
    for (int64_t i = 0; i < k; ++i) {
      int32_t g = load_le<int32_t>(t.g_idx->data + 4 * i);
      NIBBLE_CHECK(g == i / m.group_size, "{}: tensor '{}.g_idx'[{}] = {} but {} was expected: "
                   "activation reordering (desc_act) is not supported", t.g_idx->file, prefix, i, g,
                   i / m.group_size);
    }
  }
  m.codes.assign(size_t(n * m.row_bytes()), 0);
  m.scales.resize(size_t(n * m.n_groups));
  m.zeros.resize(size_t(n * m.n_groups));
  const uint8_t* qw = t.qweight->data;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 20))
  for (int64_t r = 0; r < k / 8; ++r) {
    for (int64_t col = 0; col < n; ++col) {
      uint32_t word = load_le<uint32_t>(qw + 4 * (r * n + col));
      uint8_t* dst = m.codes.data() + col * m.row_bytes() + r * 4;
      for (int j = 0; j < 4; ++j) dst[j] = uint8_t((word >> (8 * j)) & 0xFF);  // 8 nibbles, in order
    }
  }
  for (int64_t g = 0; g < m.n_groups; ++g) {
    for (int64_t col = 0; col < n; ++col) {
      const uint8_t* p = t.scales->data + (g * n + col) * dtype_size_bytes(t.scales->dtype);
      uint16_t s = t.scales->dtype == DType::F16    ? load_le<uint16_t>(p)
                   : t.scales->dtype == DType::BF16 ? f32_to_f16(bf16_to_f32(load_le<uint16_t>(p)))
                                                    : f32_to_f16(load_le<float>(p));
      m.scales[col * m.n_groups + g] = s;
      uint32_t word = load_le<uint32_t>(t.qzeros->data + 4 * (g * (n / 8) + col / 8));
      uint32_t stored = (word >> (4 * (col % 8))) & 0xF;
      m.zeros[col * m.n_groups + g] = uint8_t(zero_minus_one ? (stored + 1) & 0xF : stored);
    }
  }
  return m;
}

namespace {
// One group of `count` weights to 4-bit codes with the GPTQ quantizer's conventions (see the header).
void quantize_group(const float* w, int64_t count, bool sym, uint8_t* codes, uint16_t& scale_out, uint8_t& zero_out) {
  float lo = 0.f, hi = 0.f;  // the range always includes 0, as in GPTQ
  for (int64_t i = 0; i < count; ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
  }
  float scale, zero;
  if (sym) {
    float amax = std::max(-lo, hi);
    if (amax == 0.f) amax = 1.f;
    scale = 2.f * amax / 15.f;
    zero = 8.f;
  } else {
    if (lo == 0.f && hi == 0.f) lo = -1.f, hi = 1.f;
    scale = (hi - lo) / 15.f;
    zero = 0.f;  // set below from the rounded scale
  }
  uint16_t scale_f16 = f32_to_f16(scale);
  scale = f16_to_f32(scale_f16);
  if (scale == 0.f) {  // below f16's range: the group is ~0, any scale represents it
    scale_f16 = f32_to_f16(1e-7f);
    scale = f16_to_f32(scale_f16);
  }
  if (!sym) zero = std::clamp(std::nearbyint(-lo / scale), 0.f, 15.f);
  for (int64_t i = 0; i < count; ++i) codes[i] = uint8_t(std::clamp(std::nearbyint(w[i] / scale) + zero, 0.f, 15.f));
  scale_out = scale_f16;
  zero_out = uint8_t(zero);
}
}  // namespace

GptqPacked quantize_gptq_int4(const float* w, int64_t n, int64_t k, int group_size, bool sym) {
  NIBBLE_ASSERT(k % 8 == 0 && n % 8 == 0);
  const int64_t g_size = group_size > 0 ? group_size : k;
  GptqPacked out;
  out.n_groups = (k + g_size - 1) / g_size;
  out.qweight.assign(size_t(k / 8 * n), 0);
  out.qzeros.assign(size_t(out.n_groups * n / 8), 0);
  out.scales.resize(size_t(out.n_groups * n));
  out.g_idx.resize(size_t(k));
  for (int64_t i = 0; i < k; ++i) out.g_idx[i] = int32_t(i / g_size);
  std::vector<uint8_t> zeros(static_cast<size_t>(out.n_groups * n));
#pragma omp parallel for schedule(static) if (n * k >= (1 << 20))
  for (int64_t row = 0; row < n; ++row) {
    const float* wr = w + row * k;
    std::vector<uint8_t> codes(static_cast<size_t>(k));
    for (int64_t g = 0; g < out.n_groups; ++g) {
      const int64_t begin = g * g_size, end = std::min(k, begin + g_size);
      quantize_group(wr + begin, end - begin, sym, codes.data() + begin, out.scales[g * n + row], zeros[g * n + row]);
    }
    for (int64_t r = 0; r < k / 8; ++r) {
      uint32_t word = 0;
      for (int j = 0; j < 8; ++j) word |= uint32_t(codes[r * 8 + j]) << (4 * j);
      out.qweight[r * n + row] = int32_t(word);
    }
  }
  for (int64_t g = 0; g < out.n_groups; ++g) {
    for (int64_t c = 0; c < n / 8; ++c) {
      uint32_t word = 0;
      for (int j = 0; j < 8; ++j)  // GPTQ v1 stores zero - 1
        word |= uint32_t((zeros[g * n + c * 8 + j] - 1) & 0xF) << (4 * j);
      out.qzeros[g * (n / 8) + c] = int32_t(word);
    }
  }
  return out;
}

Int4Matrix quantize_int4(int64_t n, int64_t k, int group_size, bool sym,
                         const std::function<void(int64_t row, float* out)>& row_f32) {
  Int4Matrix m;
  m.n = n;
  m.k = k;
  m.group_size = group_size > 0 ? group_size : k;
  m.n_groups = (k + m.group_size - 1) / m.group_size;
  m.codes.assign(size_t(n * m.row_bytes()), 0);
  m.scales.resize(size_t(n * m.n_groups));
  m.zeros.resize(size_t(n * m.n_groups));
#pragma omp parallel for schedule(static) if (n * k >= (1 << 20))
  for (int64_t row = 0; row < n; ++row) {
    std::vector<float> w(static_cast<size_t>(k));
    std::vector<uint8_t> codes(static_cast<size_t>(k));
    row_f32(row, w.data());
    for (int64_t g = 0; g < m.n_groups; ++g) {
      const int64_t begin = g * m.group_size, end = std::min(k, begin + m.group_size);
      quantize_group(w.data() + begin, end - begin, sym, codes.data() + begin, m.scales[size_t(row * m.n_groups + g)],
                     m.zeros[size_t(row * m.n_groups + g)]);
    }
    uint8_t* dst = m.codes.data() + row * m.row_bytes();
    for (int64_t i = 0; i < k; ++i) dst[i / 2] |= uint8_t(codes[size_t(i)] << (4 * (i % 2)));
  }
  return m;
}

}  // namespace nibble
