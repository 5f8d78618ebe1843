// gpt-oss's MoE block for decode (a few tokens) with MXFP4 experts and the routing on the device,
// so a decode step needs no host round trip and is recorded as a graph. Two launches after the
// router and route kernels:
//   moe_mxfp4_gate_up_kernel: per (token, slot) the chosen expert's gate/up rows 2j and 2j + 1
//     (interleaved, gpt-oss's layout) with their biases, then the clamped SwiGLU, into act[slot][j];
//   moe_mxfp4_down_kernel: per (token, row) Σ over the token's slots of weight · (down row · act +
//     bias), added to the output or written over it.
// One warp per output row on the CUDA cores in f32: the exact first version, to be measured
// against (the weights are read once per slot, which is all a decode step needs).
//
// MXFP4 rows (format/quant/mxfp4.h): lane i takes the 16-byte chunks i, i + 32, …: a chunk is one
// block of 32 weights with one scale. An E2M1 code becomes f16 bits by placing its 3 magnitude bits
// at f16 bits 11..9 and its sign at 15: exponent field 0..3 and the top mantissa bit give exactly
// value · 2^-14 (normal and subnormal alike), so the block's sum is scaled by 2^(scale - 127 + 14).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/linear.cuh"

namespace nibble::kernels {

// One expert's matrix in device memory: codes [n][k/2], scales [n][k/32], bias [n] (or null).
struct Mxfp4Device {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* bias;
};

__device__ __forceinline__ float e2m1_scaled(uint32_t nibble) {  // value · 2^-14
  return __half2float(__ushort_as_half(uint16_t(((nibble & 8u) << 12) | ((nibble & 7u) << 9))));
}

// This lane's part of row `row` · x (k inputs); the caller sums the warp.
__device__ __forceinline__ float mxfp4_row_dot_lane(const Mxfp4Device& w, int64_t row, const float* __restrict__ x,
                                                    int64_t k, int lane) {
  const uint4* codes = reinterpret_cast<const uint4*>(w.codes + row * (k / 2));
  const uint8_t* scales = w.scales + row * (k / 32);
  float acc = 0.f;
  for (int64_t c = lane; c < k / 32; c += 32) {
    const uint4 q = codes[c];
    const float4* xs = reinterpret_cast<const float4*>(x + 32 * c);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    float block = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: bytes 4i .. 4i + 3 = weights 8i .. 8i + 7
      const float4 a = xs[2 * i], b = xs[2 * i + 1];
      const uint32_t v = words[i];
      block += e2m1_scaled(v) * a.x + e2m1_scaled(v >> 4) * a.y + e2m1_scaled(v >> 8) * a.z +
               e2m1_scaled(v >> 12) * a.w + e2m1_scaled(v >> 16) * b.x + e2m1_scaled(v >> 20) * b.y +
               e2m1_scaled(v >> 24) * b.z + e2m1_scaled(v >> 28) * b.w;
    }
    acc += ldexpf(block, int(scales[c]) - 127 + 14);
  }
  return acc;
}

// grid (ceil(inter / warps), m · top_k), `warps` warps a block.
__global__ void moe_mxfp4_gate_up_kernel(const Mxfp4Device* __restrict__ gate_up, const int32_t* __restrict__ ids,
                                         const float* __restrict__ x, float* __restrict__ act, int64_t top_k,
                                         int64_t inter, int64_t hidden, float alpha, float limit) {
  const int64_t j = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32, slot = blockIdx.y;
  const int lane = threadIdx.x % 32;
  if (j >= inter) return;
  const Mxfp4Device w = gate_up[ids[slot]];
  const float* xt = x + (slot / top_k) * hidden;
  float gate = warp_sum(mxfp4_row_dot_lane(w, 2 * j, xt, hidden, lane));
  float up = warp_sum(mxfp4_row_dot_lane(w, 2 * j + 1, xt, hidden, lane));
  if (lane != 0) return;
  if (w.bias) gate += w.bias[2 * j], up += w.bias[2 * j + 1];
  const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
  act[slot * inter + j] = (u + 1.f) * g / (1.f + expf(-alpha * g));
}

// grid (ceil(hidden / warps), m), `warps` warps a block. out[t] = (accumulate ? out[t] : 0) + Σ.
__global__ void moe_mxfp4_down_kernel(const Mxfp4Device* __restrict__ down, const int32_t* __restrict__ ids,
                                      const float* __restrict__ weights, const float* __restrict__ act,
                                      float* __restrict__ out, int64_t top_k, int64_t inter, int64_t hidden,
                                      bool accumulate) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32, t = blockIdx.y;
  const int lane = threadIdx.x % 32;
  if (row >= hidden) return;
  float total = 0.f;
  for (int64_t k = 0; k < top_k; ++k) {
    const int64_t slot = t * top_k + k;
    const Mxfp4Device w = down[ids[slot]];
    float y = warp_sum(mxfp4_row_dot_lane(w, row, act + slot * inter, inter, lane));
    if (w.bias) y += w.bias[row];
    total += weights[slot] * y;
  }
  if (lane == 0) out[t * hidden + row] = (accumulate ? out[t * hidden + row] : 0.f) + total;
}

}  // namespace nibble::kernels
