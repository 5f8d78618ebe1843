// MXFP4 (OCP Microscaling, as gpt-oss checkpoints store their experts; FORMATS.md §5): blocks of 32
// values along K, each value an E2M1 code (1 sign, 2 exponent, 1 mantissa bit: ±{0, 0.5, 1, 1.5,
// 2, 3, 4, 6}) and one E8M0 scale byte per block (2^(byte - 127)). Byte j of a block holds element
// 2j in its low nibble and 2j+1 in its high nibble.
//
// The checkpoint tensors `<name>_blocks` U8 [..., N, K/32, 16] and `<name>_scales` U8 [..., N, K/32]
// are already row-major by output channel, which is nibble's CPU layout: a weight is a view into
// the mapped file, codes [n][k/2] and scales [n][k/32].
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace nibble {

constexpr int64_t kMxfp4Block = 32;

// The 16 E2M1 values by code (bit 3 is the sign).
inline constexpr float kE2m1Values[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                          -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// 2^(byte - 127); byte 255 is NaN in the format.
float e8m0_to_f32(uint8_t byte);

// The E2M1 code nearest to x (x already divided by its block's scale; ties to the even code, as
// round-to-nearest-even; beyond ±6 saturates).
uint8_t f32_to_e2m1(float x);

// Row `row` of an MXFP4 matrix [n, k] (k a multiple of 32) as f32.
void dequantize_mxfp4_row(const uint8_t* codes, const uint8_t* scales, int64_t k, int64_t row, float* out);

struct Mxfp4Matrix {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> codes;   // [n][k/2]
  std::vector<uint8_t> scales;  // [n][k/32]
};

// Round-to-nearest quantization, a row at a time (row_f32 writes row `row` as f32; called from
// several threads). A block's scale is the smallest power of two that puts its largest magnitude
// within ±6, so nothing saturates: 2^ceil(log2(max|w| / 6)).
Mxfp4Matrix quantize_mxfp4(int64_t n, int64_t k, const std::function<void(int64_t row, float* out)>& row_f32);

}  // namespace nibble
