// The index arithmetic of the tensor-core GEMMs (kernels/gemm_int4.cuh, gemm_dense.cuh), as
// constexpr functions shared by the kernels and a CPU unit test (tests/unit/gemm_layout_test.cpp)
// that proves them: plain C++, no CUDA types.
//
// The weights stay in the warp-interleaved layout of the decode kernels (kernels/gemv.cuh): word
// (chunk c, lane l) holds nibble j = code of k = 256c + l + 32j; chunks are stored in groups of 4
// as [lane][4 words] (a last partial group of r chunks as [lane][r words]).
//
// An mma.m16n8k16 sums over its 16 k, so the GEMM may visit K in any order as long as A and B
// use the same one. Ours: the K loop runs over stages (chunk c, half h) of 128 k; a stage is 8 mma
// steps, one per nibble j; mma row κ (0..15) of step (c, h, j) is
//   k = 256c + 32j + 16h + 4σ(κ) + t(κ),   t = (κ >> 1) & 3,   σ = (κ & 1) | (κ >> 3) << 1.
// That is word lane 16h + 4σ + t, nibble j. Why this order:
//  - B: the mma's B fragment gives thread t (= lane % 4) the rows κ = 2t, 2t+1, 2t+8, 2t+9, which
//    are σ = 0, 1, 2, 3: the thread's 4 B values of a step are nibble j of 4 words (σ = 0..3),
//    one 16-byte shared load that serves 4 steps (nibbles 0-3 or 4-7).
//  - groups: the 16 k of a step are 256c + 32j + [0, 32), one quantisation group for every group
//    size G >= 32 that is a power of two (or the whole K): one (scale, zero) per column per step.
//  - A: 8 consecutive x (u = 0..7 from k0 = 256c + 32j + 16h + 8·kh) land on κ = 8·kh + p(u),
//    p(u) = 2(u & 3) + (u >> 2): one 16-byte unit of a row, so staging A is one 16-byte store
//    per 8 inputs and ldmatrix reads the units unchanged.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define NIBBLE_HD __host__ __device__
#else
#define NIBBLE_HD
#endif

namespace nibble::kernels {

// Positions in the mma.m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"): register r, half e (low = 0) of a thread's operand.
// A (16x16, row): a[r] holds A[row][col], col = 2(lane % 4) + e + 8(r / 2), row = lane / 4 + 8(r % 2).
NIBBLE_HD constexpr int mma_a_row(int lane, int r) { return lane / 4 + 8 * (r % 2); }
NIBBLE_HD constexpr int mma_a_col(int lane, int r, int e) { return 2 * (lane % 4) + e + 8 * (r / 2); }
// B (16x8, col): b[r] holds B[row][col], row = 2(lane % 4) + e + 8r, col = lane / 4.
NIBBLE_HD constexpr int mma_b_row(int lane, int r, int e) { return 2 * (lane % 4) + e + 8 * r; }
NIBBLE_HD constexpr int mma_b_col(int lane) { return lane / 4; }
// ldmatrix .x4: lane L gives the address of row L % 8 of matrix L / 8; matrix i lands in register i,
// thread l receiving its row l / 4, columns 2(l % 4) + e.
// A tile (16 rows x 16 k): matrix i = rows 8(i % 2).., k 8(i / 2)..: lane L points at these.
NIBBLE_HD constexpr int ldsm_a_row(int lane) { return lane % 16; }
NIBBLE_HD constexpr int ldsm_a_khalf(int lane) { return lane / 16; }
// Two B tiles stored n-major (8 n x 16 k each): matrix i = n-tile i / 2, k half i % 2.
NIBBLE_HD constexpr int ldsm_b_row(int lane) { return lane / 16 * 8 + lane % 8; }
NIBBLE_HD constexpr int ldsm_b_khalf(int lane) { return lane / 8 % 2; }

constexpr int kGemmStageK = 128;  // k per stage (c, h)
constexpr int kGemmStepsPerStage = 8;

NIBBLE_HD constexpr int gemm_kappa_t(int kappa) { return (kappa >> 1) & 3; }
NIBBLE_HD constexpr int gemm_kappa_sigma(int kappa) { return (kappa & 1) | (kappa >> 3) << 1; }

// The input k of mma row κ in step j of stage (c, h).
NIBBLE_HD constexpr int64_t gemm_k(int64_t c, int h, int j, int kappa) {
  return 256 * c + 32 * j + 16 * h + 4 * gemm_kappa_sigma(kappa) + gemm_kappa_t(kappa);
}

// B side: the word lane whose nibble j thread t uses as its value σ (= 2r + e of b[r]) in half h.
NIBBLE_HD constexpr int gemm_b_word_lane(int h, int sigma, int t) { return 16 * h + 4 * sigma + t; }
// The layout's definition: the input k of nibble j of word (c, lane).
NIBBLE_HD constexpr int64_t int4_layout_k(int64_t c, int lane, int j) { return 256 * c + lane + 32 * j; }
// Byte offset of word (c, lane) within a row of `chunks` chunks.
NIBBLE_HD constexpr int64_t int4_word_offset(int64_t chunks, int64_t c, int lane) {
  const int64_t c0 = c / 4 * 4, words = chunks - c0 < 4 ? chunks - c0 : 4;
  return c0 * 128 + (lane * words + (c - c0)) * 4;
}

// A side: κ of input u (0..7) of the 8 consecutive inputs of unit kh (0, 1) of a step.
NIBBLE_HD constexpr int gemm_a_kappa(int kh, int u) { return 8 * kh + 2 * (u & 3) + (u >> 2); }

// Shared memory of A: a stage is [row][8 steps · 16 κ] f16, 256 bytes a row = 16 units of 16 bytes
// (unit 2j + kh). Rows are 256 bytes apart, so unrotated every row would start on the same bank.
// The unit's low 3 bits are XOR-ed with the bit-reversed row % 8, which keeps both accesses
// conflict-free (each 8-thread phase of a 16-byte access then covers 8 different 16-byte bank
// groups): ldmatrix reads one unit of 8 consecutive rows (any bijection of row % 8 does), and the
// staging stores write, per phase, the units of 1, 2 or 4 consecutive rows (8, 4 or 2 threads a
// row: bit 2 of the XOR flips between neighbouring rows, bits 1-2 differ among any 4).
NIBBLE_HD constexpr int gemm_a_unit_swizzle(int row, int unit) {
  return unit ^ ((row & 1) << 2 | (row & 2) | (row >> 2 & 1));
}
// The staging assignment: with kThreadsPerRow = threads / BM, thread `tid` converts row
// tid / kThreadsPerRow, units tid % kThreadsPerRow + i · kThreadsPerRow (i = 0 .. 16 / kThreadsPerRow - 1).
NIBBLE_HD constexpr int gemm_a_stage_unit(int tid, int threads_per_row, int i) {
  return tid % threads_per_row + i * threads_per_row;
}

// Shared memory of W: a stage is [column][16 words], thread t's four words (σ = 0..3) of a stage
// contiguous, so they are one 16-byte load; the 8 columns × 4 t of a warp read 512 contiguous bytes
// (conflict-free in any order). The 16-byte slots are rotated by (column / 2) % 4 so the 4-byte
// cp.async writes (a thread fills 8 words of one column, a warp 16 columns) spread over more banks.
NIBBLE_HD constexpr int gemm_w_word(int column, int t, int sigma) { return 4 * (t ^ (column >> 1 & 3)) + sigma; }

// The decode GEMVs (kernels/gemv_mma.cuh) read the same layout without shared memory: the weights
// are the A operand (16 output rows), the M <= 8 activation rows the B columns. Thread (g, t)
// (g = lane / 4, t = lane % 4) loads, straight from global memory, the words of rows g and g + 8
// of its tile at lanes t + 4i (i = 0..7): one 16-byte unit per i holds 4 chunks. Each word is two
// mma steps (i, jp), step jp taking nibbles 4jp .. 4jp + 3 (bytes 2jp, 2jp + 1): a byte permute
// puts the two bytes at bytes 0 and 2, and one lop3 each makes register r = 0 of their low nibbles
// and r = 1 of their high nibbles (a0/a1 for r = 0, a2/a3 for r = 1; a0, a2 row g, a1, a3 row
// g + 8). Register r, half e is nibble j = 4jp + r + 2e, so mma k-slot κ = 2t + e + 8r of step
// (c, i, jp) is
//   k = 256c + t + 4i + 32(4jp + r + 2e),
// and the activations are staged (once per block, f16) in exactly that order: per step, thread
// t's b0 (κ = 2t, 2t + 1) and b1 (κ = 2t + 8, 2t + 9) as one 8-byte unit, 4 units a step.
// Why this pairing: a step's k of a row lie in 128jp .. 128jp + 127 of the chunk, one quantisation
// group for G >= 128, so the scale can multiply the step's f32 sums instead of every weight.
constexpr int kGemvStepsPerChunk = 16;

// The nibble of a word that register r, half e of step jp holds.
NIBBLE_HD constexpr int gemv_mma_nibble(int jp, int r, int e) { return 4 * jp + r + 2 * e; }
NIBBLE_HD constexpr int64_t gemv_mma_k(int64_t c, int i, int jp, int t, int r, int e) {
  return 256 * c + t + 4 * i + 32 * gemv_mma_nibble(jp, r, e);
}
// The step of chunk c, word i, half jp, counted from the start of the row.
NIBBLE_HD constexpr int64_t gemv_mma_step(int64_t c, int i, int jp) { return (c * 8 + i) * 2 + jp; }
// Where input k lives in a staged activation row, in halves: unit (step, t) is 4 halves
// (b0 low, b0 high, b1 low, b1 high).
NIBBLE_HD constexpr int64_t gemv_mma_x_half(int64_t k) {
  const int64_t c = k / 256;
  const int j = int(k % 256 / 32), lane = int(k % 32);
  const int i = lane / 4, t = lane % 4, jp = j / 4, r = j % 2, e = j % 4 / 2;
  return (gemv_mma_step(c, i, jp) * 4 + t) * 4 + 2 * r + e;
}
// The quantisation group of half e of register r in step (c, ·, jp).
NIBBLE_HD constexpr int64_t gemv_mma_group(int64_t c, int jp, int r, int e, int shift) {
  return (256 * c + 32 * gemv_mma_nibble(jp, r, e)) >> shift;
}

// The dense GEMM's tiles are [row][32 k] of 16-bit values: 64-byte rows of 4 units. ldmatrix reads
// one unit of 8 consecutive rows; every second row would hit the same banks, so units are XOR-ed
// with (row / 2) % 4, which gives the 8 rows 8 different 16-byte bank groups.
NIBBLE_HD constexpr int dense_unit_swizzle(int row, int unit) { return unit ^ (row >> 1 & 3); }

// The MXFP4 decode layout (kernels/gemv_mxfp4.cuh, which says why it is so): groups of 4 blocks of
// 32 codes per row, each block's words interleaved, each word's bits rearranged for a cheap decode.
NIBBLE_HD constexpr int64_t mxfp4_groups(int64_t k) { return (k / 32 + 3) / 4; }
NIBBLE_HD constexpr int64_t mxfp4_scale_stride(int64_t k) { return 4 * mxfp4_groups(k); }

// Blocks in group q of a row of k: 4, or fewer in a last partial group.
NIBBLE_HD constexpr int mxfp4_group_blocks(int64_t k, int64_t q) {
  return k / 32 - 4 * q >= 4 ? 4 : int(k / 32 - 4 * q);
}

// Where checkpoint byte `byte` of a row (codes 2·byte, 2·byte + 1) sits in the decode layout.
NIBBLE_HD constexpr int64_t mxfp4_decode_byte(int64_t k, int64_t byte) {
  const int64_t block = byte / 16, q = block / 4, b = block % 4, w = byte % 16 / 4;
  return 64 * q + 4 * (mxfp4_group_blocks(k, q) * w + b) + byte % 4;
}

// Half index of input i in a staged row: within each block of 32, thread t's 8 halves are
// codes (8t, 8t + 4, 8t + 1, 8t + 5, 8t + 2, 8t + 6, 8t + 3, 8t + 7): the B fragments of the
// block's two steps in mma order.
NIBBLE_HD constexpr int64_t mxfp4_x_half(int64_t i) {
  return (i & ~int64_t(7)) | ((i & 3) << 1) | ((i >> 2) & 1);
}

// Halves per staged row: 32 more than k, so consecutive rows start 64 bytes apart in the banks
// (k is a multiple of 64 in every shape that matters; then two rows' quads share a phase without
// conflicts).
NIBBLE_HD constexpr int64_t mxfp4_x_stride(int64_t k) { return k + 32; }
NIBBLE_HD constexpr int64_t mxfp4_x_bytes(int64_t m, int64_t k) { return 2 * m * mxfp4_x_stride(k); }

// The bits of a decode-layout word. In each 16-bit half (the low halves of the four f16x2 pairs in
// the low one, the high halves in the high one), pair p's code has its sign and magnitude at
//   p = 0: sign 15, magnitude 11..9  -> in place:            w & 0x8E008E00
//   p = 1: sign 12, magnitude  8..6  -> shifted by 3:        (w << 3) & 0x8E008E00
//   p = 2: sign 13, magnitude  2..0  -> sign << 2, magnitude << 9
//   p = 3: sign 14, magnitude  5..3  -> sign << 1, magnitude << 6
// Pair p of checkpoint word x is codes p (low half) and p + 4 (high half): bits 4p .. 4p + 3 and
// 16 + 4p .. 16 + 4p + 3.
NIBBLE_HD constexpr int mxfp4_sign_bit(int p) { return p == 0 ? 15 : p == 1 ? 12 : p == 2 ? 13 : 14; }
NIBBLE_HD constexpr int mxfp4_magnitude_bit(int p) { return p == 0 ? 9 : p == 1 ? 6 : p == 2 ? 0 : 3; }

NIBBLE_HD constexpr uint32_t mxfp4_encode_word(uint32_t x) {
  uint32_t w = 0;
  for (int p = 0; p < 4; ++p)
    for (int half = 0; half < 2; ++half) {
      const uint32_t code = (x >> (16 * half + 4 * p)) & 0xFu;
      w |= ((code >> 3) << (16 * half + mxfp4_sign_bit(p))) | ((code & 7u) << (16 * half + mxfp4_magnitude_bit(p)));
    }
  return w;
}

// A decode-layout word -> its four f16x2 pairs of value · 2^-14 (pairs[p]: codes p and p + 4).
NIBBLE_HD constexpr void mxfp4_decode_word(uint32_t w, uint32_t (&pairs)[4]) {
  constexpr uint32_t kSignMag = 0x8E008E00u, kMag = 0x0E000E00u, kSign = 0x80008000u;
  pairs[0] = w & kSignMag;
  pairs[1] = (w << 3) & kSignMag;
  pairs[2] = ((w << 9) & kMag) | ((w << 2) & kSign);
  pairs[3] = ((w << 6) & kMag) | ((w << 1) & kSign);
}

}  // namespace nibble::kernels
