// The ring-stage layout of the streamed INT4 products (kernels/int4_stream_layout.h), proved on
// the CPU: every bulk copy of a tile is 16-byte aligned and a multiple of 16 bytes at both ends,
// the parts of a stage do not overlap and fit it, a quarter-warp's 16-byte loads of two staged rows
// fall in distinct banks, the consumer warps take every group of every tile of a batch exactly
// once, and Qwen3-30B-A3B's shapes fit a batch of stages in a Blackwell GPU's 99 KB a block.
#include "kernels/int4_stream_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

namespace nibble::kernels {
namespace {

// One chunk, Qwen3-30B-A3B's K (768: a partial quad; 2048; 4096), a partial last quad (4352), and
// nine quads (9216: a warp's second quad with 8 warps).
constexpr int64_t kKs[] = {256, 768, 1024, 2048, 4096, 4352, 9216};
constexpr int64_t kGroups[] = {32, 64, 128, -1};  // -1: one group spans K

int64_t groups_of(int64_t k, int64_t group) { return group > 0 ? k / group : 1; }

TEST(Int4StreamLayout, CopiesAreAlignedAndDisjoint) {
  for (int64_t k : kKs)
    for (int64_t group : kGroups)
      for (bool zeros : {false, true}) {
        SCOPED_TRACE(testing::Message() << "k=" << k << " group=" << group << " zeros=" << zeros);
        const int64_t n_groups = groups_of(k, group), stride = int4_stream_row_stride(k);
        const int64_t row_bytes = k / 2, scale_bytes = 32 * n_groups, zero_bytes = zeros ? 16 * n_groups : 0;
        EXPECT_EQ(row_bytes % 16, 0);
        EXPECT_EQ(stride % 16, 0);
        EXPECT_GE(stride, row_bytes);
        EXPECT_LE(15 * stride + row_bytes, int4_stream_scales_offset(k));
        EXPECT_EQ(int4_stream_scales_offset(k) % 16, 0);
        EXPECT_EQ(scale_bytes % 16, 0);
        EXPECT_LE(int4_stream_scales_offset(k) + scale_bytes, int4_stream_zeros_offset(k, n_groups));
        EXPECT_EQ(int4_stream_zeros_offset(k, n_groups) % 16, 0);
        EXPECT_EQ(zero_bytes % 16, 0);
        const int64_t stage = int4_stream_stage_bytes(k, n_groups, zeros);
        EXPECT_LE(int4_stream_zeros_offset(k, n_groups) + zero_bytes, stage);
        EXPECT_EQ(stage % 128, 0);
        // The sources: tile t's codes, scales and zero points start 16 t rows into each array.
        for (int64_t t : {1, 7, 320}) {
          EXPECT_EQ(16 * t * row_bytes % 16, 0);
          EXPECT_EQ(16 * t * n_groups * 2 % 16, 0);
          EXPECT_EQ(16 * t * n_groups % 16, 0);
        }
        // Consecutive stages and the staged row after them stay 16-byte aligned.
        for (int stages : {1, 2, 3, 8})
          for (int warps : {4, 8}) EXPECT_EQ(int4_stream_x_offset(k, n_groups, zeros, stages, warps) % 16, 0);
      }
}

TEST(Int4StreamLayout, QuarterWarpLoadsAreConflictFree) {
  // Thread (g, t) loads the 16 bytes at row g's start + 512 q + 16 (t + 4i) of a whole quad q (and
  // the same of row g + 8). A warp's 16-byte loads go in four phases of 8 lanes (g = 2p, 2p + 1;
  // t = 0..3): conflict-free when their 8 addresses lie in distinct 16-byte slots of a 128-byte
  // bank cycle.
  for (int64_t k : kKs) {
    const int64_t stride = int4_stream_row_stride(k);
    for (int64_t q = 0; q < k / 1024; ++q)
      for (int i = 0; i < 8; ++i)
        for (int h = 0; h < 2; ++h)
          for (int p = 0; p < 4; ++p) {
            std::set<int64_t> slots;
            for (int g = 2 * p; g < 2 * p + 2; ++g)
              for (int t = 0; t < 4; ++t) slots.insert(((g + 8 * h) * stride + 512 * q + 16 * (t + 4 * i)) % 128 / 16);
            EXPECT_EQ(slots.size(), 8u) << "k=" << k << " q=" << q << " i=" << i << " h=" << h << " p=" << p;
          }
  }
}

TEST(Int4StreamLayout, WarpsTakeEveryGroupOfABatchOnce) {
  for (int64_t k : kKs)
    for (int warps : {4, 8}) {
      const int quads = int4_stream_quads(k), tile_warps = int4_stream_tile_warps(k, warps);
      const int batch = int4_stream_batch(k, warps);
      ASSERT_GE(batch, 1);
      ASSERT_LE(batch * tile_warps, warps);
      std::vector<int> taken(size_t(batch * quads), 0);
      for (int w = 0; w < warps; ++w) {
        const int slot = w / tile_warps;
        if (slot >= batch) continue;  // idle
        for (int q = w % tile_warps; q < quads; q += tile_warps) ++taken[size_t(slot * quads + q)];
      }
      for (int v : taken) EXPECT_EQ(v, 1) << "k=" << k << " warps=" << warps;
      // The partial sums of a batch ([batch][tile warps][16] floats) fit the region before the row.
      for (int stages : {1, 4}) {
        const int64_t ring = stages * (int4_stream_stage_bytes(k, k / 128 > 0 ? k / 128 : 1, true) + 16);
        EXPECT_GE(int4_stream_x_offset(k, k / 128 > 0 ? k / 128 : 1, true, stages, warps) - ring,
                  int64_t(batch) * tile_warps * 16 * 4);
      }
    }
}

TEST(Int4StreamLayout, QwenShapesFitABatchOfStagesOnBlackwell) {
  // The launcher takes the streamed kernel only with at least `batch` stages (the ring's phases
  // stay in order for the warps of a batch). Qwen3-30B-A3B's GEMV shapes, group 128, symmetric:
  // the ring, the partial sums, the staged row (2 (k + 16) bytes) and 2 KB of slack fit the
  // 99 KB a block may opt in to on sm_120 / sm_121.
  for (int64_t k : {768, 2048, 4096}) {
    const int batch = int4_stream_batch(k, 8);
    const int64_t bytes = int4_stream_x_offset(k, k / 128, false, batch, 8) + 2 * (k + 16) + 2048;
    EXPECT_LE(bytes, 99 * 1024) << "k=" << k << " batch=" << batch;
  }
}

}  // namespace
}  // namespace nibble::kernels
