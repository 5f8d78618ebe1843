// gpt-oss's MoE block for decode (a few tokens) with MXFP4 experts and the routing on the device,
// so a decode step needs no host round trip and is recorded as a graph. Two launches after the
// router GEMV and the route kernel, both on the tensor cores (kernels/gemv_mxfp4.cuh):
//   moe_mxfp4_gate_up_kernel: per (token, slot) a 16-row tile of the chosen expert's gate_up rows
//     (interleaved: row 2j is gate j, 2j + 1 up j) with their biases, then the clamped SwiGLU, into
//     act[slot] as f16 in the staged order of the down projection's input;
//   moe_mxfp4_down_kernel: per (token, 16-row tile) Σ over the token's slots of weight · (down rows
//     · act + bias), added to the output or written over it.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/activation.cuh"
#include "kernels/gemv_mxfp4.cuh"

namespace nibble::kernels {

// Shared memory of the gate/up kernel: the staged row, then a copy of the expert table.
__host__ __device__ constexpr int64_t moe_mxfp4_table_offset(int64_t hidden) {
  return (mxfp4_x_bytes(1, hidden) + 15) / 16 * 16;
}
__host__ __device__ constexpr int64_t moe_mxfp4_gate_up_smem(int64_t hidden, int64_t n_experts) {
  return moe_mxfp4_table_offset(hidden) + n_experts * int64_t(sizeof(Mxfp4Device));
}

// grid (2·inter / (16 · NTB), m · top_k): NTB 16-row tiles a block, KS warps along K on each. Each
// block stages its token's row, so more tiles a block stage it fewer times (KS 2, NTB 4 for
// gpt-oss: the row is 1/8 of the weight bytes a block reads). x (the normed input) was written
// before the router, two launches back, so it is staged before the PDL wait, as is the expert
// table; after the wait only the expert id stands between the block and its first weight load.
// Registers: at most 80 a thread for 256-thread blocks (3 blocks an SM), so gpt-oss-20b's 360
// blocks of a token's 4 slots run in one wave. With the compiler's 103 (2 blocks an SM, Nsight
// Compute) they took 1.36 waves at 25% occupancy, 30% of DRAM bandwidth.
constexpr int moe_mxfp4_gate_up_min_blocks(int threads) { return threads <= 256 ? 3 : 1; }

template <int KS, int NTB, bool kDouble, int B = kMxfp4Batch>
__global__ void __launch_bounds__(32 * KS * NTB, moe_mxfp4_gate_up_min_blocks(32 * KS * NTB)) moe_mxfp4_gate_up_kernel(
    const Mxfp4Device* __restrict__ gate_up, int64_t n_experts, const int32_t* __restrict__ ids,
    const float* __restrict__ x, __half* __restrict__ act, int64_t top_k, int64_t inter, int64_t hidden, float alpha,
    float limit) {
  static_assert(sizeof(Mxfp4Device) % 8 == 0);
  constexpr int kWords = int(sizeof(Mxfp4Device) / 8);
  NIBBLE_TIMELINE_BLOCK(kMoeGateUp);
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  auto* table = reinterpret_cast<Mxfp4Device*>(dynamic_smem() + moe_mxfp4_table_offset(hidden));
  for (int64_t i = threadIdx.x; i < n_experts * kWords; i += blockDim.x)
    reinterpret_cast<uint64_t*>(table)[i] = __ldg(reinterpret_cast<const uint64_t*>(gate_up) + i);
  const int warp = threadIdx.x / 32, nt = warp / KS, kw = warp % KS, lane = threadIdx.x % 32, g = lane / 4,
            t = lane % 4;
  const int64_t slot = blockIdx.y, tile0 = (int64_t(blockIdx.x) * NTB + nt) * 16;
  XRows<1, false> xr{x + (slot / top_k) * hidden, hidden, 1, nullptr, {}};
  mxfp4_stage_x(xr, hidden, xs);
  NIBBLE_TIMELINE_MARK();
  pdl_enter();  // the experts come from the route kernel, the previous one
  NIBBLE_TIMELINE_WAITED();
  const int32_t e = ids[slot];
  __syncthreads();  // the table and the staged row
  const Mxfp4Device d = table[e];
  const Mxfp4Weight w{d.codes, d.scales};
  Mxfp4Tile<kDouble, B> tile;
  tile.start(w, tile0, 2 * inter, hidden, kw, KS);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile.finish(mxfp4_x_units(xs, hidden, 1), acc);
  __shared__ float partial[NTB][KS][16];
  if (t == 0) partial[nt][kw][g] = acc[0], partial[nt][kw][g + 8] = acc[2];  // column 0: the token
  __syncthreads();
  const int tn = threadIdx.x / 8, jj = threadIdx.x % 8;  // 8 (gate, up) pairs a tile
  const int64_t j = (int64_t(blockIdx.x) * NTB + tn) * 8 + jj;
  if (tn < NTB && j < inter) {
    float gate = 0.f, up = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) gate += partial[tn][i][2 * jj], up += partial[tn][i][2 * jj + 1];
    if (d.bias) gate += d.bias[2 * j], up += d.bias[2 * j + 1];
    act[slot * inter + mxfp4_x_half(j)] = __float2half_rn(clamped_swiglu(gate, up, alpha, limit));
  }
}

// grid (hidden / 16, m), kMoeMxfp4DownWarps warps: warp w takes slot w / ks, groups w % ks,
// w % ks + ks, … (ks = warps / top_k: 2 for gpt-oss; 16 warps with ks 4 measured 24.9 µs a call
// against 20.2 on gpt-oss-20b's shapes, H100). The routing was written two launches back, so the
// experts' first weights load before the PDL wait, as does the residual it adds to.
constexpr int kMoeMxfp4DownWarps = 8;

template <bool kDouble, int B = kMxfp4Batch>
__global__ void __launch_bounds__(32 * kMoeMxfp4DownWarps) moe_mxfp4_down_kernel(
    const Mxfp4Device* __restrict__ down, const int32_t* __restrict__ ids, const float* __restrict__ weights,
    const __half* __restrict__ act, float* __restrict__ out, int64_t top_k, int64_t inter, int64_t hidden,
    bool accumulate) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ks = kMoeMxfp4DownWarps / int(top_k), s = warp / ks, kw = warp % ks;
  const int64_t tok = blockIdx.y, tile0 = int64_t(blockIdx.x) * 16;
  NIBBLE_TIMELINE_BLOCK(kMoeDown);
  Mxfp4Tile<kDouble, B> tile;
  Mxfp4Device d{};
  if (s < top_k) {
    d = down[ids[tok * top_k + s]];
    tile.start(Mxfp4Weight{d.codes, d.scales}, tile0, hidden, inter, kw, ks);
  }
  const bool mine = threadIdx.x < 16 && tile0 + threadIdx.x < hidden;
  const float prev = accumulate && mine ? out[tok * hidden + tile0 + threadIdx.x] : 0.f;
  pdl_enter();
  NIBBLE_TIMELINE_WAITED();
  // The slots' activation rows are already f16 in staged order: 16-byte copies.
  __half* xs = reinterpret_cast<__half*>(dynamic_smem());
  copy_staged_rows(act + tok * top_k * inter, int(top_k), inter, mxfp4_x_stride(inter), xs);
  __syncthreads();
  NIBBLE_TIMELINE_MARK();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (s < top_k) tile.finish(mxfp4_x_units(xs + s * mxfp4_x_stride(inter), inter, 1), acc);
  __shared__ float partial[kMoeMxfp4DownWarps][16];
  if (t == 0) partial[warp][g] = acc[0], partial[warp][g + 8] = acc[2];
  __syncthreads();
  if (mine) {
    float total = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      const Mxfp4Device dj = down[ids[tok * top_k + j]];
      float y = dj.bias ? dj.bias[tile0 + threadIdx.x] : 0.f;
      for (int i = 0; i < ks; ++i) y += partial[j * ks + i][threadIdx.x];
      total += weights[tok * top_k + j] * y;
    }
    out[tok * hidden + tile0 + threadIdx.x] = prev + total;
  }
}

}  // namespace nibble::kernels
