// gpt-oss's ops on the CUDA backend against the CPU reference (tests/ops/gpu_compare.h): MXFP4
// linear layers, attention with sinks and sliding windows on every attention path (the split-K
// decode kernels with windows that end splits early or span them, the chunked prefill, the exact
// fallback for other head sizes; f16, f32 and FP8 KV), and the MoE block with a biased router,
// biased experts whose gate/up rows are interleaved, and the clamped SwiGLU. All f32 math on both
// sides except the tensor-core attention (f16 operands: 2e-3, as in OpsTest.Attention).
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "gpu_compare.h"

namespace nibble {
namespace {

constexpr double kTolerance = 1e-5;

class GptOssOpsTest : public GpuCompareTest {
 protected:
  GptOssOpsTest() : GpuCompareTest(4321) {}

  // Random MXFP4 codes with block scales 2^-9 .. 2^-5 (gpt-oss's weights are of that size).
  LinearWeight random_mxfp4(int64_t n, int64_t k, bool bias) {
    Mxfp4Matrix m;
    m.n = n;
    m.k = k;
    std::uniform_int_distribution<int> byte(0, 255), scale(118, 122);
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
};

TEST_F(GptOssOpsTest, LinearMxfp4) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{136, 96}, {5760, 2880}, {201, 4096}, {64, 32}}) {
    for (int64_t m : {1, 3, 8, 9, 33}) {
      LinearWeight host = random_mxfp4(n, k, m % 2 == 1);
      LinearWeight dev = gpu_->upload(host);
      auto x = random(m * k);
      std::vector<float> want(size_t(m * n));
      cpu_->linear(host, x.data(), m, want.data());
      float* out = poisoned_gpu(m * n);
      gpu_->linear(dev, on_gpu(x), m, out);
      expect_close(to_host(out, m * n), want, fmt::format("linear mxfp4 m={} n={} k={}", m, n, k), kTolerance);
      release_buffers();
    }
  }
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

TEST_F(GptOssOpsTest, MoeBlock) {
  const int64_t H = 256, inter = 128, E = 8;
  for (int64_t m : {1, 5, 40}) {
    MoeWeights host, dev;
    for (MoeWeights* w : {&host, &dev}) {
      w->top_k = 4;
      w->normalize = true;
      w->activation = MoeActivation::kClampedSwiglu;
      w->swiglu_alpha = 1.702f;
      w->swiglu_limit = 7.f;
    }
    {
      auto values = std::make_shared<std::vector<float>>(random(E * H, 0.2f));
      WeightVector bias = host_vector(random(E, 1.f));
      host.router.name = "router";
      host.router.n = E;
      host.router.k = H;
      host.router.format = WeightFormat::kF32;
      host.router.dense = values->data();
      host.router.bias = bias.data;
      host.router.storage = {values, bias.storage};
    }
    dev.router = gpu_->upload(host.router);
    for (int64_t e = 0; e < E; ++e) {
      MlpWeights ex;
      ex.gate_up = random_mxfp4(2 * inter, H, true);
      ex.down = random_mxfp4(H, inter, true);
      MlpWeights d;
      d.gate_up = gpu_->upload(ex.gate_up);
      d.down = gpu_->upload(ex.down);
      host.experts.push_back(std::move(ex));
      dev.experts.push_back(std::move(d));
    }
    // Inputs large enough that gate and up pass the ±7 clamp for some elements.
    auto x = random(m * H, 40.f);
    std::vector<float> want(size_t(m * H));
    cpu_->moe(host, x.data(), m, want.data());
    float* out = poisoned_gpu(m * H);
    gpu_->moe(dev, on_gpu(x), m, out);
    expect_close(to_host(out, m * H), want, fmt::format("gpt-oss moe m={}", m), kTolerance);
    release_buffers();
  }
}

}  // namespace
}  // namespace nibble
