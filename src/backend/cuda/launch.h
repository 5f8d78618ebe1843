// Launchers of the CUDA kernels, callable from plain C++ (the .cu files that define them are the
// only code nvcc compiles). All run on the default stream; the caller checks cudaGetLastError().
// Pointers are device memory; shapes as in backend/backend.h.
#pragma once

#include <cstdint>
#include <string>

#include "backend/kv_pages.h"
#include "kernels/attention_prologue.h"
#include "backend/sampling.h"

namespace nibble::cuda {

enum class Dense { kF32, kF16, kBF16 };

// An INT4 matrix in the warp-interleaved layout (kernels/gemv.cuh); scales are f16.
struct Int4Device {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint8_t* zeros;  // null: symmetric
  int64_t group_shift;   // log2(group size); 30 when one group spans K
  int64_t n_groups;
};
// One MXFP4 matrix on the device in the decode layout (kernels/gemv_mxfp4.cuh: codes [n][k/2],
// E8M0 scales [n][mxfp4_scale_stride(k)]), f32 bias [n] or null.
struct Mxfp4Device {
  const uint8_t* codes;
  const uint8_t* scales;
  const float* bias;
};
constexpr int64_t kGemvMaxM = 8;
// Elements per 16-byte vector of a dense type: gemv_dense needs k % this == 0.
constexpr int64_t dense_per_vec(Dense t) { return t == Dense::kF32 ? 4 : 8; }
constexpr int64_t kAttentionMaxHeadDim = 256;
constexpr int64_t kMoeMaxTopK = 32;
constexpr int64_t kMoeMaxExperts = 512;

// kind: 0 = f32, 1 = bf16, 2 = u8, 3 = f16 (see Backend::fill_random).
void fill_random(void* dst, int kind, int64_t count, float lo, float hi, uint64_t seed);
void linear_dense(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m,
                  int64_t n, int64_t k);
void linear_int4(const uint8_t* codes, const uint16_t* scales, const uint8_t* zeros, const float* bias,
                 const float* x, float* y, int64_t m, int64_t n, int64_t k, int64_t group_size,
                 int64_t n_groups);
// The streamed INT4 GEMV for one token (kernels/int4_stream.cuh) in place of the register GEMV:
// off by default, NIBBLE_INT4_STREAM=1 at start, or this (OpsTest runs both paths).
void set_int4_stream(bool on);
// The strided INT4 GEMV of a long matrix at one token (ops.cu, int4_gemv_strided): -1 where it
// pays (from 32 tiles an SM; NIBBLE_INT4_STRIDED=0 never), 0 never, 1 on any matrix of its shape
// (tests).
void set_int4_strided(int mode);
// Row-major INT4 codes [n][k/2] -> the warp-interleaved layout (k % 256 == 0), device to device.
void int4_interleave(const uint8_t* src, uint8_t* dst, int64_t n, int64_t k);
// What a decode GEMV does around the product: with `norm`, the input rows are RMS-normalised
// (times norm) first (k % 4 == 0); with `accumulate`, y += result instead of y = result.
struct GemvIo {
  const float* norm = nullptr;
  float eps = 0.f;
  bool accumulate = false;
  // With `norm`, gemv_dense also writes the normalised rows here ([m, k] f32): gpt-oss's router,
  // whose MoE kernels read them (a separate norm launch where the split-K kernel does not run).
  float* normed_out = nullptr;
  // With `norm`, gemv_int4 also writes the normalised rows as its blocks stage them (f16 in the
  // decode mma order, [m, k]): a 4-bit MoE router, whose gate/up kernel copies them (MoeRouting::xn).
  void* staged_out = nullptr;
  // gemv_int4 and gemv_mxfp4 zero clear[0..clear_count) once the kernel they wait for is done (a folded router's
  // sums, RouterAcc, for the next step).
  unsigned long long* clear = nullptr;
  int clear_count = 0;
  // Two counters, 0 between launches: the streamed MXFP4 GEMV's blocks claim their tiles past the
  // first from them (null: a static share each; NIBBLE_MXFP4_CLAIM=0 forces it, for A/B runs).
  unsigned* claim = nullptr;
};
// Decode GEMV (m <= kGemvMaxM activation rows).
void gemv_int4(const Int4Device& w, const float* bias, const float* x, float* y, int64_t m, int64_t n,
               int64_t k, const GemvIo& io = {});
// The MoE router's sums folded into an o projection (kernels/moe_route.cuh RouterAcc): 64-bit
// fixed-point logit sums and Σh², `replicas` copies `stride` (>= n_experts + 1) apart, zero
// before the o GEMV that adds into them; cleared after the MoE block (GemvIo::clear).
struct RouterAcc {
  unsigned long long* sums = nullptr;
  int replicas = 1;  // a power of two (kernels/moe_route.cuh RouterAcc)
  int64_t stride = 0;
};
// y[1, n] += x · Wᵀ (+ b) for one token with the router [n_experts, n] (16-bit: bf16 when
// `bf16`, else f16) folded in: its blocks add Σ_j router[e, j] norm[j] y[j] and Σ y[j]² over
// their rows into acc, and write y · norm / 16 to xg (f16 [n], decode mma order) for gate/up.
// False, having launched nothing, where the shapes do not fit it (n_experts beyond two a thread,
// rows not a multiple of 16, the streamed GEMV).
bool gemv_int4_router_fold(const Int4Device& w, const float* bias, const float* x, float* y, int64_t n, int64_t k,
                           const void* router, bool bf16, const float* norm, int64_t n_experts, const RouterAcc& acc,
                           void* xg);
// How many folded o GEMVs gemv_int4_router_fold and gemv_mxfp4_router_fold have launched (the op
// tests check the fold ran).
int64_t router_fold_launches();
void gemv_dense(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m,
                int64_t n, int64_t k, const GemvIo& io = {});
// The tensor-core form for BF16 weights (gemv_dense.cu): false, having launched nothing, where it
// does not apply (k % 8, the staged rows' size, NIBBLE_NO_DENSE_MMA_GEMV=1); gemv_dense tries it first.
bool gemv_bf16_mma(const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n, int64_t k,
                   const GemvIo& io = {});
// The router stages its m input rows in shared memory (m * hidden floats): the decode MoE path
// is taken up to this size.
constexpr int64_t kMoeRouterMaxStagedBytes = 160 * 1024;
// Router GEMV (x normalised with `norm` when non-null) and top-k routing of m <= kGemvMaxM tokens
// in one launch; logits [m, n_experts] is scratch, counter a device word that is 0 between launches.
void moe_router(Dense type, const void* w, const float* x, int64_t m, int64_t n_experts, int64_t hidden,
                const float* norm, float eps, float* logits, int64_t top_k, bool normalize, int32_t* ids,
                float* weights, unsigned* counter);
// The router's logits [m, n_experts] only (x normalised with `norm` when non-null), m <= kGemvMaxM,
// hidden % the weight's vector: the MoE decode kernels route from them (MoeRouting::logits).
// Where the shapes allow it, also the normalised rows as the INT4 expert kernels stage them (f16,
// m * hidden halves in xn; scratch of that size): returns whether it wrote them. The logits are
// written `replicas` times (<= 32), replica_stride floats apart (logits holds them all), so that
// the hundreds of expert blocks that read a token's logits at once spread over more L2 lines
// (MoeRouting::logit_replicas; +0.1-0.8% tg128, though the routing's ~2.5 µs after the wait did
// not shrink with it: BENCHMARKS.md).
bool moe_router_logits(Dense type, const void* w, const float* x, int64_t m, int64_t n_experts, int64_t hidden,
                       const float* norm, float eps, float* logits, void* xn, int replicas = 1,
                       int64_t replica_stride = 0);
// Where the MoE decode kernels find each token's experts: ids and weights [m, top_k] from a routing
// launch, or, with logits ([m, n_experts] from moe_router_logits), the kernels route for
// themselves (softmax top-k, the weights renormalised over the top k when normalize); xn: the
// staged rows moe_router_logits wrote, or null.
struct MoeRouting {
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  const float* logits = nullptr;
  bool normalize = false;
  const void* xn = nullptr;
  // With logits: copies of them, replica_stride floats apart; block b of an expert kernel reads
  // copy b % logit_replicas, which spreads the blocks' reads of the same logits over more lines.
  int logit_replicas = 1;
  int64_t replica_stride = 0;
  // Or the sums of a router folded into the o projection (gemv_int4_router_fold): one token.
  RouterAcc acc;
  // Or, one token through a router folded into an MXFP4 o GEMV (gemv_mxfp4_router_fold), its row
  // staged in xn by o (x · γ / 16), the streamed kernels only (moe_mxfp4_streamed): ids and weights
  // from the routing launch after o, the row's factor *x_scale; or, without that launch, acc set
  // (and the router's bias, or null): the two kernels route from the sums themselves.
  const float* x_scale = nullptr;
  const float* router_bias = nullptr;
  float eps = 0.f;  // the MoE norm's, with acc (the sums' 1 / rms)
  // Two counters, 0 between launches: the streamed MXFP4 gate/up's blocks claim their tiles past
  // the first from them (null: a static share each; NIBBLE_MXFP4_CLAIM=0 forces it, for A/B runs).
  unsigned* claim = nullptr;
};
// MoE decode for m <= kGemvMaxM tokens with device-side routing: the tables hold each expert's
// gate/up/down matrix (device arrays of Int4Device, n_experts long), all with the same
// group_shift; act is scratch of m * top_k * inter halves. x is normalised with `norm` when
// non-null; out += result when accumulate. top_k <= kMoeDecodeMaxTopK.
constexpr int64_t kMoeDecodeMaxTopK = 8;
void moe_decode_int4(const Int4Device* gate, const Int4Device* up, const Int4Device* down, int64_t n_experts,
                     int64_t group_shift, const MoeRouting& routing, const float* x, const float* norm, float eps,
                     void* act, float* out, bool accumulate, int64_t m, int64_t top_k, int64_t inter,
                     int64_t hidden);
// gpt-oss's MoE for m <= kGemvMaxM tokens with the routing on the device over MXFP4 experts
// (device arrays of n_experts Mxfp4Device; gate_up rows interleaved gate_j, up_j, biases, the
// clamped SwiGLU with alpha and limit): act is scratch of m·top_k·inter halves; out = (accumulate ?
// out : 0) + Σ weight · expert(x) (kernels/moe_mxfp4.cuh). top_k <= kMoeDecodeMaxTopK, hidden % 16
// == 0, inter % 32 == 0. aligned: every matrix's codes and scales are 16-byte aligned (the
// streamed kernels' bulk copies need it: kernels/moe_mxfp4_stream.cuh). The routing may be logits
// only where moe_mxfp4_streamed(...) holds (the streamed kernels route for themselves); the
// register kernels read ids and weights.
bool moe_mxfp4_streamed(bool aligned, int64_t m, int64_t inter, int64_t hidden);
void moe_decode_mxfp4(const Mxfp4Device* gate_up, const Mxfp4Device* down, int64_t n_experts,
                      const MoeRouting& routing, const float* x, void* act, float* out, bool accumulate, int64_t m,
                      int64_t top_k, int64_t inter, int64_t hidden, float alpha, float limit, bool aligned);
// MXFP4 (k % 32 == 0): the checkpoint's row-major codes [n][k/2] and scales [n][k/32] -> the
// decode layout (out_scales: n · mxfp4_scale_stride(k) bytes), device to device.
int64_t mxfp4_scale_stride(int64_t k);
void mxfp4_relayout(const uint8_t* codes, const uint8_t* scales, uint8_t* out_codes, uint8_t* out_scales, int64_t n,
                    int64_t k);
// Decode-layout MXFP4 -> BF16 [n][k] (exact), for prefill shapes on the dense tensor-core GEMM.
void mxfp4_dequant_bf16(const uint8_t* codes, const uint8_t* scales, void* out, int64_t n, int64_t k);
// Decode GEMV of a decode-layout MXFP4 matrix (m <= kGemvMaxM).
void gemv_mxfp4(const uint8_t* codes, const uint8_t* scales, const float* bias, const float* x, float* y, int64_t m,
                int64_t n, int64_t k, const GemvIo& io = {});
// What the routing launch after a folded MXFP4 o GEMV routes with and writes
// (kernels/router_fold.cuh): sums, n_experts + 1 fixed-point words, zero between uses (the
// routing zeroes them); ids and weights [top_k], scale (16 / rms: xg's factor, MoeRouting::x_scale).
// With ids null there is no routing launch: the expert kernels route from the sums
// (MoeRouting::acc), and the caller has them zeroed after the MoE block (GemvIo::clear).
struct FoldedRouting {
  unsigned long long* sums = nullptr;
  const float* bias = nullptr;  // the router's, or null
  int64_t top_k = 0;
  bool normalize = false;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  float* scale = nullptr;
};
// Whether the callers of gemv_mxfp4_router_fold take its routing launch (the expert kernels then
// read ids and weights) or let the expert kernels route from the sums: the launch where the
// experts are more than 128 (more than their one-trip routing holds). 20b's 32 route in the
// kernels 2.8% faster than the launch; 120b's 128 1.8% faster once the sums were read in one L2
// trip (its launch had been 1-2% ahead, BENCHMARKS.md). set_fold_route_launch(1) always, (0)
// never, (-1) by the experts (NIBBLE_FOLD_ROUTE_LAUNCH=1 / 0 at start; GptOssOpsTest runs both).
void set_fold_route_launch(int mode);
bool fold_route_launch(int64_t n_experts);
// How moe_decode_int4's kernels for one token routed from a folded router's sums (Qwen3's decode)
// sit on an SM at given shapes: registers a thread (cudaFuncGetAttributes) and gate/up's blocks an
// SM (the occupancy API). The decode step's overlap rests on them (one wave of gate/up, down
// resident beside one gate/up block on sm_90: kernels/gemv_mma.cuh), so
// DecodeResidency.Int4MoeOneToken pins them. Zeros where a kernel's attributes cannot be read.
struct Int4MoeDecodeResidency {
  int compute_capability = 0;  // the device's, major · 10 + minor
  int gate_up_threads = 0, gate_up_registers = 0, gate_up_blocks_per_sm = 0;
  int down_threads = 0, down_registers = 0;
};
Int4MoeDecodeResidency int4_moe_decode_residency(int64_t hidden, int64_t group_size, int64_t n_experts);
// y[1, n] += x · Wᵀ (+ b) for one token (a decode-layout MXFP4 o projection) with the 16-bit router
// [n_experts, n] folded in, as gemv_int4_router_fold, then the routing launch (FoldedRouting)
// unless routing.ids is null: gpt-oss's MXFP4 experts then read ids, weights and xg (y · norm / 16,
// f16 in their staged order) scaled by `scale`, or route from the sums. False, having launched
// nothing, where the shapes do not fit it.
bool gemv_mxfp4_router_fold(const uint8_t* codes, const uint8_t* scales, const float* bias, const float* x, float* y,
                            int64_t n, int64_t k, const void* router, bool bf16, const float* norm, float eps,
                            int64_t n_experts, const FoldedRouting& routing, void* xg);
// Decode attention in one launch over the paged cache: f16 KV on the tensor cores
// (attention_decode_tc_kernel: head_dim 64/128, GQA groups up to 16), f32 KV on CUDA cores
// (attention_decode_kernel: head_dim 64/128, groups up to 8); false (nothing launched) for other
// shapes. partial: attention_partial_floats(...) floats of scratch; counters: kAttentionMaxPairs
// 64-bit device words, 0 at first (the split merge's counts, kernels/attention.cuh). sinks (per q head, or null) and window (0: none) as
// Backend::attention takes them, here and in attention().
constexpr int64_t kAttentionMaxPairs = 4096;
int64_t attention_partial_floats(int64_t m, int64_t max_context, int64_t n_head, int64_t head_dim);
bool attention_decode_supports(int64_t m, int64_t n_head, int64_t n_head_kv, int64_t head_dim, DType kv_dtype);
// The attention prologue fused into decode attention (qk_norm_rope_kv_write's inputs): F16 and FP8
// KV only; false, having launched nothing, for an F32 cache.
using kernels::AttentionPrologue;
bool attention_decode(const float* q, const KvPages& kv, float* partial, float* out, unsigned long long* counters, int64_t m,
                      const int32_t* positions, int64_t max_context, int64_t n_head, int64_t n_head_kv,
                      int64_t head_dim, float scale, const float* sinks = nullptr, int64_t window = 0,
                      const AttentionPrologue* prologue = nullptr);
void embed(Dense type, const void* table, const int32_t* ids, int64_t m, int64_t dim, float* out);
// delta non-null: x += delta first (the fused residual add). dim <= kNormMaxDim.
constexpr int64_t kNormMaxDim = 8192;
void rms_norm(const float* x, const float* delta, float* x_out, const float* w, float* y, int64_t rows,
              int64_t dim, float eps);
void qk_norm_rope_kv_write(const float* q_in, float* q_out, int64_t q_stride, const float* k_new,
                           const float* v_new, int64_t kv_stride, const float* q_norm,
                           const float* k_norm, float eps, const float* inv_freq, float attention_factor,
                           const int32_t* positions, int64_t m, int64_t n_head, int64_t n_head_kv,
                           int64_t head_dim, const KvPages& kv);
// Any shape, one warp per (token, q head): the exact fallback.
void attention(const float* q, const KvPages& kv, float* out, int64_t m, const int32_t* positions, int64_t n_head,
               int64_t n_head_kv, int64_t head_dim, float scale, const float* sinks = nullptr, int64_t window = 0);
void silu_mul(const float* gate, const float* up, int64_t count, float* out);
// gpt-oss's clamped SwiGLU over interleaved gate/up rows [rows, 2·inter] into out [rows, inter].
void clamped_swiglu_interleaved(const float* gate_up, int64_t rows, int64_t inter, float alpha, float limit,
                                float* out);
void add(const float* x, int64_t count, float* y);
// Row-wise arg-max (lowest index on ties); scratch: argmax_scratch_bytes(rows) of device memory.
// counters: kArgmaxMaxRows zeroed counters (left zeroed), or null. With them, one launch whose last
// block a row merges; with next_ids too, it also advances the next decode step's inputs as
// advance_decode does, and returns true (false: the caller still runs advance_decode).
// post (post_seq and post_ring non-null, one row): the pick also goes to the host's mapped ring
// (kernels/pick.cuh decode_post).
constexpr int64_t kArgmaxMaxRows = 4096;
constexpr int kDecodePostRing = 64;
struct DecodePostArgs {
  unsigned* seq = nullptr;               // device memory
  unsigned long long* ring = nullptr;    // kDecodePostRing entries of mapped pinned host memory
};
// A greedy decode step's head that also picks the token (gemv_mxfp4_pick): the pick to out[0],
// the next step's id and position advanced, the pick posted; scratch: gemv_mxfp4_pick_scratch_bytes()
// of device memory, counter: a zeroed counter (left zeroed).
constexpr int64_t kGreedyPickMaxBlocks = 4096;
struct GreedyPickArgs {
  void* scratch = nullptr;
  unsigned* counter = nullptr;
  int32_t* out = nullptr;
  int32_t* next_ids = nullptr;
  int32_t* positions = nullptr;
  DecodePostArgs post;
};
int64_t gemv_mxfp4_pick_scratch_bytes();
// Whether a backend's greedy head picks the token (Backend::rms_norm_linear_pick) where the streamed
// MXFP4 head runs: 0 never, otherwise yes (NIBBLE_HEAD_PICK=0 at start; set_head_pick for tests).
// head_picks(): how many picking heads were launched (tests).
void set_head_pick(int mode);
int head_pick_mode();
int64_t head_picks();
// y[1, n] = norm?(x) · Wᵀ (+ b) through the streamed MXFP4 head, picking the token as it goes;
// false, having launched nothing, where the streamed head does not take the shape.
bool gemv_mxfp4_pick(const uint8_t* codes, const uint8_t* scales, const float* bias, const float* x, float* y,
                     int64_t n, int64_t k, const GemvIo& io, const GreedyPickArgs& pick);
int64_t argmax_scratch_bytes(int64_t rows);
bool argmax(const float* x, int64_t rows, int64_t n, int32_t* out, void* scratch, unsigned* counters = nullptr,
            int32_t* next_ids = nullptr, int32_t* positions = nullptr, DecodePostArgs post = {});
// Backend::advance_decode.
void advance_decode(const int32_t* picked, int64_t n, int32_t* ids, int32_t* positions, DecodePostArgs post = {});
// Backend::apply_penalties (sampling.cu).
void apply_penalties(float* logits, int64_t n, const PenaltyRow* rows, int64_t n_rows, const PenaltyToken* tokens);
// Backend::sample for one row of n <= kSampleMaxVocab logits (sampling.cu); scratch:
// sample_scratch_bytes(n) bytes.
constexpr int64_t kSampleMaxVocab = 1024 * 1024;
int64_t sample_scratch_bytes(int64_t n);
void sample(const float* x, int64_t n, const SampleInputs* in, int32_t* out, void* scratch);
void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k, bool normalize,
               int32_t* ids, float* weights);
void gather_rows(const float* src, const int32_t* rows, int64_t n_rows, int64_t dim, float* dst);
void scatter_add_weighted(const float* src, const int32_t* rows, const float* row_weights,
                          int64_t n_rows, int64_t dim, float* dst);

// The in-kernel timeline of the decode kernels (kernels/timeline.cuh), in builds configured with
// -DNIBBLE_TIMELINE=ON: start keeps the newest `capacity` (a power of two) block records from now
// on; dump writes them, oldest first, to `path` (tools/timeline.py reads it). Both return false
// with the reason in *why_not otherwise.
bool timeline_start(int64_t capacity, std::string* why_not);
bool timeline_dump(const std::string& path, std::string* why_not);

// Sets the decode kernels' PDL trigger override (backend/pdl_trigger.h's bits); false on failure.
bool pdl_trigger_set(uint32_t bits);
// The expert kernels' routing loops sized for 512 experts even where the logits are fewer
// (kernels/moe_route.cuh route_choice_sized; NIBBLE_ROUTE_WIDE=1, for A/B runs).
bool route_wide_set(bool wide);

}  // namespace nibble::cuda
