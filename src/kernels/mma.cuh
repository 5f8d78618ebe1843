// Inline-PTX wrappers for the tensor-core GEMMs (gemm_int4.cuh, gemm_dense.cuh): warp-level
// mma.sync m16n8k16 with f32 accumulators, ldmatrix, cp.async, the f16x2 arithmetic that
// dequantises INT4 codes, and the epilogue's paired store. mma.sync, ldmatrix and cp.async exist on sm_80 and later (including
// sm_90a and sm_120a), so one code path serves every architecture we build.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace nibble::kernels {

// The block's dynamic shared memory (sized at launch).
__device__ __forceinline__ uint8_t* dynamic_smem() {
  extern __shared__ __align__(16) uint8_t smem[];
  return smem;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// d += a · b for a 16x16 (row) by 16x8 (col) product; fragments as in gemm_layout.h.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, which lands in r[i].
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same with .trans: thread l receives elements (2(l % 4) + e, l / 4) of matrix i, i.e. a
// row-major [k][n] tile in shared memory (V in flash attention) as the mma's B fragment.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 4-byte asynchronous copy (cached in L1: the neighbouring words of the same 16-byte unit are
// fetched by the next stages of the same block).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
// 16-byte asynchronous copy that writes zeros where `valid` is false (no global read then).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// f16x2 with bits 0x6400 | q in each half: the value 1024 + q, for the nibbles at bits 0..3 and
// 16..19 of x, with no conversion instruction (one lop3: (x & 0x000F000F) | 0x64006400).
__device__ __forceinline__ uint32_t nibbles_to_f16x2_plus_1024(uint32_t x) {
  uint32_t v;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(v) : "r"(x), "n"(0x000F000F), "n"(0x64006400));
  return v;
}
// The same for the nibbles at bits 4..7 and 20..23, in place: bits 0x5400 | q << 4 are the value
// 64 + q (exponent 6, a mantissa step of 1/16), with no shift.
__device__ __forceinline__ uint32_t high_nibbles_to_f16x2_plus_64(uint32_t x) {
  uint32_t v;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(v) : "r"(x), "n"(0x00F000F0), "n"(0x54005400));
  return v;
}
// Bytes b and b + 1 of x at bytes 0 and 2 (bytes 1 and 3 are left for a nibble mask to clear).
__device__ __forceinline__ uint32_t bytes_to_halves(uint32_t x, int b) {
  return __byte_perm(x, 0u, b == 0 ? 0x1100u : 0x3322u);
}
// a - b per half, rounded (exact for the small integers it is used on).
__device__ __forceinline__ uint32_t f16x2_sub(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// a · s per half, rounded.
__device__ __forceinline__ uint32_t f16x2_mul(uint32_t a, uint32_t s) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(s));
  return d;
}
// (a - b) · s per half. .rn on both keeps ptxas from contracting them into an fma, which would
// round (1024 + q)·s instead of the exact small integer q - z.
__device__ __forceinline__ uint32_t f16x2_sub_mul(uint32_t a, uint32_t b, uint32_t s) {
  return f16x2_mul(f16x2_sub(a, b), s);
}

// Max / sum over the 4 threads of a quad (the threads holding one row of an mma C fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x by the SFU alone (ex2.approx.ftz: 2 ulp, subnormal results flushed to 0, 2^-inf = 0), where
// exp2f adds a branch-free rescale for subnormal results: in a softmax a term below 2^-126 of the
// max's is nothing.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A softmax's output factor with an attention sink, in log2 units (max, sink; -inf for none):
// value · 2^(max - m') / (sum · 2^(max - m') + 2^(sink - m')) = value · factor, m' = max(max, sink),
// one factor for all of a row's values. The denominator is at least 1 (sum holds the max
// position's own 2^0, and with a sink either 2^(max - m') = 1 or its term is 2^0), well inside the
// range where the fast division is accurate to 2 ulp. Prefill's and decode's attention share it.
__device__ __forceinline__ float sink_factor_log2(float max, float sum, float sink) {
  if (sink == -__builtin_huge_valf()) return __fdividef(1.f, sum);
  const float m2 = fmaxf(max, sink), a = exp2_approx(max - m2);
  return __fdividef(a, sum * a + exp2_approx(sink - m2));
}

// One tile of FlashAttention-2's online softmax on mma C fragments: s[nt] holds this thread's
// scores (log2 units, masked ones -inf) of rows g (elements 0, 1) and g + 8 (2, 3), mx their
// per-thread row maxima. Updates the running row max and sum (row_l stays per thread; quad-sum it
// at the end), turns s into the numerators exp2(s - max) and rescales the output fragments o. The
// exponentials are the SFU's alone (exp2_approx).
template <int NT, int DT>
__device__ __forceinline__ void online_softmax_tile(float (&s)[NT][4], const float (&mx)[2], float (&row_m)[2],
                                                    float (&row_l)[2], float (&o)[DT][4]) {
  constexpr float kInf = __builtin_huge_valf();
  float base[2], alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(row_m[r], quad_max(mx[r]));
    base[r] = m_new == -kInf ? 0.f : m_new;  // a row with nothing unmasked yet: keep exp2 finite
    alpha[r] = exp2_approx(row_m[r] - base[r]);  // 0 on the first tile (row_m = -inf)
    row_m[r] = m_new;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[nt][c] = exp2_approx(s[nt][c] - base[c / 2]);
      sum[c / 2] += s[nt][c];
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) row_l[r] = row_l[r] * alpha[r] + sum[r];
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    o[d][0] *= alpha[0];
    o[d][1] *= alpha[0];
    o[d][2] *= alpha[1];
    o[d][3] *= alpha[1];
  }
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Stores y[col], y[col + 1] of one output row, the ones below n.
__device__ __forceinline__ void store_pair(float* __restrict__ row, int64_t col, int64_t n, bool vec2, float v0,
                                           float v1) {
  if (vec2 && col + 1 < n) {
    *reinterpret_cast<float2*>(row + col) = make_float2(v0, v1);
  } else {
    if (col < n) row[col] = v0;
    if (col + 1 < n) row[col + 1] = v1;
  }
}

}  // namespace nibble::kernels
