// Launch configurations of the reference CUDA kernels (kernels/*.cuh); see launch.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "backend/cuda/int4_args.cuh"
#include "backend/cuda/int4_layout.h"
#include "backend/cuda/launch.h"
#include "backend/cuda/launch_pdl.cuh"
#include "backend/cuda/smem_optin.cuh"
#include "kernels/attention.cuh"
#include "kernels/elementwise.cuh"
#include "kernels/gemv.cuh"
#include "kernels/gemv_mma.cuh"
#include "kernels/gemv_mxfp4.cuh"
#include "kernels/int4_stream.cuh"
#include "kernels/linear.cuh"
#include "kernels/moe.cuh"
#include "kernels/moe_mxfp4.cuh"
#include "kernels/moe_mxfp4_stream.cuh"
#include "kernels/mxfp4_stream.cuh"
#include "kernels/norm.cuh"

namespace nibble::cuda {
namespace {

unsigned blocks_for(int64_t threads_total, int threads_per_block) {
  return unsigned((threads_total + threads_per_block - 1) / threads_per_block);
}

template <template <kernels::DenseType> class Fn, typename... Args>
auto dispatch_dense(Dense type, Args... args) {
  switch (type) {
    case Dense::kF32: return Fn<kernels::DenseType::kF32>::run(args...);
    case Dense::kF16: return Fn<kernels::DenseType::kF16>::run(args...);
    case Dense::kBF16: break;
  }
  return Fn<kernels::DenseType::kBF16>::run(args...);
}

constexpr int kLinearWarps = 8;

template <kernels::DenseType T>
struct LinearDense {
  static void run(const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k) {
    kernels::linear_dense_warp_row_kernel<T><<<blocks_for(n, kLinearWarps), 32 * kLinearWarps>>>(w, bias, x, y, m, n, k);
  }
};

template <kernels::DenseType T>
struct Embed {
  static void run(const void* table, const int32_t* ids, int64_t m, int64_t dim, float* out) {
    constexpr int kThreads = 256;
    const dim3 grid(unsigned(m), unsigned(blocks_for(dim, kThreads * kernels::kEmbedPerThread)));
    launch_pdl(kernels::embed_kernel<T>, grid, kThreads, table, ids, dim, out);
  }
};


constexpr int kGemvWarps = kernels::kGemvThreads / 32;

// Rows per warp: more rows share the x registers, fewer rows keep more warps in flight; wide
// matrices have warps to spare.
template <typename Launch>
void gemv_dispatch(int64_t m, int64_t n, Launch&& launch) {
  auto grid = [&](int rows) { return blocks_for((n + rows - 1) / rows, kGemvWarps); };
  if (m == 1 && n >= 8192)
    launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{}, grid(4));
  else if (m == 1 && n >= 4096)  // q/k/v (5120 rows): 640 blocks, one wave
    launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{}, grid(2));
  else if (m == 1)
    launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, grid(1));
  else if (m == 2)
    launch(std::integral_constant<int, 2>{}, std::integral_constant<int, 1>{}, grid(1));
  else if (m <= 4)
    launch(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{}, grid(1));
  else
    launch(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{}, grid(1));
}

template <typename Fn>
void dispatch_norm(const GemvIo& io, Fn&& fn) {
  if (io.norm)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

kernels::GemvIo to_kernel(const GemvIo& io) {
  return {io.norm, io.eps, io.accumulate, io.normed_out, io.staged_out, io.clear, io.clear_count};
}

constexpr unsigned kDenseBlocksPerSm = 8;

// Matrices with at most this many rows per SM take the split-K dense GEMV (one block a row).
constexpr int64_t kDenseSplitKRowsPerSm = 1;
constexpr int kDenseSplitKWarps = 8;

template <kernels::DenseType T>
struct GemvDense {
  static void run(const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k,
                  const GemvIo& io) {
    static const bool no_split = std::getenv("NIBBLE_NO_SPLIT_K_GEMV") != nullptr;  // for A/B runs
    const bool split_k = n <= kDenseSplitKRowsPerSm * int64_t(sm_count()) && k >= 32 * kDenseSplitKWarps * 4 && !no_split;
    if (io.norm && io.normed_out && !split_k) rms_norm(x, nullptr, nullptr, io.norm, io.normed_out, m, k, io.eps);
    if (T == kernels::DenseType::kBF16 && !split_k && gemv_bf16_mma(w, bias, x, y, m, n, k, io)) return;
    if (split_k) {
      dispatch_norm(io, [&](auto kNorm) {
        // One row: the row's weights in registers before the wait, x read once (SplitKRowOnePass).
        // NIBBLE_NO_ROUTER_ONE_PASS=1: the two passes, for A/B runs.
        static const bool one_pass = std::getenv("NIBBLE_NO_ROUTER_ONE_PASS") == nullptr;
        auto go = [&](auto M, auto kOnePass) {
          launch_pdl(
              kernels::gemv_dense_split_k_kernel<T, M.value, kDenseSplitKWarps, kNorm.value, kOnePass.value>,
              unsigned(n), 32 * kDenseSplitKWarps, w, bias, x, y, int(m), n, k, to_kernel(io));
        };
        if (m == 1 && !one_pass)
          go(std::integral_constant<int, 1>{}, std::false_type{});
        else if (m == 1)
          go(std::integral_constant<int, 1>{}, std::true_type{});
        else if (m == 2)
          go(std::integral_constant<int, 2>{}, std::true_type{});
        else if (m <= 4)
          go(std::integral_constant<int, 4>{}, std::true_type{});
        else
          go(std::integral_constant<int, 8>{}, std::true_type{});
      });
      return;
    }
    dispatch_norm(io, [&](auto kNorm) {
      gemv_dispatch(m, n, [&](auto M, auto R, unsigned grid) {
        // At most kDenseBlocksPerSm blocks per SM; their warps stride over the rest of the rows.
        launch_pdl(kernels::gemv_dense_kernel<T, M.value, R.value, kNorm.value>,
                   std::min(grid, kDenseBlocksPerSm * sm_count()), 32 * kGemvWarps, w, bias, x, y, int(m), n, k,
                   to_kernel(io));
      });
    });
  }
};

template <kernels::DenseType T>
struct MoeRouter {
  static void run(const void* w, const float* x, int64_t m, int64_t n_experts, int64_t hidden, const float* norm,
                  float eps, float* logits, int64_t top_k, bool normalize, int32_t* ids, float* weights,
                  unsigned* counter) {
    const size_t smem = size_t(kernels::moe_router_smem_bytes(m, hidden));
    // Up to 128 experts the blocks meet in one cluster instead of through the last-block
    // counter's L2 round trips (in-kernel timeline: 0.7 µs less a MoE layer).
    const bool cluster = clusters_supported() && n_experts <= kernels::kRouterClusterExperts;
    auto go = [&](auto M, auto kNorm) {
      if (cluster) {
        const auto kernel = kernels::moe_router_cluster_kernel<T, M.value, kNorm.value>;
        allow_smem(kernel, smem);
        const unsigned blocks = blocks_for(n_experts, kernels::kRouterClusterWarps);
        launch_pdl_cluster(kernel, blocks, 32 * kernels::kRouterClusterWarps, smem, blocks, w, x, int(m), n_experts,
                           hidden, norm, eps, top_k, normalize, ids, weights);
        return;
      }
      const auto kernel = kernels::moe_router_kernel<T, M.value, kNorm.value>;
      allow_smem(kernel, smem);
      launch_pdl_smem(kernel, blocks_for(n_experts, kGemvWarps), 32 * kGemvWarps, smem, w, x, int(m), n_experts,
                      hidden, norm, eps, logits, top_k, normalize, ids, weights, counter);
    };
    auto with_m = [&](auto kNorm) {
      if (m == 1)
        go(std::integral_constant<int, 1>{}, kNorm);
      else if (m <= 4)
        go(std::integral_constant<int, 4>{}, kNorm);
      else
        go(std::integral_constant<int, 8>{}, kNorm);
    };
    if (norm)
      with_m(std::true_type{});
    else
      with_m(std::false_type{});
  }
};

template <kernels::DenseType T>
struct MoeRouterLogits {
  // xn is written where every lane's vectors of a row are in registers and there are warps for
  // all of them.
  static bool run(const void* w, const float* x, int64_t m, int64_t n_experts, int64_t hidden, const float* norm,
                  float eps, float* logits, void* xn, int replicas, int64_t replica_stride) {
    const int64_t vecs = hidden / (32 * kernels::DenseVec<T>::kPerVec);
    if (vecs > kernels::kRouterVecs || vecs > n_experts) xn = nullptr;
    auto go = [&](auto kNorm) {
      launch_pdl(kernels::moe_router_logits_kernel<T, kNorm.value>,
                 blocks_for(n_experts, kernels::kRouterLogitsWarps), 32 * kernels::kRouterLogitsWarps, w, x, int(m),
                 n_experts, hidden, norm, eps, logits, static_cast<__half*>(xn), replicas, replica_stride);
    };
    if (norm)
      go(std::true_type{});
    else
      go(std::false_type{});
    return xn != nullptr;
  }
};

}  // namespace

void fill_random(void* dst, int kind, int64_t count, float lo, float hi, uint64_t seed) {
  kernels::fill_random_kernel<<<unsigned(std::min<int64_t>(blocks_for(count, 256), 65536)), 256>>>(
      dst, kind, count, lo, hi, seed);
}

void linear_dense(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m,
                  int64_t n, int64_t k) {
  dispatch_dense<LinearDense>(type, w, bias, x, y, m, n, k);
}

void int4_interleave(const uint8_t* src, uint8_t* dst, int64_t n, int64_t k) {
  kernels::int4_interleave_kernel<<<blocks_for(n * k / 8, 256), 256>>>(src, dst, n, k);
}

// Codes per group within one 8-code word, a template parameter of the INT4 kernels.
template <typename Fn>
void dispatch_cpg(int64_t group_shift, Fn&& fn) {
  if (group_shift >= 8)
    fn(std::integral_constant<int, 8>{});
  else if (group_shift == 7)
    fn(std::integral_constant<int, 4>{});
  else if (group_shift == 6)
    fn(std::integral_constant<int, 2>{});
  else
    fn(std::integral_constant<int, 1>{});
}

// Warps along K per 16-row tile (KS) and tiles per block (NTB) of the tensor-core decode GEMV: one
// group of 4 chunks per warp up to K = 8192, 4 warps a block where the tiles allow it. With m
// rows every block stages all of them (normalised) from L2 before its products, so blocks of 2x
// the tiles from 2 rows and 4x from 4 rows halve and quarter that staging, spread over more
// threads. Measured (BENCHMARKS.md, `nibble bench --batch`, Qwen3-30B-A3B INT4, H100): batch 2
// +3%, 4 +9%, 8 +10% aggregate tok/s; one row keeps the smaller blocks (more of them in flight).
template <typename Fn>
void dispatch_mma_split(int64_t k, Fn&& fn, int64_t m = 1) {
  using std::integral_constant;
  const int64_t quads = (k / 256 + 3) / 4;
  if (quads >= 5) {
    fn(integral_constant<int, 8>{}, integral_constant<int, 1>{});
  } else if (quads >= 3) {
    if (m >= 4)
      fn(integral_constant<int, 4>{}, integral_constant<int, 4>{});
    else if (m >= 2)
      fn(integral_constant<int, 4>{}, integral_constant<int, 2>{});
    else
      fn(integral_constant<int, 4>{}, integral_constant<int, 1>{});
  } else if (quads == 2) {
    if (m >= 4)
      fn(integral_constant<int, 2>{}, integral_constant<int, 8>{});
    else if (m >= 2)
      fn(integral_constant<int, 2>{}, integral_constant<int, 4>{});
    else
      fn(integral_constant<int, 2>{}, integral_constant<int, 2>{});
  } else {
    fn(integral_constant<int, 1>{}, integral_constant<int, 4>{});
  }
}

// MXFP4 decode GEMVs with at least this many 16-row tiles (an lm_head) stride over them.
constexpr int64_t kMxfp4StrideTiles = 2048;

// Warps along K per 16-row tile (KS), tiles per block (NTB) and groups of 128 k a warp loads at once
// (B) of the MXFP4 decode GEMV. Chosen alone on gpt-oss's shapes (H100,
// tools/kernel-bench/gemv_mxfp4_bench.cu): q/k/v (320 tiles, 23 groups) 4 warps along K (12.2 µs
// against 14.8 with 8), o (180 tiles, 32 groups) 8 (8.4 µs against 10.7 with 4); an lm_head's
// thousands of tiles 4 a block of 2 warps each, the blocks striding over them. B covers all of a
// warp's groups where that is at most 6 (q/k/v: 6 of 23, o: 4 of 32), so in the decode pipeline
// every weight load goes out before the PDL wait: alone that is only 2-6% faster (q/k/v 9.8-10.1
// µs against 10.2-10.5), in the pipeline it takes q/k/v's second DRAM round trip after the wait
// away (A/B: gpt-oss-20b all-MXFP4 tg128 +3.1%, BENCHMARKS.md).
// NIBBLE_MXFP4_GEMV_BATCH4=1: 4 groups a batch everywhere (two batches for q/k/v), for A/B runs.
template <typename Fn>
void dispatch_mxfp4_split(int64_t k, int64_t n, Fn&& fn) {
  using std::integral_constant;
  static const bool batch4 = std::getenv("NIBBLE_MXFP4_GEMV_BATCH4") != nullptr;
  const int64_t groups = kernels::mxfp4_groups(k);
  const int64_t batches = (groups + kernels::kMxfp4Batch - 1) / kernels::kMxfp4Batch;
  const int64_t tiles = (n + 15) / 16, sms = int64_t(sm_count());
  constexpr integral_constant<int, kernels::kMxfp4Batch> b4{};
  if (tiles >= kMxfp4StrideTiles)
    fn(integral_constant<int, 2>{}, integral_constant<int, 4>{}, b4);
  else if (batches > 2 && tiles >= 2 * sms) {
    if (!batch4 && (groups + 3) / 4 > 4 && (groups + 3) / 4 <= 6)
      fn(integral_constant<int, 4>{}, integral_constant<int, 1>{}, integral_constant<int, 6>{});
    else
      fn(integral_constant<int, 4>{}, integral_constant<int, 1>{}, b4);
  } else if (batches > 4)
    fn(integral_constant<int, 8>{}, integral_constant<int, 1>{}, b4);
  else if (batches > 2)
    fn(integral_constant<int, 4>{}, integral_constant<int, 2>{}, b4);
  else if (batches == 2)
    fn(integral_constant<int, 2>{}, integral_constant<int, 4>{}, b4);
  else
    fn(integral_constant<int, 1>{}, integral_constant<int, 8>{}, b4);
}

// The streamed INT4 GEMV (kernels/int4_stream.cuh) for one token: the INT4 tile consumer of the
// persistent decode step (docs/persistent-decode.md, measured and not built), checked against the
// CPU reference on its own (OpsTest.LinearInt4Streamed). As a launch of its own it lost 0.6% to the
// register GEMV in the decode step (BENCHMARKS.md, H200), so it is off unless NIBBLE_INT4_STREAM=1
// (read once) or set_int4_stream(true). The stages that fit (at least the tiles the consumers take at once),
// 0 where the register GEMV takes it.
constexpr int kInt4StreamWarps = 8;

static std::atomic<int>& int4_stream_switch() {
  static std::atomic<int> on{[] {
    const char* env = std::getenv("NIBBLE_INT4_STREAM");
    return env && std::string_view(env) == "1" ? 1 : 0;
  }()};
  return on;
}

void set_int4_stream(bool on) { int4_stream_switch().store(on ? 1 : 0, std::memory_order_relaxed); }

static int gemv_int4_stream_stages(const Int4Device& w, int64_t m, int64_t n, int64_t k, const GemvIo& io) {
  constexpr int W = kInt4StreamWarps;
  if (m != 1 || !int4_stream_switch().load(std::memory_order_relaxed) || io.normed_out || io.staged_out ||
      n % 16 != 0 || k % 256 != 0 || (io.norm && k / 4 > kernels::kInt4StreamStageUnits * 32 * (W + 1)) ||
      !clusters_supported())
    return 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(w.codes) || !aligned(w.scales) || (w.zeros && !aligned(w.zeros))) return 0;
  const bool zeros = w.zeros != nullptr;
  const int64_t base = kernels::int4_stream_smem(k, w.n_groups, zeros, 0, W);
  const int64_t per_stage = kernels::int4_stream_smem(k, w.n_groups, zeros, 1, W) - base;
  const int batch = kernels::int4_stream_batch(k, W);
  const int stages = int(std::min<int64_t>(std::max(batch, 2), (smem_optin_bytes() - 2048 - base) / per_stage));
  return stages >= batch ? stages : 0;
}

static void gemv_int4_stream(const Int4Device& w, const float* bias, const float* x, float* y, int64_t n, int64_t k,
                             const GemvIo& io, int stages) {
  constexpr int W = kInt4StreamWarps, threads = 32 * (W + 1);
  const kernels::Int4Weight kw = to_kernel(w);
  const size_t smem = size_t(kernels::int4_stream_smem(k, w.n_groups, w.zeros != nullptr, stages, W));
  dispatch_norm(io, [&](auto kNorm) {
    dispatch_cpg(w.group_shift, [&](auto CPG) {
      const auto kernel = kernels::gemv_int4_stream_kernel<CPG.value, W, kNorm.value>;
      allow_smem(kernel, smem);
      const int64_t resident = int64_t(resident_blocks(kernel, threads, smem)) * int64_t(sm_count());
      launch_pdl_smem(kernel, unsigned(std::min<int64_t>(n / 16, resident)), threads, smem, kw, bias, x, y, n, k,
                      to_kernel(io), stages);
    });
  });
}

// The INT4 decode GEMVs at one token (q/k/v, o, a 4-bit lm_head) with each quantisation group's
// products split between two warps (MmaTile's SUB): twice the warps a block to issue a tile's
// products once its row is staged (Qwen3-30B-A3B INT4 tg128 +5.2% at depth 0 on an H100; with
// the 4-bit head +0.4%, BENCHMARKS.md). The shapes split: a tile of 4 groups' warps a block (o), 3
// tiles of 2 (Qwen3's q/k/v) and 2 tiles of 2 (any other K of 2048 at one token, among them its
// 4-bit lm_head, 151,936 x 2048), every group whole. NIBBLE_INT4_SPLIT_GROUPS=0 for the
// one-warp-a-group kernels, =2 for all but the 2-tiles-of-2 shape, for A/B runs.
template <int KS, int NTB>
constexpr bool kInt4SplitShape = (KS == 4 && NTB == 1) || (KS == 2 && NTB == 3) || (KS == 2 && NTB == 2);
static bool int4_gemv_split_groups(int64_t m, int64_t k, int ks = 0, int ntb = 0) {
  static const int mode = [] {
    const char* env = std::getenv("NIBBLE_INT4_SPLIT_GROUPS");
    return env && std::string_view(env) == "0" ? 0 : env && std::string_view(env) == "2" ? 2 : 1;
  }();
  if (mode == 2 && ks == 2 && ntb == 2) return false;
  return mode != 0 && m == 1 && k % 1024 == 0;
}

// A long matrix at one token (a 4-bit lm_head: Qwen3's 9,496 tiles) on one wave of blocks that
// stride over its tiles (kernels::gemv_int4_mma_strided_kernel), each warp's next tile's loads
// issued as soon as its products are done, a warp to whole tiles (Qwen3 INT4 with the 4-bit head
// +1.3%, then +0.8% for a warp's whole group, +0.6% for its whole tile, on an H200,
// BENCHMARKS.md). Taken where the dispatch picks 2 tiles of 2 warps (the head's: K of 2048), from
// 32 tiles an SM. NIBBLE_INT4_STRIDED=0 (read once) keeps such a matrix on the one-pass kernel,
// for A/B runs; set_int4_strided forces either way on any matrix of the shape (tests).
template <int KS, int NTB>
constexpr bool kInt4StridedShape = KS == 2 && NTB == 2;
static std::atomic<int> g_int4_strided{-1};
void set_int4_strided(int mode) { g_int4_strided.store(mode, std::memory_order_relaxed); }
static bool int4_gemv_strided(int64_t m, int64_t n, const GemvIo& io) {
  static const bool env_off = [] {
    const char* env = std::getenv("NIBBLE_INT4_STRIDED");
    return env && std::string_view(env) == "0";
  }();
  const int forced = g_int4_strided.load(std::memory_order_relaxed);
  if (forced == 0 || (forced < 0 && env_off) || m != 1 || io.staged_out || io.normed_out) return false;
  return forced > 0 || (n + 15) / 16 >= 32 * int64_t(sm_count());
}

// A warp to whole tiles, 4 warps a block (kernels::gemv_int4_mma_strided_kernel).
template <int CPG, bool kNorm>
static void gemv_int4_strided_launch(const kernels::Int4Weight& kw, const float* bias, const float* x, float* y,
                                     int64_t n, int64_t k, const GemvIo& io) {
  constexpr int kWarps = 4;
  const size_t smem = size_t(kernels::mma_x_bytes(1, k));
  const auto kernel = kernels::gemv_int4_mma_strided_kernel<CPG, kNorm, kWarps>;
  allow_smem(kernel, smem);
  const int64_t blocks = std::min<int64_t>((n + 16 * kWarps - 1) / (16 * kWarps),
                                           int64_t(resident_blocks(kernel, 32 * kWarps, smem)) * sm_count());
  launch_pdl_smem(kernel, unsigned(blocks), 32 * kWarps, smem, kw, bias, x, y, n, k, to_kernel(io));
}

void gemv_int4(const Int4Device& w, const float* bias, const float* x, float* y, int64_t m, int64_t n,
               int64_t k, const GemvIo& io) {
  if (const int stages = gemv_int4_stream_stages(w, m, n, k, io); stages > 0) {
    if (io.clear)  // the streamed kernel has no clear of its own
      cudaMemsetAsync(io.clear, 0, size_t(io.clear_count) * 8, cudaStreamPerThread);  // errors: the caller checks
    return gemv_int4_stream(w, bias, x, y, n, k, io, stages);
  }
  const kernels::Int4Weight kw = to_kernel(w);
  const size_t smem = size_t(kernels::mma_x_bytes(m, k));
  dispatch_norm(io, [&](auto kNorm) {
    dispatch_cpg(w.group_shift, [&](auto CPG) {
      auto go_sub = [&](auto KS, auto NTB, auto SUB) {
        const auto kernel =
            kernels::gemv_int4_mma_kernel<CPG.value, kNorm.value, KS.value, NTB.value, false, SUB.value>;
        allow_smem(kernel, smem);
        launch_pdl_smem(kernel, blocks_for((n + 15) / 16, NTB.value), 32 * KS.value * NTB.value, smem, kw, bias, x, y,
                        int(m), n, k, to_kernel(io), kernels::RouterFold{});
      };
      auto go = [&](auto KS, auto NTB) {
        if constexpr (kInt4StridedShape<KS.value, NTB.value>) {
          if (int4_gemv_strided(m, n, io))
            return gemv_int4_strided_launch<CPG.value, kNorm.value>(kw, bias, x, y, n, k, io);
        }
        if constexpr (kInt4SplitShape<KS.value, NTB.value>) {
          if (int4_gemv_split_groups(m, k, KS.value, NTB.value))
            return go_sub(std::integral_constant<int, 2 * KS.value>{}, NTB, std::integral_constant<int, 2>{});
        }
        go_sub(KS, NTB, std::integral_constant<int, 1>{});
      };
      // A few tiles (a 4-bit MoE router: 128 rows) with long rows: 8 warps along K and a tile a
      // block, so that each warp's serial share is short (the router is on the critical path).
      // Between 2 and 3 tiles an SM at one row (Qwen3-30B-A3B's q/k/v: 320 tiles of 2048 k), 3
      // tiles a block: one block an SM, at most 3 tiles of weights, where 2 a block left 28 SMs
      // with two blocks (4 tiles), the second often not resident beside the MoE down kernel when
      // released (the timeline's "late" 1.1 µs). A/B on the H100 (BENCHMARKS.md): tg128 +0.9% at
      // depth 0, +1.7% with the 4-bit lm_head. NIBBLE_INT4_GEMV_NTB2=1: 2 a block, for A/B runs.
      static const bool two = std::getenv("NIBBLE_INT4_GEMV_NTB2") != nullptr;
      const int64_t tiles = (n + 15) / 16, sms = int64_t(sm_count());
      if (tiles <= 16 && k >= 2048 && m <= 2)
        go(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{});
      else if (!two && m == 1 && (k / 256 + 3) / 4 == 2 && tiles > 2 * sms && tiles <= 3 * sms)
        go(std::integral_constant<int, 2>{}, std::integral_constant<int, 3>{});
      else
        dispatch_mma_split(k, go, m);
    });
  });
}

// Whether gemv_mxfp4_router_fold's callers take its routing launch: NIBBLE_FOLD_ROUTE_LAUNCH=1
// always, =0 never (read once; set_fold_route_launch), otherwise where the experts are more than
// the expert kernels' one-trip routing holds (4 a lane of the routing warp: router_acc_lane_logits).
// A switch read once from the environment: "1" → 1, "0" → 0, unset or else → -1 (the default).
static int env_switch(const char* name) {
  const char* env = std::getenv(name);
  if (!env) return -1;
  return std::string_view(env) == "1" ? 1 : std::string_view(env) == "0" ? 0 : -1;
}

static std::atomic<int>& fold_route_launch_switch() {
  static std::atomic<int> mode{env_switch("NIBBLE_FOLD_ROUTE_LAUNCH")};
  return mode;
}
void set_fold_route_launch(int mode) { fold_route_launch_switch().store(mode, std::memory_order_relaxed); }
bool fold_route_launch(int64_t n_experts) {
  const int mode = fold_route_launch_switch().load(std::memory_order_relaxed);
  return mode < 0 ? n_experts > 128 : mode == 1;
}

static std::atomic<int64_t> g_router_fold_launches{0};
int64_t router_fold_launches() { return g_router_fold_launches.load(std::memory_order_relaxed); }

static kernels::RouterAcc to_kernel(const RouterAcc& a, int64_t hidden, float eps) {
  return {a.sums, a.replicas, a.stride, hidden, eps};
}

// The folded o GEMV's shared-memory carveout: the most shared memory (100), though its blocks use
// ~9 KB. Measured, not understood: +0.5-0.7% a Qwen3-30B-A3B INT4 decode step at depth 0 (+0.6%
// with the 4-bit head), a tie at 8192 and 16384 with FP8 KV, on an H200; the same preference for
// MoE gate/up lost 1.5-2.4%, for down 0.2%, for decode attention 0.3%, for every decode kernel
// 1.1-2.2%; the q/k/v GEMV tied (BENCHMARKS.md, docs/experiments/2026-11-28-smem-carveout.patch).
// NIBBLE_CARVEOUT_OFOLD=percent overrides it for A/B runs (-1: the driver's default).
static int ofold_smem_carveout() {
  static const int percent = [] {
    const char* s = std::getenv("NIBBLE_CARVEOUT_OFOLD");
    return s ? std::atoi(s) : 100;
  }();
  return percent;
}

bool gemv_int4_router_fold(const Int4Device& w, const float* bias, const float* x, float* y, int64_t n, int64_t k,
                           const void* router, bool bf16, const float* norm, int64_t n_experts, const RouterAcc& acc,
                           void* xg) {
  if (gemv_int4_stream_stages(w, 1, n, k, {nullptr, 0.f, true}) > 0) return false;
  const kernels::Int4Weight kw = to_kernel(w);
  const size_t smem = size_t(kernels::mma_x_bytes(1, k));
  bool launched = false;
  dispatch_cpg(w.group_shift, [&](auto CPG) {
    // The shapes gemv_int4 gives one token with one tile a block (o projections: k >= 1280).
    auto launch_fold = [&](auto KS, auto SUB) {
      const int threads = 32 * KS.value;
      if (n % 16 != 0 || n_experts > kernels::kFoldExpertsPerThread * threads) return;
      const auto kernel = kernels::gemv_int4_mma_kernel<CPG.value, false, KS.value, 1, true, SUB.value>;
      allow_smem(kernel, smem);
      prefer_smem_carveout(kernel, ofold_smem_carveout());
      // The sums' norm fields are the readers' (moe_decode_int4): unused here.
      const kernels::RouterFold fold{static_cast<const uint16_t*>(router), norm, static_cast<__half*>(xg),
                                     to_kernel(acc, n, 0.f), n_experts, bf16};
      launch_pdl_smem(kernel, unsigned(n / 16), threads, smem, kw, bias, x, y, 1, n, k,
                      kernels::GemvIo{nullptr, 0.f, true, nullptr, nullptr}, fold);
      launched = true;
      g_router_fold_launches.fetch_add(1, std::memory_order_relaxed);
    };
    dispatch_mma_split(k, [&](auto KS, auto NTB) {
      if constexpr (NTB.value == 1) {
        if constexpr (kInt4SplitShape<KS.value, 1>) {
          if (int4_gemv_split_groups(1, k))
            return launch_fold(std::integral_constant<int, 2 * KS.value>{}, std::integral_constant<int, 2>{});
        }
        launch_fold(KS, std::integral_constant<int, 1>{});
      }
    });
  });
  return launched;
}

void gemv_dense(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m,
                int64_t n, int64_t k, const GemvIo& io) {
  dispatch_dense<GemvDense>(type, w, bias, x, y, m, n, k, io);
}

void moe_router(Dense type, const void* w, const float* x, int64_t m, int64_t n_experts, int64_t hidden,
                const float* norm, float eps, float* logits, int64_t top_k, bool normalize, int32_t* ids,
                float* weights, unsigned* counter) {
  dispatch_dense<MoeRouter>(type, w, x, m, n_experts, hidden, norm, eps, logits, top_k, normalize, ids, weights,
                            counter);
}

bool moe_router_logits(Dense type, const void* w, const float* x, int64_t m, int64_t n_experts, int64_t hidden,
                       const float* norm, float eps, float* logits, void* xn, int replicas, int64_t replica_stride) {
  return dispatch_dense<MoeRouterLogits>(type, w, x, m, n_experts, hidden, norm, eps, logits, xn, replicas,
                                         replica_stride);
}

void moe_decode_int4(const Int4Device* gate, const Int4Device* up, const Int4Device* down, int64_t n_experts,
                     int64_t group_shift, const MoeRouting& routing, const float* x, const float* norm, float eps,
                     void* act, float* out, bool accumulate, int64_t m, int64_t top_k, int64_t inter,
                     int64_t hidden) {
  const auto* g = reinterpret_cast<const kernels::Int4Weight*>(gate);
  const auto* u = reinterpret_cast<const kernels::Int4Weight*>(up);
  const auto* d = reinterpret_cast<const kernels::Int4Weight*>(down);
  auto* act_h = static_cast<__half*>(act);
  dispatch_cpg(group_shift, [&](auto CPG) {
    dispatch_mma_split(hidden, [&](auto KS, auto) {
      const dim3 grid(unsigned((inter + 15) / 16), unsigned(m * top_k));
      const size_t smem = size_t(kernels::moe_gate_up_smem_bytes(hidden, n_experts));
      auto gate_up = [&](auto kNorm, auto kOnce) {
        auto go = [&](auto kFolded) {
          const auto kernel =
              kernels::moe_gate_up_int4_mma_kernel<CPG.value, kNorm.value, KS.value, kOnce.value, kFolded.value>;
          allow_smem(kernel, smem);
          launch_pdl_smem(kernel, grid, 64 * KS.value, smem, g, u, n_experts, routing.ids, routing.logits,
                          static_cast<const __half*>(routing.xn), x, act_h, top_k, inter, hidden, norm, eps,
                          routing.logit_replicas, routing.replica_stride, to_kernel(routing.acc, hidden, eps));
        };
        // A folded router is one token's (kOnce) with the norm.
        if constexpr (kNorm.value && kOnce.value)
          if (routing.acc.sums) return go(std::true_type{});
        go(std::false_type{});
      };
      // One token reads each expert once (evict-first loads); a batch's tokens may share them.
      auto with_norm = [&](auto kOnce) {
        if (norm)
          gate_up(std::true_type{}, kOnce);
        else
          gate_up(std::false_type{}, kOnce);
      };
      if (m == 1)
        with_norm(std::true_type{});
      else
        with_norm(std::false_type{});
    });
    // Down: one 16-row tile per block, one warp per slot (128 blocks of 8 warps for hidden 2048).
    const dim3 grid(unsigned((hidden + 15) / 16), unsigned(m));
    const size_t smem = size_t(kernels::mma_x_bytes(top_k, inter));
    auto down = [&](auto kOnce) {
      auto go = [&](auto kFolded) {
        const auto kernel = kernels::moe_down_int4_mma_kernel<CPG.value, kOnce.value, kFolded.value>;
        allow_smem(kernel, smem);
        launch_pdl_smem(kernel, grid, 32 * kernels::kMoeDownSlots, smem, d, routing.ids, routing.weights,
                        routing.logits, n_experts, routing.normalize, act_h, out, top_k, inter, hidden, accumulate,
                        routing.logit_replicas, routing.replica_stride, to_kernel(routing.acc, hidden, eps));
      };
      if constexpr (kOnce.value)
        if (routing.acc.sums) return go(std::true_type{});
      go(std::false_type{});
    };
    // One token: evict-first loads (kOnce). Two warps a slot (each half the tile's rows) measured
    // +0.8% with the older dequantisation and tied (H100) or lost 0.4% (H200) after fde289e's:
    // removed (BENCHMARKS.md).
    if (m == 1)
      down(std::true_type{});
    else
      down(std::false_type{});
  });
}

Int4MoeDecodeResidency int4_moe_decode_residency(int64_t hidden, int64_t group_size, int64_t n_experts) {
  Int4MoeDecodeResidency r;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess)
    r.compute_capability = 10 * major + minor;
  dispatch_cpg(int4_group_shift(hidden, group_size), [&](auto CPG) {
    dispatch_mma_split(hidden, [&](auto KS, auto) {
      const auto gate_up = kernels::moe_gate_up_int4_mma_kernel<CPG.value, true, KS.value, true, true>;
      const auto down = kernels::moe_down_int4_mma_kernel<CPG.value, true, true>;
      cudaFuncAttributes a{};
      r.gate_up_threads = 64 * KS.value;
      if (cudaFuncGetAttributes(&a, gate_up) == cudaSuccess) r.gate_up_registers = a.numRegs;
      const size_t smem = size_t(kernels::moe_gate_up_smem_bytes(hidden, n_experts));
      allow_smem(gate_up, smem);
      int blocks = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gate_up, r.gate_up_threads, smem) == cudaSuccess)
        r.gate_up_blocks_per_sm = blocks;
      r.down_threads = 32 * kernels::kMoeDownSlots;
      if (cudaFuncGetAttributes(&a, down) == cudaSuccess) r.down_registers = a.numRegs;
    });
  });
  return r;
}

int64_t attention_partial_floats(int64_t m, int64_t max_context, int64_t n_head, int64_t head_dim) {
  // The smaller split of the two kernels: the f32 kernel's long-context split (asserted below).
  const int64_t n_splits = (max_context + kernels::kDecodeSplitLong - 1) / kernels::kDecodeSplitLong;
  return m * n_head * n_splits * kernels::decode_partial_stride(head_dim);
}

bool attention_decode_supports(int64_t m, int64_t n_head, int64_t n_head_kv, int64_t head_dim, DType kv_dtype) {
  const int64_t group = n_head / n_head_kv;
  return (head_dim == 64 || head_dim == 128) && group <= (kv_dtype != DType::F32 ? kernels::kDecodeTcRows : 8) &&
         m * n_head_kv <= kAttentionMaxPairs;
}

// Positions per split of the tensor-core kernel: 256, 512 for context buckets above 16K (a
// bucket is a power of two, the context is more than half of it); 8 warps per block where the
// GQA group fits 8 rows, 4 (16 rows) above. Measured on the H100 (tg128 tok/s at depths 0 / 8192
// / 16384, buckets 256 / 16K / 32K, split/warps): 256/4 371 / 273 / 235, 256/8 369 / 294 / 240,
// 512/8 367 / 289 / 267, 128/8 370 / 261 / 211; with 4 warps, 64 / 128 / 256 / 512 gave 333 /
// 365 / 366 / 364 at depth 0 (BENCHMARKS.md). Fewer splits merge fewer partials, more warps keep
// more loads in flight.
constexpr int decode_tc_split(int64_t max_context) { return max_context > 16384 ? 512 : 256; }
static_assert(kernels::kDecodeSplitLong <= decode_tc_split(0), "attention_partial_floats sizes for the smaller");

// Blocks that merge a (token, kv head)'s split partials (decode_merge_last_split): two heads each,
// so that no one block reads all of a pair's partials, while the blocks that poll for the last
// split stay at most half the SMs (pairs x mergers), so the splits they wait for find SMs.
// Qwen3-30B-A3B INT4 at depth 8192 on an H100 (BENCHMARKS.md): one merger 406 tok/s, a head each
// 438, two heads each 441, four 432. NIBBLE_ATTN_MERGERS=n caps them (1: the last split merges
// alone, as before), for A/B runs.
static int attention_mergers(int64_t pairs, int64_t group) {
  static const int cap = [] {
    const char* env = std::getenv("NIBBLE_ATTN_MERGERS");
    return env ? std::max(1, std::atoi(env)) : 1 << 30;
  }();
  const int64_t fit = int64_t(sm_count()) / 2 / std::max<int64_t>(pairs, 1);
  return int(std::clamp<int64_t>(std::min<int64_t>({fit, (group + 1) / 2, cap}), 1, 1 << 30));
}

// Blocks a cluster when a (token, kv head) pair's splits are one cluster's blocks and merge
// through distributed shared memory (attention_decode_tc_kernel<..., kCluster>), 0 for the split
// merge through L2 (decode_merge_last_split). By context bucket: up to 256 one split holds every
// position and needs no merge; to 1024, 8 blocks; to 4096, 16; past that the 256-position splits
// (33 blocks a pair at depth 8192), whose loads a cluster's 16 blocks do not match. Qwen3-30B-A3B
// INT4 tg128 on an H200 (BENCHMARKS.md), merge through L2 against this choice: depth 300 520 ->
// 580, 512 519 -> 576, 1024 517 -> 560, 2048 518 -> 540, 3072 517 -> 533 (8 blocks there 506);
// 16 blocks at 6144 and 8192 lost 5% and 8% (8 blocks 12% and 17%). Only where every pair's
// cluster is resident at once (an H200 holds 7 clusters of 16 one-block-an-SM blocks, 15 of 8).
// NIBBLE_ATTN_CLUSTER=0, 8 or 16 overrides the choice (read at each launch: A/B runs and tests),
// 0 the merge through L2.
template <typename... Params>
static unsigned attention_cluster(void (*kernel)(Params...), int threads, int64_t pairs, int64_t max_context) {
  if (!clusters_supported()) return 0;
  const char* env = std::getenv("NIBBLE_ATTN_CLUSTER");
  const int forced = env && *env ? std::atoi(env) : -1;
  const unsigned c = forced >= 0                ? unsigned(forced == 8 || forced == 16 ? forced : 0)
                     : max_context <= 256      ? 0u
                     : max_context <= 1024     ? 8u
                     : max_context <= 4096     ? 16u
                                               : 0u;
  return c > 0 && int64_t(max_active_clusters(kernel, threads, 0, c)) >= pairs ? c : 0;
}

bool attention_decode(const float* q, const KvPages& kv, float* partial, float* out, unsigned long long* counters, int64_t m,
                      const int32_t* positions, int64_t max_context, int64_t n_head, int64_t n_head_kv,
                      int64_t head_dim, float scale, const float* sinks, int64_t window,
                      const AttentionPrologue* prologue) {
  if (!attention_decode_supports(m, n_head, n_head_kv, head_dim, kv.dtype)) return false;
  if (prologue && kv.dtype == DType::F32) return false;  // the tensor-core kernel only
  const kernels::AttentionPrologue pro = prologue ? *prologue : kernels::AttentionPrologue{};
  const kernels::AttentionMods mods{sinks, window};
  const int64_t group = n_head / n_head_kv;
  if (kv.dtype != DType::F32) {  // f16 or E4M3: the tensor-core kernel
    const int split = decode_tc_split(max_context);
    const int64_t n_splits = (max_context + split - 1) / split;
    if (n_splits >= int64_t(kernels::kMergeLaunchCount)) return false;  // the merge's count (attention.cuh)
    const dim3 grid(unsigned(m * n_head_kv), unsigned(n_splits));
    const float scale_log2 = scale * 1.4426950408889634f;
    const int mergers = attention_mergers(m * n_head_kv, group);
    auto launch = [&](auto HD, auto SPLIT, auto WARPS, auto ROWS) {
      kernels::with_kv_element(kv.dtype, [&](auto element) {
        using T = decltype(element);
        if constexpr (!std::is_same_v<T, float>) {
          // The cluster kernel sizes its splits itself: one instantiation, whatever the bucket.
          auto* clustered = kernels::attention_decode_tc_kernel<HD.value, 256, WARPS.value, ROWS.value, T, true>;
          if (const unsigned c = attention_cluster(clustered, 32 * WARPS.value, m * n_head_kv, max_context)) {
            launch_pdl_cluster(clustered, dim3(c, unsigned(m * n_head_kv)), dim3(32 * WARPS.value), 0, c, q,
                               static_cast<const T*>(kv.k), static_cast<const T*>(kv.v), kv.block_table, kv.seq_rows,
                               kv.table_stride, kv.block_size_log2, partial, out, counters, positions, n_head,
                               n_head_kv, scale_log2, int64_t(c), mods, pro, static_cast<T*>(kv.k),
                               static_cast<T*>(kv.v), mergers);
            return;
          }
          launch_pdl(kernels::attention_decode_tc_kernel<HD.value, SPLIT.value, WARPS.value, ROWS.value, T>, grid,
                     32 * WARPS.value, q, static_cast<const T*>(kv.k), static_cast<const T*>(kv.v), kv.block_table,
                     kv.seq_rows, kv.table_stride, kv.block_size_log2, partial, out, counters, positions, n_head,
                     n_head_kv, scale_log2, n_splits, mods, pro, static_cast<T*>(kv.k), static_cast<T*>(kv.v),
                     mergers);
        }
      });
    };
    auto with_rows = [&](auto HD, auto SPLIT) {
      if (group > 8)
        launch(HD, SPLIT, std::integral_constant<int, 4>{}, std::integral_constant<int, 16>{});
      else
        launch(HD, SPLIT, std::integral_constant<int, 8>{}, std::integral_constant<int, 8>{});
    };
    auto with_split = [&](auto HD) {
      if (split == 512)
        with_rows(HD, std::integral_constant<int, 512>{});
      else
        with_rows(HD, std::integral_constant<int, 256>{});
    };
    if (head_dim == 64)
      with_split(std::integral_constant<int, 64>{});
    else
      with_split(std::integral_constant<int, 128>{});
    return true;
  }
  const int split = kernels::decode_split(max_context);
  const int64_t n_splits = (max_context + split - 1) / split;
  if (n_splits >= int64_t(kernels::kMergeLaunchCount)) return false;
  const dim3 grid(unsigned(m * n_head_kv), unsigned(n_splits));
  const auto* k = static_cast<const float*>(kv.k);
  const auto* v = static_cast<const float*>(kv.v);
  auto go = [&](auto G, auto HD) {
    auto launch = [&](auto SPLIT) {
      launch_pdl(kernels::attention_decode_kernel<G.value, HD.value, SPLIT.value>, grid, kernels::kDecodeThreads, q, k,
                 v, kv.block_table, kv.seq_rows, kv.table_stride, kv.block_size_log2, partial, out, counters, positions, n_head, n_head_kv, scale,
                 n_splits, mods);
    };
    if (split == kernels::kDecodeSplitLong)
      launch(std::integral_constant<int, kernels::kDecodeSplitLong>{});
    else
      launch(std::integral_constant<int, kernels::kDecodeSplit>{});
  };
  auto with_g = [&](auto HD) {
    if (group == 1)
      go(std::integral_constant<int, 1>{}, HD);
    else if (group == 2)
      go(std::integral_constant<int, 2>{}, HD);
    else if (group <= 4)
      go(std::integral_constant<int, 4>{}, HD);
    else
      go(std::integral_constant<int, 8>{}, HD);
  };
  if (head_dim == 64)
    with_g(std::integral_constant<int, 64>{});
  else
    with_g(std::integral_constant<int, 128>{});
  return true;
}

void linear_int4(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, const float* bias,
                 const float* x, float* y, int64_t m, int64_t n, int64_t k, int64_t group_size,
                 int64_t n_groups) {
  kernels::linear_int4_warp_row_kernel<<<blocks_for(n, kLinearWarps), 32 * kLinearWarps>>>(
      codes, reinterpret_cast<const __half*>(scales), zeros, bias, x, y, m, n, k, group_size, n_groups);
}

void embed(Dense type, const void* table, const int32_t* ids, int64_t m, int64_t dim, float* out) {
  dispatch_dense<Embed>(type, table, ids, m, dim, out);
}

void rms_norm(const float* x, const float* delta, float* x_out, const float* w, float* y, int64_t rows,
              int64_t dim, float eps) {
  static_assert(kNormMaxDim == 1024 * kernels::kNormMaxPerThread);
  const int threads = int(std::min<int64_t>(1024, (dim + 31) / 32 * 32));
  launch_pdl(kernels::rms_norm_block_kernel, unsigned(rows), threads, x, delta, x_out, w, y, dim, eps);
}

void qk_norm_rope_kv_write(const float* q_in, float* q_out, int64_t q_stride, const float* k_new,
                           const float* v_new, int64_t kv_stride, const float* q_norm,
                           const float* k_norm, float eps, const float* inv_freq, float attention_factor,
                           const int32_t* positions, int64_t m, int64_t n_head, int64_t n_head_kv,
                           int64_t head_dim, const KvPages& kv) {
  constexpr int kWarps = 4;
  const dim3 grid(unsigned(m), unsigned((n_head + n_head_kv + kWarps - 1) / kWarps));
  kernels::with_kv_element(kv.dtype, [&](auto element) {
    using T = decltype(element);
    launch_pdl(kernels::qk_norm_rope_kv_write_kernel<T>, grid, 32 * kWarps, q_in, q_out, q_stride, k_new, v_new,
               kv_stride, q_norm, k_norm, eps, inv_freq, attention_factor, positions, n_head, n_head_kv, head_dim,
               static_cast<T*>(kv.k), static_cast<T*>(kv.v), kv.block_table, kv.seq_rows, kv.table_stride, kv.block_size_log2);
  });
}

void attention(const float* q, const KvPages& kv, float* out, int64_t m, const int32_t* positions, int64_t n_head,
               int64_t n_head_kv, int64_t head_dim, float scale, const float* sinks, int64_t window) {
  static_assert(kAttentionMaxHeadDim == kernels::kAttentionMaxHeadDim);
  constexpr int kWarps = 4;
  kernels::with_kv_element(kv.dtype, [&](auto element) {
    using T = decltype(element);
    kernels::attention_online_warp_kernel<T><<<blocks_for(m * n_head, kWarps), 32 * kWarps>>>(
        q, static_cast<const T*>(kv.k), static_cast<const T*>(kv.v), kv.block_table, kv.seq_rows, kv.table_stride, kv.block_size_log2, out, m,
        positions, n_head, n_head_kv, head_dim, scale, kernels::AttentionMods{sinks, window});
  });
}

void silu_mul(const float* gate, const float* up, int64_t count, float* out) {
  kernels::silu_mul_kernel<<<blocks_for(count, 256), 256>>>(gate, up, count, out);
}

void clamped_swiglu_interleaved(const float* gate_up, int64_t rows, int64_t inter, float alpha, float limit,
                                float* out) {
  kernels::clamped_swiglu_interleaved_kernel<<<blocks_for(rows * inter, 256), 256>>>(gate_up, rows, inter, alpha,
                                                                                       limit, out);
}

static_assert(sizeof(Mxfp4Device) == sizeof(kernels::Mxfp4Device) &&
              offsetof(Mxfp4Device, bias) == offsetof(kernels::Mxfp4Device, bias));

// The MXFP4 decode GEMV's double-buffered variant (2 groups a batch, kernels/gemv_mxfp4.cuh) for
// an lm_head (at least kMxfp4StrideTiles tiles): alone, gpt-oss's 201088 x 2880 head took 160 µs
// against 183 single-buffered (H100, tools/kernel-bench/gemv_mxfp4_bench.cu); the projections were
// as fast or faster single-buffered, and so was gpt-oss-20b all-MXFP4 end to end (562 against 548
// tok/s). NIBBLE_MXFP4_DOUBLE=1 takes it everywhere, for A/B runs. NIBBLE_MXFP4_GATE_UP_TILES=1:
// MoE gate/up with one tile a block and 8 warps along K instead of 4 tiles and 2.
template <typename Fn>
void dispatch_mxfp4_double(bool lm_head, Fn&& fn) {
  static const bool double_buffer = std::getenv("NIBBLE_MXFP4_DOUBLE") != nullptr;
  if (double_buffer || lm_head)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

// NIBBLE_MXFP4_CLAIM=0: the streamed MXFP4 kernels' blocks take a static share of the tiles even
// where the caller gave claim counters (GemvIo::claim, MoeRouting::claim), for A/B runs.
static bool mxfp4_claims_off() {
  static const bool off = [] {
    const char* env = std::getenv("NIBBLE_MXFP4_CLAIM");
    return env && std::atoi(env) == 0;
  }();
  return off;
}

// The streamed MoE kernels' early reads (kernels::Mxfp4EarlyReads); NIBBLE_MXFP4_EARLY_READS=mask
// for A/B runs (0: the biases and down's output rows read in each item's epilogue).
static unsigned mxfp4_early_reads() {
  static const unsigned mask = [] {
    const char* env = std::getenv("NIBBLE_MXFP4_EARLY_READS");
    return env ? unsigned(std::atoi(env)) : unsigned(kernels::kMxfp4EarlyAll);
  }();
  return mask;
}

// The streamed MoE kernels (kernels/moe_mxfp4_stream.cuh): 8 consumer warps and a producer a block,
// kMxfp4StreamStages stages (NIBBLE_MXFP4_STREAM_STAGES), fewer where K is larger, none (the
// register kernels) below 2. Alone on gpt-oss's shapes (H100, tools/kernel-bench/moe_mxfp4_bench.cu):
// 2 stages and 2-3 blocks an SM beat 3, 4, 6 or 8 stages with fewer blocks (gate/up 21.0 µs at 2
// stages against 25.0 at 6-8; down 13.7 against 18.6-19.5): the consumers' E2M1 decode is the limit,
// not the bytes in flight, so what counts is warps an SM.
constexpr int kMxfp4StreamWarps = 8;
constexpr int kMxfp4StreamStages = 2;
constexpr int kMxfp4StreamGateUpBlocks = 3;  // registers for 3 blocks an SM
// Down: registers for 2 blocks an SM. An SM's registers are four quarters, one a scheduler, and
// a warp's must fit in one: at 104 registers a thread (3328 a warp) a quarter holds 4 warps, so
// 16 an SM, one 9-warp block; at 96, 5 a quarter, two blocks. The routing from a folded router's
// sums (kMxfp4FoldSums) took down to 104 and its time alone from 18.5 to 27 µs (Nsight Compute,
// H100); bounded for 2 blocks it takes 89. That was the "routing inside the expert kernels costs
// 4-7%" of earlier measurements (BENCHMARKS.md).
constexpr int kMxfp4StreamDownBlocks = 2;

// The most stages, up to `wanted`, that fit one block of the streamed kernels (W consumer warps,
// K = k, `extra` bytes of staged input) in the shared memory a block may opt in to.
static int mxfp4_stream_fit(int64_t k, int warps, int64_t extra, int wanted) {
  const int64_t optin = smem_optin_bytes();
  const int64_t per_stage = kernels::mxfp4_stream_smem(k, 1, warps, 0) - kernels::mxfp4_stream_smem(k, 0, warps, 0);
  const int64_t fit = (optin - 2048 - kernels::mxfp4_stream_smem(k, 0, warps, extra)) / per_stage;
  return int(std::min<int64_t>(wanted, fit));
}

static int mxfp4_stream_stages(int64_t k, int64_t extra) {
  static const int wanted = [] {
    const char* env = std::getenv("NIBBLE_MXFP4_STREAM_STAGES");
    return env ? std::max(2, std::atoi(env)) : kMxfp4StreamStages;
  }();
  return mxfp4_stream_fit(k, kMxfp4StreamWarps, extra, wanted);
}

// sm_90+ (bulk copies; clusters come with them), whole tiles, room for 2 stages.
// NIBBLE_MXFP4_MOE_REGS=1: the register kernels, for A/B runs.
bool moe_mxfp4_streamed(bool aligned, int64_t m, int64_t inter, int64_t hidden) {
  static const bool off = std::getenv("NIBBLE_MXFP4_MOE_REGS") != nullptr;
  return !off && aligned && clusters_supported() && hidden % 16 == 0 && inter % 8 == 0 &&
         mxfp4_stream_stages(hidden, kernels::mxfp4_x_bytes(m, hidden)) >= 2 && mxfp4_stream_stages(inter, 0) >= 2;
}

// The streamed kernels' routing code at the size the model needs (Mxfp4StreamRouting): 0 when the
// ids come from a routing launch, else the experts a lane of route_token.
template <typename Fn>
static void dispatch_route_per_lane(const MoeRouting& routing, int64_t n_experts, Fn&& fn) {
  if (!routing.logits && !routing.acc.sums)
    fn(std::integral_constant<int, 0>{});
  else if (n_experts <= 32)
    fn(std::integral_constant<int, 1>{});
  else if (n_experts <= 128)
    fn(std::integral_constant<int, 4>{});
  else
    fn(std::integral_constant<int, kernels::kMoeMaxExpertsPerLane>{});
}

static void moe_decode_mxfp4_streamed(const kernels::Mxfp4Device* gu, const kernels::Mxfp4Device* dn,
                                      int64_t n_experts, const MoeRouting& routing, const float* x, __half* act,
                                      float* out, bool accumulate, int64_t m, int64_t top_k, int64_t inter,
                                      int64_t hidden, float alpha, float limit) {
  constexpr int W = kMxfp4StreamWarps, threads = 32 * (W + 1);
  const int64_t sms = int64_t(sm_count());
  // Routed from a folded router's sums (gemv_mxfp4_router_fold without its routing launch).
  const bool sums = routing.acc.sums != nullptr;
  const kernels::RouterAcc racc = to_kernel(routing.acc, hidden, routing.eps);
  dispatch_route_per_lane(routing, n_experts, [&](auto kPerLane) {
    auto gate_up = [&](auto kFold) {
      const int64_t extra = kernels::mxfp4_x_bytes(m, hidden);
      const int stages = mxfp4_stream_stages(hidden, extra);
      const size_t smem = size_t(kernels::mxfp4_stream_smem(hidden, stages, W, extra));
      auto launch = [&](auto kClaim) {
        const auto kernel = kernels::moe_mxfp4_gate_up_stream_kernel<W, kMxfp4StreamGateUpBlocks, kPerLane.value,
                                                                     kFold.value, kClaim.value>;
        allow_smem(kernel, smem);
        const int64_t items = m * top_k * (2 * inter / 16), resident = resident_blocks(kernel, threads, smem) * sms;
        launch_pdl_smem(kernel, unsigned(std::min(items, resident)), threads, smem, gu, routing.ids, routing.logits,
                        n_experts, x, static_cast<const __half*>(routing.xn), routing.x_scale, act, m * top_k, top_k,
                        inter, hidden, alpha, limit, stages, racc, routing.router_bias, routing.claim,
                        mxfp4_early_reads());
      };
      if (routing.claim && !mxfp4_claims_off())
        launch(std::true_type{});
      else
        launch(std::false_type{});
    };
    if constexpr (kPerLane.value == 0) {
      if (routing.x_scale)  // routed by the launch after a folded o GEMV (gemv_mxfp4_router_fold)
        gate_up(std::integral_constant<int, kernels::kMxfp4FoldLaunch>{});
      else
        gate_up(std::integral_constant<int, kernels::kMxfp4NoFold>{});
    } else {
      if (sums)
        gate_up(std::integral_constant<int, kernels::kMxfp4FoldSums>{});
      else
        gate_up(std::integral_constant<int, kernels::kMxfp4NoFold>{});
    }
    auto down = [&](auto kFoldedSums) {
      const int stages = mxfp4_stream_stages(inter, 0);
      const size_t smem = size_t(kernels::mxfp4_stream_smem(inter, stages, W, 0));
      const auto kernel = kernels::moe_mxfp4_down_stream_kernel<W, kMxfp4StreamDownBlocks, kPerLane.value, kFoldedSums.value>;
      allow_smem(kernel, smem);
      const int64_t items = m * (hidden / 16), resident = resident_blocks(kernel, threads, smem) * sms;
      launch_pdl_smem(kernel, unsigned(std::min(items, resident)), threads, smem, dn, routing.ids, routing.weights,
                      routing.logits, n_experts, routing.normalize, static_cast<const __half*>(act), out, m, top_k,
                      inter, hidden, accumulate, stages, racc, routing.router_bias, mxfp4_early_reads());
    };
    if constexpr (kPerLane.value > 0)
      if (sums) return down(std::true_type{});
    down(std::false_type{});
  });
}

// The MoE kernels load 2 groups of 128 k a batch and issue the next batch's loads before the
// products of the current one (kernels/gemv_mxfp4.cuh): the registers of the single-buffered
// 4-group batch, with loads in flight while the E2M1 decode runs. Alone on gpt-oss's shapes (H100,
// tools/kernel-bench/moe_mxfp4_bench.cu): gate/up 26.4 -> 24.5 µs, down 17.9 -> 16.6 µs (with 4
// groups double-buffered they spilled: 46 and 25 µs). NIBBLE_MXFP4_MOE_SINGLE=1: the 4-group
// single-buffered kernels, for A/B runs. The streamed kernels take every shape they can.
void moe_decode_mxfp4(const Mxfp4Device* gate_up, const Mxfp4Device* down, int64_t n_experts,
                      const MoeRouting& routing, const float* x, void* act, float* out, bool accumulate, int64_t m,
                      int64_t top_k, int64_t inter, int64_t hidden, float alpha, float limit, bool aligned) {
  const auto* gu = reinterpret_cast<const kernels::Mxfp4Device*>(gate_up);
  const auto* dn = reinterpret_cast<const kernels::Mxfp4Device*>(down);
  auto* act_h = static_cast<__half*>(act);
  if (moe_mxfp4_streamed(aligned, m, inter, hidden))
    return moe_decode_mxfp4_streamed(gu, dn, n_experts, routing, x, act_h, out, accumulate, m, top_k, inter, hidden,
                                     alpha, limit);
  const int32_t* ids = routing.ids;
  const float* weights = routing.weights;
  static const bool one_tile = std::getenv("NIBBLE_MXFP4_GATE_UP_TILES") != nullptr;
  static const bool single = std::getenv("NIBBLE_MXFP4_MOE_SINGLE") != nullptr;
  auto run = [&](auto kDouble, auto B) {
    auto gate_up = [&](auto KS, auto NTB) {
      const auto kernel = kernels::moe_mxfp4_gate_up_kernel<KS.value, NTB.value, kDouble.value, B.value>;
      const size_t smem = size_t(kernels::moe_mxfp4_gate_up_smem(hidden, n_experts));
      allow_smem(kernel, smem);
      launch_pdl_smem(kernel, dim3(unsigned(blocks_for(2 * inter / 16, NTB.value)), unsigned(m * top_k)),
                      32 * KS.value * NTB.value, smem, gu, n_experts, ids, x, act_h, top_k, inter, hidden, alpha,
                      limit);
    };
    if (one_tile)
      gate_up(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{});
    else
      gate_up(std::integral_constant<int, 2>{}, std::integral_constant<int, 4>{});
    const auto down = kernels::moe_mxfp4_down_kernel<kDouble.value, B.value>;
    const size_t smem = size_t(kernels::mxfp4_x_bytes(top_k, inter));
    allow_smem(down, smem);
    launch_pdl_smem(down, dim3(unsigned(hidden / 16), unsigned(m)), 32 * kernels::kMoeMxfp4DownWarps, smem, dn, ids,
                    weights, act_h, out, top_k, inter, hidden, accumulate);
  };
  if (single)
    run(std::false_type{}, std::integral_constant<int, kernels::kMxfp4Batch>{});
  else
    run(std::true_type{}, std::integral_constant<int, 2>{});
}

int64_t mxfp4_scale_stride(int64_t k) { return kernels::mxfp4_scale_stride(k); }

void mxfp4_relayout(const uint8_t* codes, const uint8_t* scales, uint8_t* out_codes, uint8_t* out_scales, int64_t n,
                    int64_t k) {
  kernels::mxfp4_relayout_kernel<<<blocks_for(n * k / 8, 256), 256>>>(codes, scales, out_codes, out_scales, n, k);
}

void mxfp4_dequant_bf16(const uint8_t* codes, const uint8_t* scales, void* out, int64_t n, int64_t k) {
  kernels::mxfp4_dequant_bf16_kernel<<<blocks_for(n * k / 8, 256), 256>>>(codes, scales,
                                                                         static_cast<__nv_bfloat16*>(out), n, k);
}

// An MXFP4 lm_head at batch 1 streamed through shared memory (kernels/mxfp4_stream.cuh):
// kMxfp4HeadWarps consumer warps and a producer a block, kMxfp4HeadStages stages, one wave of
// blocks (2 an SM) striding over the tiles. Whole 16-row tiles, 16-byte code rows and sm_90+
// (bulk copies; clusters come with them); the register GEMV takes the rest. Alone on gpt-oss's
// 201088 x 2880 head (H100, tools/kernel-bench/gemv_mxfp4_bench.cu): 118.7 µs (2.6 TB/s) against
// 146.2 for the register GEMV's best shape; 3-4 stages, 3-4 blocks an SM, 4, 12 or 16 consumer
// warps were 0-16% slower. The bulk copies alone stream it in 101-103 µs: the consumers' E2M1
// decode (ALU pipe ~50% busy) is what remains. NIBBLE_MXFP4_HEAD_REGS=1: the register GEMV
// everywhere, NIBBLE_MXFP4_HEAD_STAGES=n: the stage count, for A/B runs.
constexpr int kMxfp4HeadWarps = 8;
constexpr int kMxfp4HeadStages = 2;

// The stages the streamed head takes for this product, 0 where the register GEMV takes it.
static int gemv_mxfp4_stream_stages(const uint8_t* codes, const uint8_t* scales, int64_t m, int64_t n, int64_t k,
                                    const GemvIo& io) {
  static const bool off = std::getenv("NIBBLE_MXFP4_HEAD_REGS") != nullptr;
  static const int wanted = [] {
    const char* env = std::getenv("NIBBLE_MXFP4_HEAD_STAGES");
    return env ? std::clamp(std::atoi(env), 1, 16) : kMxfp4HeadStages;
  }();
  const bool aligned = reinterpret_cast<uintptr_t>(codes) % 16 == 0 && reinterpret_cast<uintptr_t>(scales) % 16 == 0;
  if (off || m != 1 || io.normed_out || io.staged_out || n / 16 < kMxfp4StrideTiles || n % 16 != 0 ||
      (k / 2) % 16 != 0 || !aligned || !clusters_supported())
    return 0;
  return std::max(0, mxfp4_stream_fit(k, kMxfp4HeadWarps, kernels::mxfp4_x_bytes(1, k), wanted));
}

// pick: a greedy decode step's pick as well (gemv_mxfp4_pick), its partials in pick->scratch.
static void gemv_mxfp4_stream(const kernels::Mxfp4Weight& w, const float* bias, const float* x, float* y, int64_t n,
                              int64_t k, const GemvIo& io, int stages, const GreedyPickArgs* pick = nullptr) {
  constexpr int W = kMxfp4HeadWarps, threads = 32 * (W + 1);
  const size_t smem = size_t(kernels::mxfp4_stream_smem(k, stages, W, kernels::mxfp4_x_bytes(1, k)));
  if (io.clear)  // the streamed kernel has no clear of its own
    cudaMemsetAsync(io.clear, 0, size_t(io.clear_count) * 8, cudaStreamPerThread);  // errors: the caller checks
  auto run = [&](auto kernel, kernels::GreedyPick p) {
    allow_smem(kernel, smem);
    const int64_t resident = int64_t(resident_blocks(kernel, threads, smem)) * int64_t(sm_count());
    launch_pdl_smem(kernel, unsigned(std::min<int64_t>(n / 16, resident)), threads, smem, w, bias, x, y, n, k,
                    to_kernel(io), stages, p, io.claim);
  };
  const bool claim = io.claim && !mxfp4_claims_off();
  dispatch_norm(io, [&](auto kNorm) {
    if (!pick) {
      if (claim) return run(kernels::gemv_mxfp4_stream_kernel<W, kNorm.value, 1, false, true>, kernels::GreedyPick{});
      return run(kernels::gemv_mxfp4_stream_kernel<W, kNorm.value>, kernels::GreedyPick{});
    }
    // Two blocks an SM, as the head without the pick (96 registers): the pick's code must not take
    // it past a register quarter's 5 warps (kernels/moe_mxfp4_stream.cuh).
    auto* part_val = static_cast<float*>(pick->scratch);  // [kGreedyPickMaxBlocks], then the indices
    const kernels::GreedyPick p{part_val, reinterpret_cast<int32_t*>(part_val + kGreedyPickMaxBlocks), pick->counter,
                                pick->out, pick->next_ids, pick->positions,
                                kernels::DecodePost{pick->post.seq, pick->post.ring}};
    if (claim) return run(kernels::gemv_mxfp4_stream_kernel<W, kNorm.value, 2, true, true>, p);
    run(kernels::gemv_mxfp4_stream_kernel<W, kNorm.value, 2, true>, p);
  });
}

void gemv_mxfp4(const uint8_t* codes, const uint8_t* scales, const float* bias, const float* x, float* y, int64_t m,
                int64_t n, int64_t k, const GemvIo& io) {
  const kernels::Mxfp4Weight w{codes, scales};
  if (const int stages = gemv_mxfp4_stream_stages(codes, scales, m, n, k, io); stages > 0)
    return gemv_mxfp4_stream(w, bias, x, y, n, k, io, stages);
  const size_t smem = size_t(kernels::mxfp4_x_bytes(m, k));
  dispatch_norm(io, [&](auto kNorm) {
    dispatch_mxfp4_split(k, n, [&](auto KS, auto NTB, auto B) {
      dispatch_mxfp4_double((n + 15) / 16 >= kMxfp4StrideTiles, [&](auto kDouble) {
        // The double-buffered form (lm_heads) keeps its 2-group batches.
        constexpr int kBatch = kDouble.value ? 2 : B.value;
        const auto kernel = kernels::gemv_mxfp4_mma_kernel<kNorm.value, KS.value, NTB.value, kDouble.value, kBatch>;
        const int threads = 32 * KS.value * NTB.value;
        allow_smem(kernel, smem);
        // At most one wave: the blocks stride over the rest of the tiles (an lm_head).
        const int64_t resident = int64_t(resident_blocks(kernel, threads, smem)) * int64_t(sm_count());
        launch_pdl_smem(kernel, unsigned(std::min<int64_t>(blocks_for((n + 15) / 16, NTB.value), resident)), threads,
                        smem, w, bias, x, y, int(m), n, k, to_kernel(io), kernels::RouterFold{});
      });
    });
  });
}

int64_t gemv_mxfp4_pick_scratch_bytes() { return 8 * kGreedyPickMaxBlocks; }

static std::atomic<int>& head_pick_switch() {
  static std::atomic<int> mode{env_switch("NIBBLE_HEAD_PICK")};
  return mode;
}
void set_head_pick(int mode) { head_pick_switch().store(mode, std::memory_order_relaxed); }
int head_pick_mode() { return head_pick_switch().load(std::memory_order_relaxed); }
static std::atomic<int64_t> g_head_picks{0};
int64_t head_picks() { return g_head_picks.load(std::memory_order_relaxed); }

bool gemv_mxfp4_pick(const uint8_t* codes, const uint8_t* scales, const float* bias, const float* x, float* y,
                     int64_t n, int64_t k, const GemvIo& io, const GreedyPickArgs& pick) {
  const int stages = gemv_mxfp4_stream_stages(codes, scales, 1, n, k, io);
  if (stages <= 0 || io.accumulate || int64_t(sm_count()) * 4 > kGreedyPickMaxBlocks) return false;
  gemv_mxfp4_stream(kernels::Mxfp4Weight{codes, scales}, bias, x, y, n, k, io, stages, &pick);
  g_head_picks.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool gemv_mxfp4_router_fold(const uint8_t* codes, const uint8_t* scales, const float* bias, const float* x, float* y,
                            int64_t n, int64_t k, const void* router, bool bf16, const float* norm, float eps,
                            int64_t n_experts, const FoldedRouting& routing, void* xg) {
  if (gemv_mxfp4_stream_stages(codes, scales, 1, n, k, {nullptr, 0.f, true}) > 0 || n % 16 != 0 ||
      routing.top_k > 32)
    return false;
  const size_t smem = size_t(kernels::mxfp4_x_bytes(1, k));
  bool launched = false;
  dispatch_mxfp4_split(k, n, [&](auto KS, auto NTB, auto B) {
    // The shapes gemv_mxfp4 gives one token with one tile a block and one wave (o projections).
    if constexpr (NTB.value == 1) {
      const auto kernel = routing.ids
                              ? kernels::gemv_mxfp4_mma_kernel<false, KS.value, 1, false, B.value, 1>
                              : kernels::gemv_mxfp4_mma_kernel<false, KS.value, 1, false, B.value,
                                                               kernels::kMxfp4FoldSelfRouted>;
      const int threads = 32 * KS.value;
      const int64_t tiles = n / 16;
      if (n_experts > kernels::kFoldExpertsPerThread * threads ||
          n_experts > int64_t(kernels::kMoeMaxExpertsPerLane) * 32 || tiles >= kMxfp4StrideTiles)
        return;
      allow_smem(kernel, smem);
      if (tiles > int64_t(resident_blocks(kernel, threads, smem)) * int64_t(sm_count())) return;
      const kernels::RouterFold fold{
          static_cast<const uint16_t*>(router),
          norm,
          static_cast<__half*>(xg),
          kernels::RouterAcc{routing.sums, 1, n_experts + 1, n, eps},
          n_experts,
          bf16,
          kernels::RouterFoldRoute{routing.bias, routing.ids, routing.weights, routing.scale,
                                   int(routing.top_k), routing.normalize}};
      launch_pdl_smem(kernel, unsigned(tiles), threads, smem, kernels::Mxfp4Weight{codes, scales}, bias, x, y, 1, n,
                      k, kernels::GemvIo{nullptr, 0.f, true}, fold);
      if (routing.ids) launch_pdl(kernels::moe_route_folded_kernel, 1u, 128, fold);
      launched = true;
      g_router_fold_launches.fetch_add(1, std::memory_order_relaxed);
    }
  });
  return launched;
}

int64_t argmax_scratch_bytes(int64_t rows) { return rows * kernels::kArgmaxSplits * 8; }

static_assert(kDecodePostRing == kernels::kDecodePostRing);

bool argmax(const float* x, int64_t rows, int64_t n, int32_t* out, void* scratch, unsigned* counters,
            int32_t* next_ids, int32_t* positions, DecodePostArgs post) {
  auto* part_val = static_cast<float*>(scratch);
  auto* part_idx = reinterpret_cast<int32_t*>(part_val + rows * kernels::kArgmaxSplits);
  // NIBBLE_ARGMAX_TWO_LAUNCHES=1: the slices' launch, then a merging one (and advance_decode's),
  // for A/B runs.
  static const bool two = std::getenv("NIBBLE_ARGMAX_TWO_LAUNCHES") != nullptr;
  if (!two && counters && rows <= kArgmaxMaxRows) {
    launch_pdl(kernels::argmax_last_block_kernel, dim3(unsigned(rows), kernels::kArgmaxSplits), 256, x, n, part_val,
               part_idx, counters, out, next_ids, positions, kernels::DecodePost{post.seq, post.ring});
    return next_ids != nullptr;
  }
  launch_pdl(kernels::argmax_partial_kernel, dim3(unsigned(rows), kernels::kArgmaxSplits), 256, x, n, part_val,
             part_idx);
  launch_pdl(kernels::argmax_final_kernel, unsigned(rows), 32, part_val, part_idx, out);
  return false;
}

void advance_decode(const int32_t* picked, int64_t n, int32_t* ids, int32_t* positions, DecodePostArgs post) {
  launch_pdl(kernels::advance_decode_kernel, blocks_for(n, 128), 128, picked, n, ids, positions,
             kernels::DecodePost{post.seq, post.ring});
}

void add(const float* x, int64_t count, float* y) {
  kernels::add_kernel<<<blocks_for(count, 256), 256>>>(x, count, y);
}

void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k, bool normalize,
               int32_t* ids, float* weights) {
  static_assert(kMoeMaxTopK == kernels::kMoeMaxTopK);
  launch_pdl(kernels::moe_route_kernel, blocks_for(m, 4), 128, logits, m, n_experts, top_k, normalize, ids,
             weights);
}

void gather_rows(const float* src, const int32_t* rows, int64_t n_rows, int64_t dim, float* dst) {
  kernels::gather_rows_kernel<<<blocks_for(n_rows * dim, 256), 256>>>(src, rows, n_rows, dim, dst);
}

void scatter_add_weighted(const float* src, const int32_t* rows, const float* row_weights,
                          int64_t n_rows, int64_t dim, float* dst) {
  kernels::scatter_add_weighted_kernel<<<blocks_for(n_rows * dim, 256), 256>>>(src, rows, row_weights,
                                                                               n_rows, dim, dst);
}

bool pdl_trigger_set(uint32_t bits) {
  return cudaMemcpyToSymbol(kernels::g_pdl_trigger, &bits, sizeof(bits)) == cudaSuccess;
}

bool route_wide_set(bool wide) {
  const int v = wide ? 1 : 0;
  return cudaMemcpyToSymbol(kernels::g_route_wide, &v, sizeof(v)) == cudaSuccess;
}

#ifdef NIBBLE_TIMELINE
namespace {
kernels::TimelineRecord* g_host_timeline = nullptr;
int64_t g_host_timeline_capacity = 0;
}  // namespace

bool timeline_start(int64_t capacity, std::string* why_not) {
  if (capacity <= 0 || (capacity & (capacity - 1)) != 0) {
    *why_not = "the timeline capacity must be a power of two";
    return false;
  }
  if (g_host_timeline == nullptr &&
      cudaMalloc(&g_host_timeline, size_t(capacity) * sizeof(kernels::TimelineRecord)) != cudaSuccess) {
    *why_not = "no device memory for the timeline";
    return false;
  }
  g_host_timeline_capacity = capacity;
  const unsigned long long zero = 0, mask = (unsigned long long)(capacity - 1);
  cudaMemset(g_host_timeline, 0, size_t(capacity) * sizeof(kernels::TimelineRecord));
  cudaMemcpyToSymbol(kernels::g_timeline_records, &g_host_timeline, sizeof(g_host_timeline));
  cudaMemcpyToSymbol(kernels::g_timeline_next, &zero, sizeof(zero));
  cudaMemcpyToSymbol(kernels::g_timeline_mask, &mask, sizeof(mask));
  const char* at = std::getenv("NIBBLE_TIMELINE_MARK_AT");
  const int mark_at = at ? std::atoi(at) : 0;
  cudaMemcpyToSymbol(kernels::g_timeline_mark_at, &mark_at, sizeof(mark_at));
  if (cudaDeviceSynchronize() != cudaSuccess) {
    *why_not = "the timeline could not be set up on the device";
    return false;
  }
  return true;
}

bool timeline_dump(const std::string& path, std::string* why_not) {
  if (g_host_timeline == nullptr) {
    *why_not = "the timeline was not started";
    return false;
  }
  cudaDeviceSynchronize();
  unsigned long long next = 0;
  std::vector<kernels::TimelineRecord> ring(static_cast<size_t>(g_host_timeline_capacity));
  if (cudaMemcpyFromSymbol(&next, kernels::g_timeline_next, sizeof(next)) != cudaSuccess ||
      cudaMemcpy(ring.data(), g_host_timeline, ring.size() * sizeof(ring[0]), cudaMemcpyDeviceToHost) != cudaSuccess) {
    *why_not = "the timeline could not be copied back";
    return false;
  }
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    *why_not = "cannot write " + path;
    return false;
  }
  const uint64_t cap = uint64_t(g_host_timeline_capacity);
  const uint64_t count = next < cap ? next : cap;
  std::fprintf(f, "nibble-timeline 1 record_bytes=%zu count=%llu names=%s\n", sizeof(kernels::TimelineRecord),
               (unsigned long long)count, kernels::kTimelineKernelNames);
  for (uint64_t i = next - count; i < next; ++i) std::fwrite(&ring[i & (cap - 1)], sizeof(ring[0]), 1, f);
  const bool ok = std::fclose(f) == 0;
  if (!ok) *why_not = "cannot write " + path;
  return ok;
}
#else
bool timeline_start(int64_t, std::string* why_not) {
  *why_not = "this build has no in-kernel timeline (configure with -DNIBBLE_TIMELINE=ON)";
  return false;
}
bool timeline_dump(const std::string&, std::string* why_not) {
  *why_not = "this build has no in-kernel timeline (configure with -DNIBBLE_TIMELINE=ON)";
  return false;
}
#endif

}  // namespace nibble::cuda
