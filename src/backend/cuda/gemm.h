// Launchers of the tensor-core GEMMs for prefill (m > kGemvMaxM activation rows) and of the MoE
// prefill built on them (kernels/gemm_int4.cuh, gemm_dense.cuh, moe_prefill.cuh); callable from
// plain C++, default stream, the caller checks cudaGetLastError() as for launch.h.
#pragma once

#include <cstdint>

#include "backend/cuda/launch.h"

namespace nibble::cuda {

// W4A16: y[m, n] = x[m, k] · Wᵀ (+ bias) for W in the warp-interleaved layout (k % 256 == 0). x is
// rounded to f16, and so is each dequantised weight: relative error about 1e-4, not exact f32.
// x must be 16-byte aligned.
void gemm_int4(const Int4Device& w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k);

// Dense F16/BF16 weights, near-f32 (x split into two 16-bit halves): which shapes it takes.
constexpr bool gemm_dense_supports(Dense type, int64_t k) { return type != Dense::kF32 && k % 8 == 0; }
// x 16-byte aligned.
void gemm_dense(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n,
                int64_t k);

// x f32 [count] -> hi = T(x), lo = T(x - hi) for T = F16 or BF16 (count % 4 == 0, x 16-byte aligned):
// the near-f32 split of gemm_dense's activations, for a library GEMM (backend/cuda/cublaslt.h).
void split_16bit(Dense type, const float* x, int64_t count, void* hi, void* lo);

// MoE for any number of tokens with device-side routing (ids/weights [m, top_k] from moe_route) and
// no host round trip: the (token, slot) pairs are grouped by expert on the GPU, then a grouped W4A16
// GEMM over gate and up (SiLU(gate)·up in its epilogue), one over down, and a weighted combine in
// slot order. gate/up/down are device arrays of n_experts Int4Device, all [inter, hidden] /
// [hidden, inter] with one group size; hidden and inter % 256 == 0; n_experts <= kMoeMaxExperts.
// scratch: moe_prefill_scratch_bytes(...) bytes of device memory.
int64_t moe_prefill_scratch_bytes(int64_t m, int64_t top_k, int64_t n_experts, int64_t inter, int64_t hidden);
void moe_prefill_int4(const Int4Device* gate, const Int4Device* up, const Int4Device* down, const int32_t* ids,
                      const float* weights, const float* x, float* out, int64_t m, int64_t top_k, int64_t n_experts,
                      int64_t inter, int64_t hidden, void* scratch);

// gpt-oss's MoE for any number of tokens, the same way over MXFP4 experts (device arrays of
// n_experts Mxfp4Device in the decode layout; gate_up [2·inter, hidden] rows interleaved gate_j,
// up_j; biases; the clamped SwiGLU with alpha and limit): x and the activations rounded to f16,
// products in f32 (kernels/moe_mxfp4_prefill.cuh). hidden, inter % 32 == 0; x 16-byte aligned.
// fold_scales: every expert's scales passed mxfp4_scales_outside_fold (the faster kernels).
// scratch: moe_prefill_scratch_bytes(...) bytes.
void moe_prefill_mxfp4(const Mxfp4Device* gate_up, const Mxfp4Device* down, const int32_t* ids, const float* weights,
                       const float* x, float* out, int64_t m, int64_t top_k, int64_t n_experts, int64_t inter,
                       int64_t hidden, float alpha, float limit, bool fold_scales, void* scratch);
// Sets *outside (device memory) to 1 when a decode-layout scale byte of [count] is outside the range
// the MoE prefill kernels can fold into f16 weights exactly (E8M0 104 .. 128).
void mxfp4_scales_outside_fold(const uint8_t* scales, int64_t count, unsigned* outside);

}  // namespace nibble::cuda
