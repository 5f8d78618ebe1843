// Launch configurations of the tensor-core GEMMs and the MoE prefill; see gemm.h. The tile
// instantiations are pruned to what the shapes need: four INT4 tiles by M bucket (each in three
// modes: plain, MoE gate/up, MoE down) and two dense tiles.
#include <cuda_runtime.h>

#include <cstdlib>
#include <type_traits>

#include "backend/cuda/gemm.h"
#include "backend/cuda/int4_args.cuh"
#include "backend/cuda/smem_optin.cuh"
#include "kernels/gemm_dense.cuh"
#include "kernels/gemm_int4.cuh"
#include "kernels/moe_mxfp4_prefill.cuh"
#include "kernels/moe_prefill.cuh"

namespace nibble::cuda {
namespace {

using kernels::GemmInt4Mode;

// INT4 tiles: BM x BN, warps M x N, minimum blocks per SM (caps registers at 64K / (threads ·
// blocks)), parts the A staging is split into (registers in flight vs latency hidden; chosen so
// that no tile spills: see --resource-usage). Small M is bound by the weight stream: small tiles
// give more blocks, 4 per SM, to keep loads in flight. Large M is bound by the tensor cores: the
// 64x32 warp tile reuses each A fragment 4 times and each dequantised B fragment 4 times, half
// the dequantisation work per mma of the 32x32 tile; one block of 8 warps per SM (112 KB of
// shared memory, up to 255 registers).
using Int4T16 = kernels::Int4GemmTile<16, 64, 1, 4, 4, 1>;    // m <= 16: warp 16x16
using Int4T32 = kernels::Int4GemmTile<32, 64, 1, 4, 4, 2>;    // m <= 64: warp 32x16
using Int4T64 = kernels::Int4GemmTile<64, 128, 2, 4, 2, 4>;   // warp 32x32, 2 blocks per SM
using Int4T128 = kernels::Int4GemmTile<128, 128, 2, 4, 1, 2>;  // warp 64x32
// Dense split-A tiles (the router: n = 128 needs the small one to fill the GPU).
using DenseT32 = kernels::DenseGemmTile<32, 64, 2, 2, 4>;  // warp 16x32
using DenseT64 = kernels::DenseGemmTile<64, 64, 2, 2, 3>;  // warp 32x32 (plus the per-stage partial sums)

struct DeviceLimits {
  int sms = 0;
  int smem_optin = 0;  // bytes of shared memory one block may opt in to
};
const DeviceLimits& device_limits() {
  static const DeviceLimits limits = [] {
    DeviceLimits l;
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&l.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    return l;
  }();
  return limits;
}

template <class Tile>
bool fits(const Tile&) {
  return Tile::kSmemBytes <= device_limits().smem_optin;
}


int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }


template <class Tile, GemmInt4Mode Mode>
void launch_int4(const kernels::GemmInt4Params& p, int64_t grid_x) {
  constexpr int64_t out_cols = Mode == GemmInt4Mode::kMoeGateUp ? Tile::kBN / 2 : Tile::kBN;
  auto kernel = kernels::gemm_int4_kernel<Tile, Mode>;
  allow_smem(kernel, size_t(Tile::kSmemBytes));  // memoised per kernel
  const dim3 grid(unsigned(grid_x), unsigned(ceil_div(p.n, out_cols)));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes>>>(p);
}

template <class Tile, typename T>
void launch_dense(const T* w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
  auto kernel = kernels::gemm_dense_split_kernel<Tile, T>;
  allow_smem(kernel, size_t(Tile::kSmemBytes));  // memoised per kernel
  const dim3 grid(unsigned(ceil_div(m, Tile::kBM)), unsigned(ceil_div(n, Tile::kBN)));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes>>>(w, bias, x, y, m, n, k);
}

// The INT4 tile for m rows and n columns: the smallest tiles below 64 rows; above, the largest
// tile that still gives every SM a block (n = 128 at m = 2048 would leave most SMs idle with
// 128x128 tiles).
template <typename Fn>
void dispatch_int4_tile(int64_t m, int64_t n, Fn&& fn) {
  const int64_t sms = device_limits().sms;
  if (m <= 16)
    fn(Int4T16{});
  else if (m <= 64)
    fn(Int4T32{});
  else if (m > 128 && fits(Int4T128{}) && ceil_div(m, 128) * ceil_div(n, 128) >= sms)
    fn(Int4T128{});
  else if (ceil_div(m, 64) * ceil_div(n, 128) >= sms / 2)
    fn(Int4T64{});
  else
    fn(Int4T32{});
}

// The MoE tile from the mean rows per expert (m · top_k / n_experts): tiles fit the typical expert,
// since every expert's last tile is partly empty.
template <typename Fn>
void dispatch_moe_tile(int64_t pairs, int64_t n_experts, Fn&& fn) {
  const int64_t mean = pairs / n_experts;
  if (mean <= 16)
    fn(Int4T16{});
  else if (mean <= 48)
    fn(Int4T32{});
  else if (mean < 384 || !fits(Int4T128{}))
    fn(Int4T64{});
  else
    fn(Int4T128{});
}

// The MoE scratch, carved at 256-byte boundaries; a null base only measures it. Tiles are counted
// for the smallest BM (16): at most ceil(pairs / BM) + n_experts.
struct MoeScratch {
  uint32_t* mask;         // [words][n_experts]
  int32_t* prefix;        // [words][n_experts]
  int32_t* offsets;       // [n_experts + 1]
  int2* tiles;            // [max_tiles]
  int32_t* n_tiles;       // [1]
  int32_t* sorted_token;  // [pairs]
  int32_t* pair_row;      // [pairs]
  float* act;             // [pairs][inter] (MXFP4: f16)
  float* down;            // [pairs][hidden]
  __half* staged;         // MXFP4: [m][hidden] f16, the gate/up GEMM's input
  int64_t bytes;
};
MoeScratch carve_moe_scratch(void* base, int64_t m, int64_t top_k, int64_t n_experts, int64_t inter,
                             int64_t hidden) {
  const int64_t pairs = m * top_k, words = ceil_div(m, 32), max_tiles = ceil_div(pairs, 16) + n_experts;
  MoeScratch s{};
  int64_t offset = 0;
  auto take = [&](auto*& ptr, int64_t bytes) {
    ptr = base ? reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(static_cast<char*>(base) + offset) : nullptr;
    offset += ceil_div(bytes, 256) * 256;
  };
  take(s.mask, words * n_experts * 4);
  take(s.prefix, words * n_experts * 4);
  take(s.offsets, (n_experts + 1) * 4);
  take(s.tiles, max_tiles * 8);
  take(s.n_tiles, 4);
  take(s.sorted_token, pairs * 4);
  take(s.pair_row, pairs * 4);
  take(s.act, pairs * inter * 4);
  take(s.down, pairs * hidden * 4);
  take(s.staged, m * hidden * 2);
  s.bytes = offset;
  return s;
}

}  // namespace

void gemm_int4(const Int4Device& w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
  kernels::GemmInt4Params p{};
  p.x = x;
  p.y = y;
  p.bias = bias;
  p.m = m;
  p.n = n;
  p.k = k;
  p.w = to_kernel(w);
  dispatch_int4_tile(m, n, [&](auto tile) {
    using Tile = decltype(tile);
    launch_int4<Tile, GemmInt4Mode::kPlain>(p, ceil_div(m, Tile::kBM));
  });
}

void gemm_dense(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n,
                int64_t k) {
  auto run = [&](auto* typed) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(typed)>>;
    if (ceil_div(m, 64) * ceil_div(n, 64) >= 2 * device_limits().sms)
      launch_dense<DenseT64, T>(typed, bias, x, y, m, n, k);
    else
      launch_dense<DenseT32, T>(typed, bias, x, y, m, n, k);
  };
  if (type == Dense::kBF16)
    run(static_cast<const __nv_bfloat16*>(w));
  else if (type == Dense::kF16)
    run(static_cast<const __half*>(w));
}

void split_16bit(Dense type, const float* x, int64_t count, void* hi, void* lo) {
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(ceil_div(count / 4, kThreads));
  if (type == Dense::kBF16)
    kernels::split_16bit_kernel<__nv_bfloat16><<<blocks, kThreads>>>(x, count, static_cast<uint2*>(hi),
                                                                     static_cast<uint2*>(lo));
  else
    kernels::split_16bit_kernel<__half><<<blocks, kThreads>>>(x, count, static_cast<uint2*>(hi), static_cast<uint2*>(lo));
}

int64_t moe_prefill_scratch_bytes(int64_t m, int64_t top_k, int64_t n_experts, int64_t inter, int64_t hidden) {
  return carve_moe_scratch(nullptr, m, top_k, n_experts, inter, hidden).bytes;
}

namespace {

// Groups the (token, slot) pairs by expert into tiles of bm sorted rows (kernels/moe_prefill.cuh).
void group_pairs(const MoeScratch& s, const int32_t* ids, int64_t m, int64_t top_k, int64_t n_experts, int bm) {
  const int64_t pairs = m * top_k, words = ceil_div(m, 32);
  constexpr int kThreads = 256;
  const unsigned pair_blocks = unsigned(ceil_div(pairs, kThreads));
  cudaMemsetAsync(s.mask, 0, size_t(words * n_experts) * 4);
  kernels::moe_group_mark_kernel<<<pair_blocks, kThreads>>>(ids, pairs, top_k, n_experts, s.mask);
  kernels::moe_group_scan_kernel<<<1, kernels::kMoeGroupThreads>>>(s.mask, words, n_experts, bm, s.prefix, s.offsets,
                                                                    s.tiles, s.n_tiles);
  kernels::moe_group_place_kernel<<<pair_blocks, kThreads>>>(ids, pairs, top_k, n_experts, s.mask, s.prefix,
                                                             s.offsets, s.sorted_token, s.pair_row);
}

// The grouped GEMMs' view of the grouping (both parameter structs name the fields alike).
template <class Params>
void set_tile_table(Params& p, const MoeScratch& s) {
  p.tiles = s.tiles;
  p.n_tiles = s.n_tiles;
  p.offsets = s.offsets;
  p.sorted_token = s.sorted_token;
}

void combine(const MoeScratch& s, const float* weights, int64_t m, int64_t top_k, int64_t hidden, float* out) {
  constexpr int kThreads = 256;
  kernels::moe_combine_kernel<<<unsigned(ceil_div(m * hidden / 4, kThreads)), kThreads>>>(
      s.down, s.pair_row, weights, m, top_k, hidden, out);
}

// MXFP4 MoE tiles (kernels/moe_mxfp4_prefill.cuh): warps, weight tiles a warp, 8-row n-tiles,
// stages, minimum blocks an SM (a register cap). 4 warps x 3 tiles: gate/up blocks of 96 features
// and down blocks of 192, both dividing gpt-oss's 2880; 32 sorted rows a tile. C, the default:
// 2 stages and at most 128 registers, 4 blocks an SM (with the scales folded: gpt-oss-20b pp2048
// +6.5% over A, which gains nothing from folding at 2 blocks an SM). NIBBLE_MXFP4_PREFILL_TILE=a
// selects A for A/B runs (BENCHMARKS.md has two more, measured slower and removed).
using Mxfp4MoeA = kernels::Mxfp4MoeTile<false, 4, 3, 4, 4, 1>;  // 4 stages (93 KB), 186 registers
using Mxfp4MoeC = kernels::Mxfp4MoeTile<false, 4, 3, 4, 2, 4>;  // 2 stages (47 KB), 4 blocks an SM

template <class Down>
using GateUpOf =
    kernels::Mxfp4MoeTile<true, Down::kWarps, Down::kMT, Down::kNT, Down::kStages, Down::kMinBlocks>;

template <class Tile, bool kFold>
void launch_mxfp4_moe(const kernels::Mxfp4MoeGemmParams& p, int64_t max_tiles) {
  auto kernel = kernels::gemm_mxfp4_moe_kernel<Tile, kFold>;
  allow_smem(kernel, size_t(Tile::kSmemBytes));
  const dim3 grid(unsigned(max_tiles), unsigned(ceil_div(p.n, Tile::kFeatures)));
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes>>>(p);
}

template <class Down, bool kFold>
void moe_mxfp4_gemms(const MoeScratch& s, const Mxfp4Device* gate_up, const Mxfp4Device* down, const int32_t* ids,
                     const float* x, int64_t m, int64_t top_k, int64_t n_experts, int64_t inter, int64_t hidden,
                     float alpha, float limit) {
  using GateUp = GateUpOf<Down>;
  const int64_t pairs = m * top_k, max_tiles = ceil_div(pairs, Down::kBN) + n_experts;
  group_pairs(s, ids, m, top_k, n_experts, Down::kBN);
  constexpr int kThreads = 256;
  kernels::mxfp4_stage_rows_kernel<<<unsigned(ceil_div(m * hidden / 8, kThreads)), kThreads>>>(x, m, hidden,
                                                                                              s.staged);
  kernels::Mxfp4MoeGemmParams p{};
  set_tile_table(p, s);
  p.alpha = alpha;
  p.limit = limit;
  // gate/up: staged x[token] -> act[sorted row] (f16, staged order)
  p.x = s.staged;
  p.experts = reinterpret_cast<const kernels::Mxfp4Device*>(gate_up);
  p.n = inter;
  p.k = hidden;
  p.act = reinterpret_cast<__half*>(s.act);
  launch_mxfp4_moe<GateUp, kFold>(p, max_tiles);
  // down: act[sorted row] -> down[sorted row]
  p.x = reinterpret_cast<const __half*>(s.act);
  p.experts = reinterpret_cast<const kernels::Mxfp4Device*>(down);
  p.n = hidden;
  p.k = inter;
  p.y = s.down;
  launch_mxfp4_moe<Down, kFold>(p, max_tiles);
}

}  // namespace

void mxfp4_scales_outside_fold(const uint8_t* scales, int64_t count, unsigned* outside) {
  constexpr int kThreads = 256;
  kernels::mxfp4_scales_outside_kernel<<<unsigned(ceil_div(count, kThreads)), kThreads>>>(scales, count, outside);
}

void moe_prefill_mxfp4(const Mxfp4Device* gate_up, const Mxfp4Device* down, const int32_t* ids, const float* weights,
                       const float* x, float* out, int64_t m, int64_t top_k, int64_t n_experts, int64_t inter,
                       int64_t hidden, float alpha, float limit, bool fold_scales, void* scratch) {
  static_assert(sizeof(Mxfp4Device) == sizeof(kernels::Mxfp4Device));
  const MoeScratch s = carve_moe_scratch(scratch, m, top_k, n_experts, inter, hidden);
  static const char* variant = std::getenv("NIBBLE_MXFP4_PREFILL_TILE");
  static const bool no_fold = std::getenv("NIBBLE_MXFP4_NO_FOLD") != nullptr;  // for A/B runs
  const bool c = !(variant && variant[0] == 'a'), fold = fold_scales && !no_fold;
  auto run = [&](auto tile, auto fold_tag) {
    moe_mxfp4_gemms<decltype(tile), decltype(fold_tag)::value>(s, gate_up, down, ids, x, m, top_k, n_experts, inter,
                                                                hidden, alpha, limit);
  };
  if (fold)
    c ? run(Mxfp4MoeC{}, std::true_type{}) : run(Mxfp4MoeA{}, std::true_type{});
  else
    c ? run(Mxfp4MoeC{}, std::false_type{}) : run(Mxfp4MoeA{}, std::false_type{});
  combine(s, weights, m, top_k, hidden, out);
}

void moe_prefill_int4(const Int4Device* gate, const Int4Device* up, const Int4Device* down, const int32_t* ids,
                      const float* weights, const float* x, float* out, int64_t m, int64_t top_k, int64_t n_experts,
                      int64_t inter, int64_t hidden, void* scratch) {
  const MoeScratch s = carve_moe_scratch(scratch, m, top_k, n_experts, inter, hidden);
  const int64_t pairs = m * top_k;
  dispatch_moe_tile(pairs, n_experts, [&](auto tile) {
    using Tile = decltype(tile);
    group_pairs(s, ids, m, top_k, n_experts, Tile::kBM);
    kernels::GemmInt4Params p{};
    set_tile_table(p, s);
    p.m = pairs;
    const int64_t max_tiles = ceil_div(pairs, Tile::kBM) + n_experts;
    // gate and up: x[token] -> act[sorted row]
    p.x = x;
    p.y = s.act;
    p.n = inter;
    p.k = hidden;
    p.expert_a = reinterpret_cast<const kernels::Int4Weight*>(gate);
    p.expert_b = reinterpret_cast<const kernels::Int4Weight*>(up);
    launch_int4<Tile, GemmInt4Mode::kMoeGateUp>(p, max_tiles);
    // down: act[sorted row] -> down[sorted row]
    p.x = s.act;
    p.y = s.down;
    p.n = hidden;
    p.k = inter;
    p.expert_a = reinterpret_cast<const kernels::Int4Weight*>(down);
    p.expert_b = nullptr;
    launch_int4<Tile, GemmInt4Mode::kMoeDown>(p, max_tiles);
  });
  combine(s, weights, m, top_k, hidden, out);
}

}  // namespace nibble::cuda
