// Where an INT4 tile sits in a ring stage of the streamed INT4 products (kernels/int4_stream.cuh),
// and how the consumer warps split tiles: plain constexpr arithmetic shared by the kernel, its
// launcher and a CPU unit test (tests/unit/int4_stream_layout_test.cpp) that proves the layout's
// invariants (every bulk copy 16-byte aligned and a multiple of 16 bytes, no two parts of a stage
// overlapping, rows padded so a quarter-warp's 16-byte loads are conflict-free, the warps' split
// covering every group of every tile once).
//
// A stage, for one 16-row tile over all of K (k % 256 == 0, n_groups groups of each row):
//   16 code rows of k/2 bytes, each at a stride padded to 64 mod 128 bytes;
//   the tile's scales [16][n_groups] f16; its zero points [16][n_groups] bytes (when present);
//   rounded up to 128 bytes.
#pragma once

#include <cstdint>

#include "kernels/gemm_layout.h"  // NIBBLE_HD

namespace nibble::kernels {

NIBBLE_HD constexpr int64_t int4_stream_row_stride(int64_t k) { return k / 2 + (192 - (k / 2) % 128) % 128; }
NIBBLE_HD constexpr int64_t int4_stream_scales_offset(int64_t k) { return 16 * int4_stream_row_stride(k); }
NIBBLE_HD constexpr int64_t int4_stream_zeros_offset(int64_t k, int64_t n_groups) {
  return int4_stream_scales_offset(k) + 32 * n_groups;
}
NIBBLE_HD constexpr int64_t int4_stream_stage_bytes(int64_t k, int64_t n_groups, bool zeros) {
  return (int4_stream_zeros_offset(k, n_groups) + (zeros ? 16 * n_groups : 0) + 127) / 128 * 128;
}

// A lane's 16-byte unit holds one word of each of 4 chunks, so a warp owns whole groups of 1024 k
// ("quads"; a last one may be partial): a tile keeps min(quads, warps) warps busy, and the
// consumers take warps / that many landed tiles at once (warp w: tile w / tile_warps of the batch,
// groups w % tile_warps, + tile_warps, ...; warps past batch · tile_warps idle).
NIBBLE_HD constexpr int int4_stream_quads(int64_t k) { return int((k / 256 + 3) / 4); }
NIBBLE_HD constexpr int int4_stream_tile_warps(int64_t k, int warps) {
  return int4_stream_quads(k) < warps ? int4_stream_quads(k) : warps;
}
NIBBLE_HD constexpr int int4_stream_batch(int64_t k, int warps) { return warps / int4_stream_tile_warps(k, warps); }

// Dynamic shared memory before the staged activation row: the ring, two mbarriers a stage, the
// partial sums of a batch ([batch][tile warps][16] floats, at most warps · 16).
NIBBLE_HD constexpr int64_t int4_stream_x_offset(int64_t k, int64_t n_groups, bool zeros, int stages, int warps) {
  return stages * (int4_stream_stage_bytes(k, n_groups, zeros) + 16) + int64_t(warps) * 16 * 4;
}

}  // namespace nibble::kernels
