// The CUDA flash-attention prefill (kernels/flash_attention.cuh: m > 8 query tokens, head_dim 64 or
// 128, GQA group <= 8) against the CPU reference, through Backend::attention: random q/k/v, outputs
// poisoned with NaN (an element the kernel forgets fails), causal positions pos0 + t, a max_context
// above the real context, paged K/V caches (f16 unless stated) holding exactly pos0 + m positions
// in shuffled blocks, NaN everywhere else (a read past the context shows up as NaN). Without a GPU the tests report as skipped.
//
// Tolerance: the kernel rounds q, k, p (the softmax numerators) and v to f16, unit roundoff
// u = 2^-11 = 4.9e-4, and sums in f32. A score s = scale·q·k then errs by at most
// 2u·scale·Σ|q_i k_i|; the rounding errors have independent signs, so for these inputs (uniform in
// [-1, 1]: scale·sqrt(Σ(q_i k_i)²) ≈ 1/3) about 2u/3 ≈ 3e-4 per score, with a few-sigma tail to
// ~1e-3 over millions of scores. exp turns that into the same relative error of p; rounding p and v
// adds u each. The output is a convex combination of v rows, so its error relative to max|out| is
// bounded by about δs + 2u ≈ 1.3e-3 in the worst element; 2e-3 leaves margin while a wrong mask,
// row or scale gives errors of order 1. (A CPU emulation of the kernel measured ≤ 4e-4.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "backend/backend.h"
#include "core/status.h"
#include "gpu_compare.h"

#include <fmt/format.h>

namespace nibble {
namespace {

constexpr double kFlashTolerance = 2e-3;

class FlashAttentionTest : public GpuCompareTest {
 protected:
  FlashAttentionTest() : GpuCompareTest(4321) {}

  using Shape = AttentionShape;
  // positions: pos0 + t, or (shuffled) the same set in random order (the kernel must not rely on
  // ascending positions for correctness).
  void check(Shape s, int64_t m, int64_t pos0, bool shuffled = false, DType kv_dtype = DType::F16) {
    std::vector<int32_t> positions(static_cast<size_t>(m));
    for (int64_t t = 0; t < m; ++t) positions[size_t(t)] = int32_t(pos0 + t);
    if (shuffled) std::shuffle(positions.begin(), positions.end(), rng_);
    expect_attention_close(s, positions, pos0 + m, pos0 + m + 300,
                           fmt::format("flash attention {}/{}x{} m={} pos0={}{}", s.n_head, s.n_head_kv,
                                       s.head_dim, m, pos0, shuffled ? " shuffled" : ""),
                           kFlashTolerance, kv_dtype);
    release_buffers();
  }
};

// Qwen3-30B-A3B (32 q / 4 kv heads x 128: group 8, 16 tokens per block), no GQA at head_dim 64
// (group 1, 128 tokens per block) and group 8 with 2 kv heads. m = 9: one partial block; 300 and
// 2048: many blocks, contexts that are not multiples of the 32-position K/V tile with pos0 = 70.
TEST_F(FlashAttentionTest, MatchesCpu) {
  for (Shape s : {Shape{32, 4, 128}, Shape{8, 8, 64}, Shape{16, 2, 128}})
    for (int64_t m : {9, 64, 300, 2048})
      for (int64_t pos0 : {0, 70, 1000}) check(s, m, pos0);
}

// f32 K/V pools (converted to f16 as the tiles are staged).
TEST_F(FlashAttentionTest, F32Cache) {
  for (Shape s : {Shape{32, 4, 128}, Shape{8, 8, 64}})
    for (int64_t m : {9, 300}) check(s, m, 70, false, DType::F32);
}

// E4M3 K/V pools (--kv-cache-dtype fp8: converted to f16 exactly as the tiles are staged).
TEST_F(FlashAttentionTest, E4m3Cache) {
  for (Shape s : {Shape{32, 4, 128}, Shape{8, 8, 64}})
    for (int64_t m : {9, 300}) check(s, m, 70, false, DType::F8_E4M3);
}

// Positions in random order: each block's causal limit is the max over its rows, every row masks
// on its own position.
TEST_F(FlashAttentionTest, UnorderedPositions) {
  check(Shape{32, 4, 128}, 300, 70, true);
  check(Shape{8, 8, 64}, 64, 0, true);
  check(Shape{16, 4, 128}, 40, 1000, true);  // group 4: 32 tokens per block
}

}  // namespace
}  // namespace nibble
