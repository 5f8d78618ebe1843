#include "backend/cuda/int4_layout.h"

#include <algorithm>

#include "core/status.h"

namespace nibble::cuda {

Int4Interleaved interleave_int4(const Int4View& v, int64_t n, int64_t k) {
  NIBBLE_ASSERT(v.layout == Int4Layout::kRowMajor && int4_interleavable(k, v.group_size));
  Int4Interleaved out;
  const int64_t row_bytes = k / 2, chunks = k / 256;
  out.codes.assign(size_t(n * row_bytes), 0);
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* src = v.codes + row * row_bytes;
    uint8_t* dst = out.codes.data() + row * row_bytes;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t c0 = c / 4 * 4, words = std::min<int64_t>(4, chunks - c0);
      for (int lane = 0; lane < 32; ++lane) {
        uint32_t word = 0;
        for (int j = 0; j < 8; ++j) {
          const int64_t i = 256 * c + lane + 32 * j;
          word |= uint32_t((src[i / 2] >> ((i & 1) * 4)) & 0xF) << (4 * j);
        }
        uint8_t* w = dst + c0 * 128 + (lane * words + (c - c0)) * 4;
        for (int b = 0; b < 4; ++b) w[b] = uint8_t(word >> (8 * b));
      }
    }
  }
  const int64_t groups = n * v.n_groups;
  const bool symmetric =
      !v.zeros || std::all_of(v.zeros, v.zeros + groups, [](uint8_t z) { return z == 8; });
  if (!symmetric) out.zeros.assign(v.zeros, v.zeros + groups);
  return out;
}

}  // namespace nibble::cuda
