// The index arithmetic of the tensor-core GEMMs (kernels/gemm_layout.h), proved on the CPU: the
// k order of the W4A16 GEMM is a bijection, A and B agree on it (through the mma and ldmatrix
// fragment layouts of the PTX ISA), every mma step lies in one quantisation group, the weight word
// addresses match the warp-interleaved layout (and, in CUDA builds, the host interleaver that
// makes it), the B registers built from those words hold the right codes, and the shared-memory
// swizzles keep ldmatrix and the staging stores free of bank conflicts.
#include "kernels/gemm_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#if defined(NIBBLE_HAVE_CUDA)
#include "backend/cuda/int4_layout.h"
#endif

namespace nibble::kernels {
namespace {

// K sizes from one chunk to past two groups of 4 chunks, with partial last groups (768 = 3 chunks).
constexpr int64_t kChunkCounts[] = {1, 2, 3, 4, 5, 7, 8, 16};

TEST(GemmLayout, KOrderIsABijection) {
  for (int64_t chunks : kChunkCounts) {
    std::vector<int> seen(size_t(256 * chunks), 0);
    for (int64_t c = 0; c < chunks; ++c)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < kGemmStepsPerStage; ++j)
          for (int kappa = 0; kappa < 16; ++kappa) {
            const int64_t k = gemm_k(c, h, j, kappa);
            ASSERT_GE(k, 0);
            ASSERT_LT(k, 256 * chunks);
            ++seen[size_t(k)];
          }
    for (int64_t k = 0; k < 256 * chunks; ++k) ASSERT_EQ(seen[size_t(k)], 1) << "k " << k;
  }
  static_assert(kGemmStageK == kGemmStepsPerStage * 16 && 2 * kGemmStageK == 256);
}

TEST(GemmLayout, EveryMmaStepIsInOneGroup) {
  for (int64_t c = 0; c < 16; ++c)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < kGemmStepsPerStage; ++j)
        for (int shift = 5; shift <= 30; ++shift)  // G = 32 .. whole K (group_shift 30)
          for (int kappa = 0; kappa < 16; ++kappa)
            // the kernel stages one (scale, zero) per column and step: group (256c + 32j) >> shift
            ASSERT_EQ(gemm_k(c, h, j, kappa) >> shift, (256 * c + 32 * j) >> shift)
                << "c " << c << " h " << h << " j " << j << " G " << (1 << shift);
}

// B: thread `lane` holds b[r] half e = B[κ][n] with κ = mma_b_row; the kernel fills it from word
// σ = 2r + e of its four words, lane gemm_b_word_lane(h, σ, lane % 4), nibble j.
TEST(GemmLayout, BFragmentAgreesWithTheKOrder) {
  for (int64_t c = 0; c < 5; ++c)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < kGemmStepsPerStage; ++j)
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 2; ++r)
            for (int e = 0; e < 2; ++e) {
              const int kappa = mma_b_row(lane, r, e), sigma = 2 * r + e, t = lane % 4;
              EXPECT_EQ(gemm_kappa_sigma(kappa), sigma);
              EXPECT_EQ(gemm_kappa_t(kappa), t);
              EXPECT_EQ(int4_layout_k(c, gemm_b_word_lane(h, sigma, t), j), gemm_k(c, h, j, kappa));
            }
}

// A: the 8 inputs x[k0 + u] of unit kh of step j (k0 = 256c + 32j + 16h + 8kh) are stored at κ =
// gemm_a_kappa(kh, u); the kernel packs them as f16 pairs (u, u + 4) into the unit's 4 words.
TEST(GemmLayout, AStagingAgreesWithTheKOrder) {
  for (int64_t c = 0; c < 5; ++c)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < kGemmStepsPerStage; ++j)
        for (int kh = 0; kh < 2; ++kh)
          for (int u = 0; u < 8; ++u)
            EXPECT_EQ(gemm_k(c, h, j, gemm_a_kappa(kh, u)), 256 * c + 32 * j + 16 * h + 8 * kh + u);
  for (int kh = 0; kh < 2; ++kh)
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(gemm_a_kappa(kh, i), 8 * kh + 2 * i);          // low half of word i
      EXPECT_EQ(gemm_a_kappa(kh, i + 4), 8 * kh + 2 * i + 1);  // high half
    }
}

// ldmatrix .x4 gives thread l, register i, half e the element (row l / 4, column 2(l % 4) + e) of
// matrix i, whose row l / 4 was addressed by lane 8i + l / 4. That must be the mma fragment element.
TEST(GemmLayout, LdmatrixAddressesGiveTheMmaFragments) {
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 2; ++e) {
        const int src = 8 * i + l / 4, col = 2 * (l % 4) + e;
        EXPECT_EQ(ldsm_a_row(src), mma_a_row(l, i));
        EXPECT_EQ(8 * ldsm_a_khalf(src) + col, mma_a_col(l, i, e));
        // B: register i is b[i % 2] of n-tile i / 2
        EXPECT_EQ(ldsm_b_row(src), 8 * (i / 2) + mma_b_col(l));
        EXPECT_EQ(8 * ldsm_b_khalf(src) + col, mma_b_row(l, i % 2, e));
      }
}

// The documented layout, written independently: [lane][4 words] per group of 4 chunks, a last
// partial group of r chunks as [lane][r words].
TEST(GemmLayout, WordOffsetsFollowTheInterleavedLayout) {
  for (int64_t chunks : kChunkCounts) {
    std::set<int64_t> offsets;
    for (int64_t c = 0; c < chunks; ++c)
      for (int lane = 0; lane < 32; ++lane) {
        const int64_t group = c / 4, words = std::min<int64_t>(4, chunks - 4 * group);
        const int64_t want = group * 512 + lane * 4 * words + (c - 4 * group) * 4;
        const int64_t got = int4_word_offset(chunks, c, lane);
        EXPECT_EQ(got, want);
        // the kernel's split: a per-stage base plus lane · 4 · words
        EXPECT_EQ(got, (c / 4 * 4) * 128 + (c % 4) * 4 + lane * 4 * words);
        offsets.insert(got);
      }
    EXPECT_EQ(int64_t(offsets.size()), 32 * chunks);
    EXPECT_EQ(*offsets.rbegin(), 128 * chunks - 4);
  }
}

// The kernel's B registers: prmt(w_σ0, w_σ1) with 0x5410 (nibbles 0-3) or 0x7632 (4-7), shifted by
// 4(j % 4), masked with 0x000F000F: low half nibble j of w_σ0, high half nibble j of w_σ1.
uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t selector) {
  const uint64_t bytes = uint64_t(y) << 32 | x;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= uint32_t(bytes >> (8 * ((selector >> (4 * i)) & 7)) & 0xFF) << (8 * i);
  return out;
}

TEST(GemmLayout, BRegisterPairsNibbleJOfTwoWords) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 100; ++trial) {
    const uint32_t w0 = rng(), w1 = rng();
    for (int j = 0; j < 8; ++j) {
      const uint32_t x = byte_perm(w0, w1, j < 4 ? 0x5410 : 0x7632) >> (4 * (j % 4)) & 0x000F000F;
      EXPECT_EQ(x & 0xF, (w0 >> (4 * j)) & 0xF);
      EXPECT_EQ(x >> 16, (w1 >> (4 * j)) & 0xF);
    }
  }
}

#if defined(NIBBLE_HAVE_CUDA)
// The interleaver that makes the layout at upload (host code, no GPU needed) against the word
// addresses the GEMM reads, nibble by nibble.
TEST(GemmLayout, WordOffsetsMatchTheHostInterleaver) {
  std::mt19937 rng(11);
  for (int64_t chunks : {1, 3, 4, 5, 8}) {
    const int64_t n = 3, k = 256 * chunks;
    std::vector<uint8_t> codes(size_t(n * k / 2));
    for (auto& b : codes) b = uint8_t(rng());
    std::vector<uint16_t> scales(size_t(n), 0x3C00);
    Int4View view;
    view.codes = codes.data();
    view.scales = scales.data();
    view.group_size = k;
    view.n_groups = 1;
    const cuda::Int4Interleaved il = cuda::interleave_int4(view, n, k);
    for (int64_t row = 0; row < n; ++row)
      for (int64_t c = 0; c < chunks; ++c)
        for (int lane = 0; lane < 32; ++lane) {
          const uint8_t* p = il.codes.data() + row * k / 2 + int4_word_offset(chunks, c, lane);
          const uint32_t word = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
          for (int j = 0; j < 8; ++j) {
            const int64_t i = int4_layout_k(c, lane, j);
            const uint32_t want = (codes[size_t(row * k / 2 + i / 2)] >> (4 * (i % 2))) & 0xF;
            ASSERT_EQ((word >> (4 * j)) & 0xF, want) << "chunks " << chunks << " c " << c << " lane " << lane;
          }
        }
  }
}
#endif

// Bank groups: a 16-byte access is served in phases of 8 threads; a phase is conflict-free when its
// 8 addresses fall in 8 different 16-byte groups of the 128-byte bank window.
bool distinct_groups(const std::vector<int64_t>& byte_addresses) {
  std::set<int64_t> groups;
  for (int64_t a : byte_addresses) groups.insert(a / 16 % 8);
  return groups.size() == byte_addresses.size();
}

TEST(GemmLayout, ASwizzleIsConflictFree) {
  for (int row = 0; row < 256; ++row) {  // a bijection on the row's units, within each 8-unit half
    std::set<int> units;
    for (int u = 0; u < 16; ++u) {
      EXPECT_EQ(gemm_a_unit_swizzle(row, u) / 8, u / 8);
      units.insert(gemm_a_unit_swizzle(row, u));
    }
    EXPECT_EQ(units.size(), 16u);
  }
  // ldmatrix: one phase = 8 consecutive rows (a multiple of 8 first), the same unit
  for (int row0 = 0; row0 < 128; row0 += 8)
    for (int u = 0; u < 16; ++u) {
      std::vector<int64_t> a;
      for (int r = row0; r < row0 + 8; ++r) a.push_back(r * 256 + gemm_a_unit_swizzle(r, u) * 16);
      EXPECT_TRUE(distinct_groups(a)) << "ldmatrix rows " << row0 << " unit " << u;
    }
  // staging stores: thread tid writes row tid / tpr, unit gemm_a_stage_unit(tid, tpr, i)
  for (int tpr : {2, 4, 8})
    for (int i = 0; i < 16 / tpr; ++i)
      for (int tid0 = 0; tid0 < 256; tid0 += 8) {
        std::vector<int64_t> a;
        std::set<int> covered;
        for (int tid = tid0; tid < tid0 + 8; ++tid) {
          const int r = tid / tpr, u = gemm_a_stage_unit(tid, tpr, i);
          a.push_back(r * 256 + gemm_a_unit_swizzle(r, u) * 16);
        }
        EXPECT_TRUE(distinct_groups(a)) << "store tpr " << tpr << " unit step " << i << " threads " << tid0;
      }
  // and the staging covers every unit of every row once
  for (int tpr : {2, 4, 8}) {
    std::set<std::pair<int, int>> units;
    for (int tid = 0; tid < 16 * tpr; ++tid)
      for (int i = 0; i < 16 / tpr; ++i) units.insert({tid / tpr, gemm_a_stage_unit(tid, tpr, i)});
    EXPECT_EQ(units.size(), size_t(16 * 16));
  }
}

TEST(GemmLayout, WSharedLayoutKeepsAThreadsWordsTogether) {
  for (int column = 0; column < 128; ++column) {
    std::set<int> words;
    for (int t = 0; t < 4; ++t)
      for (int sigma = 0; sigma < 4; ++sigma) {
        EXPECT_EQ(gemm_w_word(column, t, sigma), gemm_w_word(column, t, 0) + sigma);  // one 16-byte load
        words.insert(gemm_w_word(column, t, sigma));
      }
    EXPECT_EQ(words.size(), 16u);
    EXPECT_EQ(*words.rbegin(), 15);
  }
}

TEST(GemmLayout, DenseSwizzleIsConflictFree) {
  for (int row0 = 0; row0 < 64; row0 += 8)
    for (int u = 0; u < 4; ++u) {
      std::vector<int64_t> a;
      for (int r = row0; r < row0 + 8; ++r) a.push_back(r * 64 + dense_unit_swizzle(r, u) * 16);
      EXPECT_TRUE(distinct_groups(a)) << "rows " << row0 << " unit " << u;
    }
}


// The decode GEMV's k order (gemv_mma_k): a bijection over each chunk, read off the words a thread
// loads (nibble j = 4jp + r + 2e of lane t + 4i is the layout's k), and the staged activations put
// each k where the A fragment of the same mma row expects it.
TEST(GemmLayout, GemvMmaOrderIsABijectionOverTheLayout) {
  for (int64_t c = 0; c < 5; ++c) {
    std::vector<int> seen(256, 0);
    for (int i = 0; i < 8; ++i)
      for (int jp = 0; jp < 2; ++jp)
        for (int t = 0; t < 4; ++t)
          for (int r = 0; r < 2; ++r)
            for (int e = 0; e < 2; ++e) {
              const int64_t k = gemv_mma_k(c, i, jp, t, r, e);
              ASSERT_GE(k, 256 * c);
              ASSERT_LT(k, 256 * (c + 1));
              ++seen[size_t(k - 256 * c)];
              // The word of lane t + 4i, nibble 4jp + r + 2e: register r of step jp is the low
              // (r = 0) or high (r = 1) nibbles of bytes 2jp (e = 0) and 2jp + 1 (e = 1).
              EXPECT_EQ(gemv_mma_nibble(jp, r, e), 2 * (2 * jp + e) + r);
              EXPECT_EQ(k, int4_layout_k(c, t + 4 * i, gemv_mma_nibble(jp, r, e)));
            }
    for (int k = 0; k < 256; ++k) ASSERT_EQ(seen[size_t(k)], 1) << "c " << c << " k " << k;
  }
}

TEST(GemmLayout, GemvMmaStagingMatchesTheFragments) {
  constexpr int64_t kChunks = 3;
  std::set<int64_t> halves;
  for (int64_t k = 0; k < 256 * kChunks; ++k) halves.insert(gemv_mma_x_half(k));
  EXPECT_EQ(halves.size(), size_t(256 * kChunks));
  EXPECT_EQ(*halves.rbegin(), 256 * kChunks - 1);  // a permutation of the row
  for (int64_t c = 0; c < kChunks; ++c)
    for (int i = 0; i < 8; ++i)
      for (int jp = 0; jp < 2; ++jp)
        for (int lane = 0; lane < 32; ++lane)
          for (int r = 0; r < 2; ++r)
            for (int e = 0; e < 2; ++e) {
              const int t = lane % 4;
              // A (the weights): registers 2r (row g) and 2r + 1 (row g + 8), half e, are k-slot
              // κ = 2t + e + 8r of rows lane / 4 and lane / 4 + 8.
              const int kappa = mma_a_col(lane, 2 * r, e);
              EXPECT_EQ(kappa, 2 * t + e + 8 * r);
              EXPECT_EQ(mma_a_col(lane, 2 * r + 1, e), kappa);
              EXPECT_EQ(mma_a_row(lane, 2 * r), lane / 4);
              EXPECT_EQ(mma_a_row(lane, 2 * r + 1), lane / 4 + 8);
              // B (the activations): b[r] half e of this lane is the same k-slot, column lane / 4.
              EXPECT_EQ(mma_b_row(lane, r, e), kappa);
              // Staged unit (step, t), half 2r + e, is that k.
              const int64_t k = gemv_mma_k(c, i, jp, t, r, e);
              EXPECT_EQ(gemv_mma_x_half(k), (gemv_mma_step(c, i, jp) * 4 + t) * 4 + 2 * r + e);
            }
}

// The kernel's scale registers (kernels/gemv_mma.cuh): for G >= 128 one group a step (jp) of a
// row, so the scale multiplies the step's f32 sums; for G = 64 one f16x2 a step whose halves e
// differ and registers r do not; for G = 32 one a register. Every k of a half is in its group.
TEST(GemmLayout, GemvMmaScaleSetsCoverTheirGroups) {
  for (int shift = 5; shift <= 30; ++shift) {
    for (int64_t c = 0; c < 9; ++c)
      for (int jp = 0; jp < 2; ++jp)
        for (int r = 0; r < 2; ++r)
          for (int e = 0; e < 2; ++e) {
            const int64_t group = gemv_mma_group(c, jp, r, e, shift);
            if (shift >= 7) {
              EXPECT_EQ(group, gemv_mma_group(c, jp, 0, 0, shift)) << "G " << (1 << shift);
            } else if (shift == 6) {
              EXPECT_EQ(group, gemv_mma_group(c, jp, 0, e, shift)) << "c " << c;
            }
            for (int t = 0; t < 4; ++t)
              for (int i = 0; i < 8; ++i)  // every k of the half is in that group
                EXPECT_EQ(gemv_mma_k(c, i, jp, t, r, e) >> shift, group);
          }
  }
  // And the pairing is needed: at G = 64 the halves of a step differ, at G = 32 the registers too.
  EXPECT_NE(gemv_mma_group(0, 0, 0, 0, 6), gemv_mma_group(0, 0, 0, 1, 6));
  EXPECT_NE(gemv_mma_group(0, 0, 0, 0, 5), gemv_mma_group(0, 0, 1, 0, 5));
}

// MXFP4 decode layout: every checkpoint byte of a row lands on its own byte (partial last groups
// of 1..3 blocks included), and the staged-x order is a permutation within each block of 32.
TEST(GemmLayout, Mxfp4DecodeBytesAndStagedOrderArePermutations) {
  for (int64_t k : {32, 64, 96, 128, 160, 256, 2880}) {
    std::vector<int> seen(size_t(k / 2), 0);
    for (int64_t byte = 0; byte < k / 2; ++byte) {
      const int64_t at = mxfp4_decode_byte(k, byte);
      ASSERT_GE(at, 0);
      ASSERT_LT(at, k / 2) << "k " << k << " byte " << byte;
      ++seen[size_t(at)];
      // A word stays a word: the 4 bytes of checkpoint word w are bytes 4w' .. 4w' + 3.
      EXPECT_EQ(at % 4, byte % 4);
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; })) << "k " << k;
    std::vector<int> halves(size_t(k), 0);
    for (int64_t i = 0; i < k; ++i) {
      ASSERT_EQ(mxfp4_x_half(i) / 32, i / 32);
      ++halves[size_t(mxfp4_x_half(i))];
    }
    EXPECT_TRUE(std::all_of(halves.begin(), halves.end(), [](int c) { return c == 1; })) << "k " << k;
  }
}

// The rearranged word decodes to the f16 bits of value · 2^-14 for every code in every position:
// sign at bit 15 and the 3 magnitude bits at 11..9 of its half, pair p holding codes p and p + 4.
TEST(GemmLayout, Mxfp4WordEncodingDecodesEveryCode) {
  std::mt19937 rng(7);
  std::vector<uint32_t> words;
  for (uint32_t code = 0; code < 16; ++code)
    for (int pos = 0; pos < 8; ++pos) words.push_back(code << (4 * pos));  // one code alone
  for (int i = 0; i < 4096; ++i) words.push_back(uint32_t(rng()));
  words.push_back(0xFFFFFFFFu);
  for (uint32_t x : words) {
    uint32_t pairs[4] = {};
    mxfp4_decode_word(mxfp4_encode_word(x), pairs);
    for (int j = 0; j < 8; ++j) {
      const uint32_t code = (x >> (4 * j)) & 0xFu;
      const uint32_t want = ((code >> 3) << 15) | ((code & 7u) << 9);
      const uint32_t got = (pairs[j % 4] >> (j < 4 ? 0 : 16)) & 0xFFFFu;
      ASSERT_EQ(got, want) << std::hex << "word 0x" << x << " code " << j;
    }
  }
  static_assert(mxfp4_encode_word(0) == 0);
}

}  // namespace
}  // namespace nibble::kernels
