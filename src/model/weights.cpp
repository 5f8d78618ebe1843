#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/status.h"

namespace nibble {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF32: return "F32";
    case WeightFormat::kF16: return "F16";
    case WeightFormat::kBF16: return "BF16";
    case WeightFormat::kInt4: return "INT4";
    case WeightFormat::kMxfp4: return "MXFP4";
  }
  return "?";
}

void LinearWeight::row_f32(int64_t row, float* out) const {
  NIBBLE_ASSERT(row >= 0 && row < n);
  switch (format) {
    case WeightFormat::kF32:
      std::memcpy(out, static_cast<const float*>(dense) + row * k, size_t(k) * 4);
      return;
    case WeightFormat::kF16: {
      const uint16_t* p = static_cast<const uint16_t*>(dense) + row * k;
      for (int64_t i = 0; i < k; ++i) out[i] = f16_to_f32(p[i]);
      return;
    }
    case WeightFormat::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(dense) + row * k;
      for (int64_t i = 0; i < k; ++i) out[i] = bf16_to_f32(p[i]);
      return;
    }
    case WeightFormat::kInt4:
      NIBBLE_ASSERT(int4.layout == Int4Layout::kRowMajor);
      dequantize_int4_row(int4.codes, int4.scales, int4.zeros, k, int4.group_size, int4.n_groups,
                          row, out);
      return;
    case WeightFormat::kMxfp4:
      NIBBLE_ASSERT(mxfp4.layout == Mxfp4Layout::kRowMajor);
      dequantize_mxfp4_row(mxfp4.codes, mxfp4.scales, k, row, out);
      return;
  }
}

LinearWeight view_dense(const std::string& name, const TensorInfo& t, int64_t offset_rows,
                        int64_t n, int64_t k) {
  LinearWeight w;
  switch (t.dtype) {
    case DType::F32: w.format = WeightFormat::kF32; break;
    case DType::F16: w.format = WeightFormat::kF16; break;
    case DType::BF16: w.format = WeightFormat::kBF16; break;
    default:
      fail("{}: tensor '{}' has dtype {}; a dense weight must be F32, F16 or BF16", t.file, t.name,
           dtype_name(t.dtype));
  }
  NIBBLE_ASSERT((offset_rows + n) * k <= t.numel());
  w.name = name;
  w.n = n;
  w.k = k;
  w.dense = t.data + size_t(offset_rows * k) * dtype_size_bytes(t.dtype);
  return w;
}

LinearWeight int4_weight(const std::string& name, Int4Matrix matrix) {
  auto owned = std::make_shared<const Int4Matrix>(std::move(matrix));
  LinearWeight w;
  w.name = name;
  w.n = owned->n;
  w.k = owned->k;
  w.format = WeightFormat::kInt4;
  w.int4 = {Int4Layout::kRowMajor, owned->codes.data(), owned->scales.data(), owned->zeros.data(),
            owned->group_size, owned->n_groups};
  w.storage.push_back(owned);
  return w;
}

LinearWeight mxfp4_weight(const std::string& name, Mxfp4Matrix matrix) {
  auto owned = std::make_shared<const Mxfp4Matrix>(std::move(matrix));
  LinearWeight w;
  w.name = name;
  w.n = owned->n;
  w.k = owned->k;
  w.format = WeightFormat::kMxfp4;
  w.mxfp4 = {owned->codes.data(), owned->scales.data()};
  w.storage.push_back(owned);
  return w;
}

float moe_activation(MoeActivation act, float gate, float up, float alpha, float limit) {
  if (act == MoeActivation::kSiluMul) return gate / (1.f + std::exp(-gate)) * up;
  const float g = std::min(gate, limit), u = std::clamp(up, -limit, limit);
  return (u + 1.f) * g / (1.f + std::exp(-alpha * g));
}

WeightVector host_vector(std::vector<float> values) {
  auto owned = std::make_shared<const std::vector<float>>(std::move(values));
  return {owned->data(), int64_t(owned->size()), owned};
}

size_t LinearWeight::bytes() const {
  switch (format) {
    case WeightFormat::kF32: return size_t(n * k * 4);
    case WeightFormat::kF16:
    case WeightFormat::kBF16: return size_t(n * k * 2);
    case WeightFormat::kInt4:  // as stored in checkpoints: 4-bit codes, f16 scales, 4-bit zeros
      return size_t(n * ((k + 1) / 2) + n * int4.n_groups * 2 + n * int4.n_groups / 2);
    case WeightFormat::kMxfp4:  // codes and one scale byte per 32
      return size_t(n * k / 2 + n * k / kMxfp4Block);
  }
  return 0;
}

}  // namespace nibble
