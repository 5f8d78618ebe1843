// gpt-oss's ops on the CUDA backend against the CPU reference (tests/ops/gpu_compare.h): MXFP4
// linear layers, attention with sinks and sliding windows on every attention path (the split-K
// decode kernels with windows that end splits early or span them, the chunked prefill, the exact
// fallback for other head sizes; f16, f32 and FP8 KV), and the MoE block with a biased router,
// biased experts whose gate/up rows are interleaved, and the clamped SwiGLU. All f32 math on both
// sides except the tensor-core attention (f16 operands: 2e-3, as in OpsTest.Attention) and the MXFP4
// decode kernels, which round the activations to f16 (1e-3, as the INT4 ones in OpsTest); prefill
// shapes dequantise to BF16 (exact) for the near-f32 dense GEMM (1e-5).
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>

#include "backend/backend.h"
#include "core/dtype.h"
#include "gpu_compare.h"

#if defined(NIBBLE_HAVE_CUDA)
#include <cuda_runtime.h>

#include "backend/cuda/launch.h"
#endif

namespace nibble {
namespace {

constexpr double kTolerance = 1e-5;
constexpr double kF16Tolerance = 1e-3;

class GptOssOpsTest : public GpuCompareTest {
 protected:
  GptOssOpsTest() : GpuCompareTest(4321) {}

  // Random MXFP4 codes with block scales 2^-9 .. 2^-5 (gpt-oss's weights are of that size), or
  // E8M0 exponents scale_lo .. scale_hi.
  LinearWeight random_mxfp4(int64_t n, int64_t k, bool bias, int scale_lo = 118, int scale_hi = 122) {
    Mxfp4Matrix m;
    m.n = n;
    m.k = k;
    std::uniform_int_distribution<int> byte(0, 255), scale(scale_lo, scale_hi);
    m.codes.resize(size_t(n * k / 2));
    for (auto& c : m.codes) c = uint8_t(byte(rng_));
    m.scales.resize(size_t(n * k / 32));
    for (auto& s : m.scales) s = uint8_t(scale(rng_));
    LinearWeight w = mxfp4_weight("w", std::move(m));
    if (bias) {
      WeightVector b = host_vector(random(n, 0.5f));
      w.bias = b.data;
      w.storage.push_back(b.storage);
    }
    return w;
  }

  // gpt-oss's MoE block (top 4 renormalised, the clamped SwiGLU) with random MXFP4 experts whose
  // gate/up rows interleave, biases everywhere, and a biased router stored as router_format
  // (F32, BF16 or F16); dev is host uploaded.
  void random_gpt_oss_moe(int64_t H, int64_t inter, int64_t E, WeightFormat router_format, int scale_lo,
                          int scale_hi, MoeWeights& host, MoeWeights& dev) {
    for (MoeWeights* w : {&host, &dev}) {
      w->top_k = 4;
      w->normalize = true;
      w->activation = MoeActivation::kClampedSwiglu;
      w->swiglu_alpha = 1.702f;
      w->swiglu_limit = 7.f;
    }
    auto values = random(E * H, 0.2f);
    WeightVector bias = host_vector(random(E, 1.f));
    host.router.name = "router";
    host.router.n = E;
    host.router.k = H;
    host.router.format = router_format;
    host.router.bias = bias.data;
    host.router.storage = {bias.storage};
    if (router_format == WeightFormat::kF32) {
      auto full = std::make_shared<std::vector<float>>(values);
      host.router.dense = full->data();
      host.router.storage.push_back(full);
    } else {
      auto half = std::make_shared<std::vector<uint16_t>>(values.size());
      for (size_t i = 0; i < values.size(); ++i)
        (*half)[i] = router_format == WeightFormat::kF16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
      host.router.dense = half->data();
      host.router.storage.push_back(half);
    }
    dev.router = gpu_->upload(host.router);
    for (int64_t e = 0; e < E; ++e) {
      MlpWeights ex;
      ex.gate_up = random_mxfp4(2 * inter, H, true, scale_lo, scale_hi);
      ex.down = random_mxfp4(H, inter, true, scale_lo, scale_hi);
      MlpWeights d;
      d.gate_up = gpu_->upload(ex.gate_up);
      d.down = gpu_->upload(ex.down);
      host.experts.push_back(std::move(ex));
      dev.experts.push_back(std::move(d));
    }
  }
};

// Shapes: a last group of 3 blocks (k = 96) and of 2 (2880, gpt-oss's hidden size), rows that end
// inside a 16-row tile (136, 201), one block per row (32), one group (128), a row of 8 groups of
// 4 (4096, o_proj's input), and lm_head-sized matrices: with a last partial tile (the register
// GEMV's blocks of 4 tiles) and of whole tiles (at m = 1 streamed through shared memory on sm_90+,
// kernels/mxfp4_stream.cuh; k = 96: one partial group a row).
TEST_F(GptOssOpsTest, LinearMxfp4) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{136, 96}, {5760, 2880}, {201, 4096}, {64, 32}, {48, 128},
                      {32776, 2880}, {32768, 2880}, {32768, 96}}) {
    for (int64_t m : {1, 2, 3, 8, 9, 33, 77}) {  // 9 and up: cuBLASLt's GEMM on the BF16 copy
      if (n > 10000 && m != 1 && m != 3) continue;  // lm_head-sized: blocks striding over 2049 tiles
      LinearWeight host = random_mxfp4(n, k, m % 2 == 1);
      LinearWeight dev = gpu_->upload(host);
      auto x = random(m * k);
      std::vector<float> want(size_t(m * n));
      cpu_->linear(host, x.data(), m, want.data());
      float* out = poisoned_gpu(m * n);
      gpu_->linear(dev, on_gpu(x), m, out);
      const double tolerance = m <= 8 ? kF16Tolerance : kTolerance;
      expect_close(to_host(out, m * n), want, fmt::format("linear mxfp4 m={} n={} k={}", m, n, k), tolerance);
      release_buffers();
    }
  }
}

// The fused decode forms on MXFP4 (the RMS norm in the GEMV's prologue, the residual add in its
// store), q/k/v concatenated into one weight, and a weight filled on the device in the
// checkpoint's layout and then prepared (what dummy weights do).
TEST_F(GptOssOpsTest, Mxfp4FusedFormsConcatAndPrepare) {
  const int64_t k = 2880;
  const float eps = 1e-5f;
  WeightVector norm_host = host_vector(random(k, 1.f));
  WeightVector norm_dev = gpu_->upload(norm_host);
  // 5120 rows: gpt-oss's q/k/v (128-thread blocks, the one-pass norm at its widest: 6 units a
  // thread); 32776 rows: an lm_head's 2049 tiles, which the blocks stride over (double-buffered);
  // 32768 rows at m = 1: whole tiles, streamed on sm_90+.
  for (auto [n, m] : {std::pair<int64_t, int64_t>{200, 1}, {200, 4}, {5120, 1}, {32776, 1}, {32776, 3}, {32768, 1}}) {
    LinearWeight host = random_mxfp4(n, k, true), dev = gpu_->upload(host);
    auto x = random(m * k, 3.f);
    std::vector<float> want(size_t(m * n));
    cpu_->rms_norm_linear(x.data(), norm_host, eps, host, m, want.data());
    float* out = poisoned_gpu(m * n);
    gpu_->rms_norm_linear(on_gpu(x), norm_dev, eps, dev, m, out);
    expect_close(to_host(out, m * n), want, fmt::format("mxfp4 rms_norm_linear m={} n={}", m, n), kF16Tolerance);

    auto res = random(m * n, 2.f);
    std::vector<float> want_res = res;
    cpu_->linear_add(host, x.data(), m, want_res.data());
    float* res_dev = on_gpu(res);
    gpu_->linear_add(dev, on_gpu(x), m, res_dev);
    expect_close(to_host(res_dev, m * n), want_res, fmt::format("mxfp4 linear_add m={} n={}", m, n), kF16Tolerance);
    release_buffers();
  }
  {
    LinearWeight q = random_mxfp4(64, k, true), kk = random_mxfp4(16, k, true), v = random_mxfp4(48, k, true);
    LinearWeight dq = gpu_->upload(q), dk = gpu_->upload(kk), dv = gpu_->upload(v);
    std::optional<LinearWeight> qkv = gpu_->concat_rows({&dq, &dk, &dv});
    ASSERT_TRUE(qkv.has_value());
    ASSERT_EQ(qkv->n, 128);
    auto x = random(2 * k);
    std::vector<float> want(2 * 128), part;
    int64_t offset = 0;
    for (const LinearWeight* w : {&q, &kk, &v}) {
      part.assign(size_t(2 * w->n), 0.f);
      cpu_->linear(*w, x.data(), 2, part.data());
      for (int64_t r = 0; r < 2; ++r)
        std::copy_n(part.begin() + r * w->n, w->n, want.begin() + r * 128 + offset);
      offset += w->n;
    }
    float* out = poisoned_gpu(2 * 128);
    gpu_->linear(*qkv, on_gpu(x), 2, out);
    expect_close(to_host(out, 2 * 128), want, "mxfp4 q/k/v concatenated", kF16Tolerance);
    release_buffers();
  }
  {
    LinearWeight host = random_mxfp4(40, k, false);
    std::vector<uint8_t> codes(host.mxfp4.codes, host.mxfp4.codes + 40 * k / 2),
        scales(host.mxfp4.scales, host.mxfp4.scales + 40 * k / 32);
    LinearWeight raw = host;
    raw.storage.clear();
    raw.mxfp4 = {on_gpu(codes), on_gpu(scales), Mxfp4Layout::kRowMajor};
    LinearWeight dev = gpu_->prepare(raw);
    EXPECT_EQ(dev.mxfp4.layout, Mxfp4Layout::kDecode);
    for (int64_t m : {1, 12}) {
      auto x = random(m * k);
      std::vector<float> want(size_t(m * 40));
      cpu_->linear(host, x.data(), m, want.data());
      float* out = poisoned_gpu(m * 40);
      gpu_->linear(dev, on_gpu(x), m, out);
      expect_close(to_host(out, m * 40), want, fmt::format("mxfp4 prepared on the device m={}", m),
                   m <= 8 ? kF16Tolerance : kTolerance);
    }
    release_buffers();
  }
}

// A greedy decode step's MXFP4 head that picks the token itself (Backend::rms_norm_linear_pick; the
// streamed head on sm_90+ by default, else or with the switch off the head then the argmax): the logits as
// rms_norm_linear's, the pick the arg-max of those logits (two identical rows with the largest
// bias: the lower index), the next step's id and position advanced; three calls in a row (the
// blocks' counter left zeroed), a head too small to stream, and a shape that does not stream (rows
// not a whole tile).
TEST_F(GptOssOpsTest, HeadPicksTheToken) {
  const int64_t k = 2880;
  const float eps = 1e-5f;
  WeightVector norm_host = host_vector(random(k, 1.f)), norm_dev = gpu_->upload(norm_host);
  // The default (the streamed head picks), then NIBBLE_HEAD_PICK=0's mode (the argmax launch).
  for (const int mode : {-1, 0})
  for (const int64_t n : {int64_t(32768 + 16 * 37), int64_t(5120), int64_t(32776)}) {
#if defined(NIBBLE_HAVE_CUDA)
    cuda::set_head_pick(mode);
#endif
    LinearWeight host = random_mxfp4(n, k, true);
    std::uniform_int_distribution<int64_t> at(0, n - 1);
    int64_t a = at(rng_), b = at(rng_);
    if (a == b) b = (a + 1) % n;
    auto* codes = const_cast<uint8_t*>(host.mxfp4.codes);
    auto* scales = const_cast<uint8_t*>(host.mxfp4.scales);
    std::copy_n(codes + a * k / 2, k / 2, codes + b * k / 2);
    std::copy_n(scales + a * k / 32, k / 32, scales + b * k / 32);
    auto* bias = const_cast<float*>(host.bias);
    bias[a] = bias[b] = 1000.f;
    LinearWeight dev = gpu_->upload(host);
    int32_t* d_out = nullptr;
    int32_t* d_ids = nullptr;
    int32_t* d_pos = nullptr;
    for (auto* p : {&d_out, &d_ids, &d_pos}) {
      buffers_.emplace_back(*gpu_, 4);
      *p = buffers_.back().data<int32_t>();
    }
    int32_t position = 77;
    gpu_->copy_to_backend(d_pos, &position, 4);
    for (int call = 0; call < 3; ++call) {
      const auto x = random(k, 3.f);
      std::vector<float> want(static_cast<size_t>(n));
      cpu_->rms_norm_linear(x.data(), norm_host, eps, host, 1, want.data());
      float* logits = poisoned_gpu(n);
#if defined(NIBBLE_HAVE_CUDA)
      const int64_t picks_before = cuda::head_picks();
#endif
      gpu_->rms_norm_linear_pick(on_gpu(x), norm_dev, eps, dev, logits, d_out, d_ids, d_pos);
#if defined(NIBBLE_HAVE_CUDA)
      int major = 0;
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
      EXPECT_EQ(cuda::head_picks() - picks_before, mode != 0 && major >= 9 && n % 16 == 0 && n / 16 >= 2048 ? 1 : 0)
          << "n=" << n << " mode " << mode << ": the streamed head picks where it takes the shape, unless turned off";
#endif
      const std::vector<float> got = to_host(logits, n);
      const std::string what = fmt::format("head n={} mode {} call {}", n, mode, call);
      expect_close(got, want, what, kF16Tolerance);
      const auto best = int32_t(std::max_element(got.begin(), got.end()) - got.begin());
      EXPECT_EQ(best, int32_t(std::min(a, b))) << what << ": the tie goes to the lower index";
      int32_t out = -1, id = -1, pos = -1;
      gpu_->copy_to_host(&out, d_out, 4);
      gpu_->copy_to_host(&id, d_ids, 4);
      gpu_->copy_to_host(&pos, d_pos, 4);
      EXPECT_EQ(out, best) << what;
      EXPECT_EQ(id, best) << what;
      EXPECT_EQ(pos, 78 + call) << what;
    }
    release_buffers();
  }
#if defined(NIBBLE_HAVE_CUDA)
  cuda::set_head_pick(-1);
#endif
}

TEST_F(GptOssOpsTest, AttentionSinksAndWindows) {
  using Shape = AttentionShape;
  const std::vector<float> none;
  for (DType dtype : {DType::F16, DType::F32, DType::F8_E4M3}) {
    // gpt-oss's heads (64 q / 8 kv x 64), a 16-row GQA group, and a head size only the exact kernel takes.
    for (Shape s : {Shape{64, 8, 64}, Shape{16, 1, 64}, Shape{6, 2, 24}}) {
      std::vector<float> sinks = random(s.n_head, 3.f);
      // Contexts: inside the first split; a window reaching back over a split boundary (300);
      // splits wholly before the window (700, 5000: 2 and 19 splits of 256 end at once); a
      // prefill of 300 tokens in chunks with windows inside the chunk.
      for (auto [m, pos0] : {std::pair<int64_t, int64_t>{1, 20}, {1, 300}, {3, 700}, {1, 5000}, {300, 40}}) {
        for (int64_t window : {int64_t(0), int64_t(128), int64_t(7)}) {
          for (bool with_sinks : {false, true}) {
            if (window == 0 && !with_sinks) continue;  // OpsTest.Attention
            std::vector<int32_t> positions(static_cast<size_t>(m));
            for (int64_t t = 0; t < m; ++t) positions[size_t(t)] = int32_t(pos0 + t);
            const int64_t group = s.n_head / s.n_head_kv;
            const bool hd_ok = s.head_dim == 64 || s.head_dim == 128;
            const bool tensor_cores = hd_ok && ((m > 8 && group <= 8) || (dtype != DType::F32 && group <= 16));
            expect_attention_close(s, positions, pos0 + m, pos0 + m + 300,
                                   fmt::format("attention {}/{}x{} m={} pos0={} window={}{}", s.n_head, s.n_head_kv,
                                               s.head_dim, m, pos0, window, with_sinks ? " sinks" : ""),
                                   tensor_cores ? 2e-3 : kTolerance, dtype, 4, with_sinks ? &sinks : nullptr,
                                   window);
            release_buffers();
          }
        }
      }
    }
  }
}

// A small block at three token counts, and gpt-oss's own sizes (2880 x 2880: several batches of
// groups per warp in both decode kernels, a last partial group of 128 k) at decode and prefill
// token counts. Prefill (m > 8) runs the grouped GEMMs: 160 x 96 (partial groups on both sides,
// features not a multiple of a block's) with 300 tokens over 8 experts (several row tiles an
// expert, partial last tiles) and 33 tokens over 32 (experts with no rows or one). Its kernels fold
// the block scales into f16 weights when all lie in 2^-23 .. 2^1: scales at both ends of that
// range, and scales below it (the exact per-block f32 scaling; folding those would multiply by
// garbage), at 300 tokens. Those weights reach 12, so their inputs are of size 1, not 40: the
// projections' f16-rounded inputs would otherwise err by more than the clamped SwiGLU's inputs.
TEST_F(GptOssOpsTest, MoeBlock) {
  struct Case {
    int64_t H, inter, E, m;
    int scale_lo = 118, scale_hi = 122;
    float x_size = 40.f;
  };
  for (auto [H, inter, E, m, scale_lo, scale_hi, x_size] :
       {Case{256, 128, 8, 1}, Case{256, 128, 8, 5}, Case{256, 128, 8, 40}, Case{160, 96, 8, 300},
        Case{160, 96, 8, 300, 104, 128, 1.f}, Case{160, 96, 8, 300, 96, 128, 1.f}, Case{256, 128, 32, 33},
        Case{2880, 2880, 6, 1}, Case{2880, 2880, 6, 3}, Case{2880, 2880, 6, 50}}) {
    MoeWeights host, dev;
    random_gpt_oss_moe(H, inter, E, WeightFormat::kF32, scale_lo, scale_hi, host, dev);
    // Inputs large enough that gate and up pass the ±7 clamp for some elements.
    auto x = random(m * H, x_size);
    std::vector<float> want(size_t(m * H));
    cpu_->moe(host, x.data(), m, want.data());
    // Two 16-bit roundings in sequence (the input, then the activation the down projection reads),
    // with the SwiGLU's exponential between them: twice the single-GEMV tolerance (measured
    // 1.1e-3 at 2880 x 2880, H100).
    float* out = poisoned_gpu(m * H);
    gpu_->moe(dev, on_gpu(x), m, out);
    expect_close(to_host(out, m * H), want,
                 fmt::format("gpt-oss moe {}x{} m={} scales {}..{}", H, inter, m, scale_lo, scale_hi),
                 2 * kF16Tolerance);
    // The decode step's form: the norm first, the block's output added to the residual stream.
    WeightVector norm_host = host_vector(random(H, 1.f));
    WeightVector norm_dev = gpu_->upload(norm_host);
    std::vector<float> want_res = x;
    cpu_->rms_norm_moe_add(norm_host, 1e-5f, host, m, want_res.data());
    float* res = on_gpu(x);
    gpu_->rms_norm_moe_add(norm_dev, 1e-5f, dev, m, res);
    // Compared as what was added, so the residual's size does not dilute the error.
    std::vector<float> got_res = to_host(res, m * H);
    for (size_t i = 0; i < x.size(); ++i) got_res[i] -= x[i], want_res[i] -= x[i];
    expect_close(got_res, want_res, fmt::format("gpt-oss rms_norm_moe_add {}x{} m={}", H, inter, m),
                 2 * kF16Tolerance);
    release_buffers();
  }
}

// The decode step's o projection and MoE block as one op (Backend::linear_add_rms_norm_moe_add)
// where o is MXFP4 (gpt-oss all-MXFP4): on the GPU the router is folded into the o GEMV
// (kernels/router_fold.cuh), and the expert kernels route from its sums, or (the routing launch,
// cuda::set_fold_route_launch) a one-block launch after o does. gpt-oss-20b's shapes (o 4096 ->
// 2880, 32 experts, a BF16 router) and 120b's expert count (128, here an F16 router, small
// experts); m = 2 and an F32 router take the separate ops. Three calls in a row, the sums zeroed
// after each by the next MXFP4 GEMV (the first call's: a linear_add between calls) or before the
// next fold (a stale sum would route the next call wrongly). Tolerance as the MoE block's decode
// form above: the o GEMV's f16 inputs add one more rounding of the same size, and the compared part
// is what was added to the residual.
TEST_F(GptOssOpsTest, RouterFoldedIntoMxfp4O) {
  struct Case {
    int64_t H, o_k, inter, E;
    WeightFormat router_format;
    bool folds;
  };
  for (const bool route_launch : {false, true}) {
#if defined(NIBBLE_HAVE_CUDA)
    cuda::set_fold_route_launch(route_launch ? 1 : 0);
#endif
    for (const Case& c : {Case{2880, 4096, 2880, 32, WeightFormat::kBF16, true},
                          Case{2880, 4096, 256, 128, WeightFormat::kF16, true},
                          Case{1024, 2048, 512, 16, WeightFormat::kF32, false}})
      for (int64_t m : {1, 2}) {
        MoeWeights host, dev;
        random_gpt_oss_moe(c.H, c.inter, c.E, c.router_format, 118, 122, host, dev);
        const LinearWeight o_host = random_mxfp4(c.H, c.o_k, true);
        const LinearWeight o_dev = gpu_->upload(o_host);
        const WeightVector norm_host = host_vector(random(c.H, 1.f));
        const WeightVector norm_dev = gpu_->upload(norm_host);
        const std::string what =
            fmt::format("o {}->{}, {} experts of {}, {} router, m={}{}", c.o_k, c.H, c.E, c.inter,
                        weight_format_name(c.router_format), m, route_launch ? ", routing launch" : "");
        for (int call = 0; call < 3; ++call) {
          const auto x = random(m * c.H, 4.f), a = random(m * c.o_k, 2.f);
          std::vector<float> want = x;
          cpu_->linear_add_rms_norm_moe_add(o_host, a.data(), norm_host, 1e-5f, host, m, want.data());
          float* res = on_gpu(x);
#if defined(NIBBLE_HAVE_CUDA)
          const int64_t folds_before = cuda::router_fold_launches();
#endif
          gpu_->linear_add_rms_norm_moe_add(o_dev, on_gpu(a), norm_dev, 1e-5f, dev, m, res);
          std::vector<float> got = to_host(res, m * c.H);
          for (size_t i = 0; i < x.size(); ++i) got[i] -= x[i], want[i] -= x[i];
          expect_close(got, want, fmt::format("{}, call {}", what, call), 2 * kF16Tolerance);
#if defined(NIBBLE_HAVE_CUDA)
          EXPECT_EQ(cuda::router_fold_launches() - folds_before, c.folds && m == 1 ? 1 : 0) << what;
#endif
          if (call == 0) gpu_->linear_add(o_dev, on_gpu(random(c.o_k)), 1, on_gpu(random(c.H)));
        }
        release_buffers();
      }
  }
#if defined(NIBBLE_HAVE_CUDA)
  cuda::set_fold_route_launch(-1);
#endif
}

}  // namespace
}  // namespace nibble
