// Dense 16-bit GEMMs of prefill shapes through cuBLASLt (the toolkit's library, loaded with dlopen
// on first use: a machine without it, or a shape it has no algorithm for, keeps our own kernels).
// Callable from plain C++; work goes to cudaStreamPerThread like every launch of this backend.
#pragma once

#include <cstdint>

#include "backend/cuda/launch.h"

namespace nibble::cuda {

// y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias) with W row-major BF16 or F16 and x f32, both products in
// near-f32: x is split into two 16-bit halves (hi = T(x), lo = T(x - hi)), and y gets W·hiᵀ + bias,
// then W·loᵀ added in place (the split of kernels/gemm_dense.cuh, on cuBLASLt's tensor-core
// kernels). scratch: 2·m·k 16-bit values. x, W 16-byte aligned, k % 8 == 0. False (nothing
// launched) when cuBLASLt is missing or declines the shape; NIBBLE_NO_CUBLASLT=1 forces false.
bool cublaslt_gemm_split(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n,
                         int64_t k, void* scratch);
// Why cuBLASLt is not in use ("" when it is loaded).
const char* cublaslt_unavailable_reason();

}  // namespace nibble::cuda
