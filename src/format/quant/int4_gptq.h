// INT4 weight-only quantization in the GPTQ checkpoint format (AutoGPTQ, GPTQModel, AutoRound's
// auto_gptq packing), and nibble's own CPU layout for it.
//
// Checkpoint layout for a Linear with N outputs, K inputs, group size G (FORMATS.md §1):
//   qweight I32 [K/8, N]        nibble j of qweight[r, n] = code of input 8r+j, output n
//   qzeros  I32 [ceil(K/G), N/8] nibble j of qzeros[g, c] = zero of output 8c+j (v1: stored zero-1)
//   scales  F16 [ceil(K/G), N]
//   g_idx   I32 [K] (optional; must be k/G: activation reordering is not supported)
//   W[n, k] = (code[k, n] - zero[k/G, n]) * scale[k/G, n]
// The checkpoint layout is converted once at load into Int4Matrix, row-major by output channel,
// which is what a dot product per output needs; kernels never see checkpoint layouts.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace nibble {

// Row `row` of a row-major INT4 matrix as f32: out[i] = (code - zero[g]) * scale[g], g = i / group,
// with scales as f16 bits (what GPTQ checkpoints store, so they are kept exactly); zeros may be
// null (symmetric: zero point 8).
void dequantize_int4_row(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, int64_t k,
                         int64_t group_size, int64_t n_groups, int64_t row, float* out);

struct Int4Matrix {
  int64_t n = 0, k = 0, group_size = 0, n_groups = 0;
  std::vector<uint8_t> codes;  // [n][(k+1)/2]: input 2i in the low nibble, 2i+1 in the high one
  std::vector<uint16_t> scales;  // f16 [n][n_groups] (BF16/F32 checkpoint scales are rounded)
  std::vector<uint8_t> zeros;  // [n][n_groups]: the true zero point, 0..15

  int64_t row_bytes() const { return (k + 1) / 2; }
  void dequantize_row(int64_t row, float* out) const;  // out[k]
};

struct GptqTensorSet {
  const TensorInfo* qweight = nullptr;
  const TensorInfo* qzeros = nullptr;
  const TensorInfo* scales = nullptr;
  const TensorInfo* g_idx = nullptr;  // may be absent
};

// Validates shapes and dtypes against (n, k, group_size) and repacks. `prefix` names the module in
// errors. group_size -1 means one group over all of K.
Int4Matrix int4_from_gptq(const GptqTensorSet& t, int64_t n, int64_t k, int group_size,
                          bool zero_minus_one, const std::string& prefix);

// Round-to-nearest quantization of a row-major [n, k] float matrix into GPTQ v1 tensors, with the
// GPTQ quantizer's conventions (symmetric: zero 8, scale = 2·max|w|/15; asymmetric: the range is
// widened to include 0). Scales are rounded to f16 before the codes are chosen, so dequantizing the
// written tensors reproduces exactly what the codes were fitted to.
struct GptqPacked {
  std::vector<int32_t> qweight;  // [k/8, n]
  std::vector<int32_t> qzeros;   // [n_groups, n/8]
  std::vector<uint16_t> scales;  // f16 [n_groups, n]
  std::vector<int32_t> g_idx;    // [k]
  int64_t n_groups = 0;
};
GptqPacked quantize_gptq_int4(const float* w, int64_t n, int64_t k, int group_size, bool sym);

// The same quantization straight into nibble's layout, a row at a time (row_f32 writes row `row`
// of W as f32; called from several threads): --quantize-layers at load.
Int4Matrix quantize_int4(int64_t n, int64_t k, int group_size, bool sym,
                         const std::function<void(int64_t row, float* out)>& row_f32);

}  // namespace nibble
