// The tensor-core paths of the CUDA backend against the CPU reference: `linear` with m > 8 rows
// (W4A16 GEMM for interleaved INT4, the split-activation GEMM for F16/BF16) and `moe` for prefill
// (grouped GEMMs with the routing grouped on the GPU). Fresh random inputs, shapes that are not tile
// multiples, every group size, symmetric and asymmetric zeros, bias on some; outputs poisoned with
// NaN first. Error = max |ours - cpu| / max |cpu| over the output. Without a GPU: skipped.
//
// Tolerances, by path:
//  - W4A16 (kInt4Tolerance = 1e-3): the GEMM rounds each activation to f16 and each dequantised
//    weight (q - z)·s to f16, relative errors of at most u = 2^-11 and about u/√3·0.75 rms. A dot
//    product of k such terms with random signs then has an error whose rms, relative to the rms of
//    the outputs, is about √2 · 0.75 · u/√3 ≈ 2.2e-4; max |error| / max |output| stays near that
//    (2.5e-4 .. 4e-4 in a simulation of these distributions). The MoE block chains two such GEMMs
//    (gate/up, then down on the f16-rounded SiLU(gate)·up): about 5e-4. 1e-3 leaves 2x or more.
//  - split activations for F16/BF16 weights (kSplitTolerance = 1e-5): x = hi + lo + r with
//    |r| <= 2^-16 |x| (bf16), 2^-22 |x| (f16); the tensor cores' truncating accumulation is flushed
//    into f32 every 32 k. Simulated: <= 4e-6 at k = 4096, including the CPU's own f32 rounding.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <iterator>
#include <limits>
#include <random>

#include "backend/backend.h"
#include "core/dtype.h"
#include "core/status.h"
#include "model/weights.h"
#include "gpu_compare.h"

namespace nibble {
namespace {

constexpr double kInt4Tolerance = 1e-3;
constexpr double kSplitTolerance = 1e-5;

class GemmTest : public GpuCompareTest {
 protected:
  GemmTest() : GpuCompareTest(4321) {}

  // INT4 [n, k]: random codes, zeros (or all 8) and positive scales; group -1: one group over K.
  LinearWeight int4(int64_t n, int64_t k, int64_t group, bool symmetric, bool bias) {
    Int4Matrix q;
    q.n = n;
    q.k = k;
    q.group_size = group > 0 ? group : k;
    q.n_groups = (k + q.group_size - 1) / q.group_size;
    std::uniform_int_distribution<int> code(0, 255), zero(0, 15);
    std::uniform_real_distribution<float> scale(0.005f, 0.05f);
    q.codes.resize(size_t(n * q.row_bytes()));
    for (auto& c : q.codes) c = uint8_t(code(rng_));
    q.scales.resize(size_t(n * q.n_groups));
    for (auto& s : q.scales) s = f32_to_f16(scale(rng_));
    q.zeros.resize(size_t(n * q.n_groups));
    for (auto& z : q.zeros) z = symmetric ? 8 : uint8_t(zero(rng_));
    LinearWeight w = int4_weight("w", std::move(q));
    if (bias) add_bias(w);
    return w;
  }
  // Dense F16/BF16 [n, k] from f32 values (random in ±0.1 unless given).
  LinearWeight dense(WeightFormat format, int64_t n, int64_t k, bool bias, std::vector<float> values = {}) {
    if (values.empty()) values = random(n * k, 0.1f);
    auto half = std::make_shared<std::vector<uint16_t>>(values.size());
    for (size_t i = 0; i < values.size(); ++i)
      (*half)[i] = format == WeightFormat::kF16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
    LinearWeight w;
    w.name = "w";
    w.n = n;
    w.k = k;
    w.format = format;
    w.dense = half->data();
    w.storage.push_back(half);
    if (bias) add_bias(w);
    return w;
  }
  void add_bias(LinearWeight& w) {
    WeightVector b = host_vector(random(w.n));
    w.bias = b.data;
    w.storage.push_back(b.storage);
  }

  void compare_linear(const LinearWeight& host, int64_t m, double tolerance, const std::string& what) {
    const LinearWeight dev = gpu_->upload(host);
    const auto x = random(m * host.k);
    std::vector<float> want(size_t(m * host.n));
    cpu_->linear(host, x.data(), m, want.data());
    float* out = poisoned_gpu(m * host.n);
    gpu_->linear(dev, on_gpu(x), m, out);
    expect_close(to_host(out, m * host.n), want, what, tolerance);
    release_buffers();
  }

};

struct Int4Format {
  int64_t group;  // -1: one group over K
  bool symmetric;
};
constexpr Int4Format kInt4Formats[] = {{32, false}, {64, true}, {128, false}, {-1, true},
                                       {32, true},  {64, false}, {128, true}, {-1, false}};

std::string int4_name(Int4Format f) {
  return fmt::format("int4-{}{}", f.group > 0 ? fmt::format("g{}", f.group) : std::string("channel"),
                     f.symmetric ? "-sym" : "");
}

// Every m bucket (16/32/64/128-row tiles, and the small tiles a narrow n falls back to) with every K
// (one chunk pair, a partial group of 3 chunks, whole groups), n rotating through sizes below a
// tile, not a multiple of one, and wide; the formats rotate too. The CPU reference bounds the size.
TEST_F(GemmTest, Int4Linear) {
  const int64_t ms[] = {9, 16, 17, 31, 64, 100, 128, 255, 1000};
  const int64_t ks[] = {256, 768, 2048, 4096};
  const int64_t ns[] = {8, 136, 512, 1000, 4096};
  constexpr int64_t kMaxMacs = int64_t(6e8);
  int index = 0;
  for (size_t im = 0; im < std::size(ms); ++im)
    for (size_t ik = 0; ik < std::size(ks); ++ik, ++index) {
      const int64_t m = ms[im], k = ks[ik];
      size_t in = (im + 2 * ik) % std::size(ns);
      while (in > 0 && m * ns[in] * k > kMaxMacs) --in;
      const int64_t n = ns[in];
      const Int4Format f = kInt4Formats[size_t(index) % std::size(kInt4Formats)];
      const bool bias = index % 3 == 0;
      compare_linear(int4(n, k, f.group, f.symmetric, bias), m, kInt4Tolerance,
                     fmt::format("linear {} m={} n={} k={}{}", int4_name(f), m, n, k, bias ? " bias" : ""));
    }
  // Each format on a partial 4-chunk group (k = 768) and full ones; an odd n (scalar stores); the
  // 128-row tile (it needs enough blocks: m = 1000, n = 4096).
  for (Int4Format f : kInt4Formats) {
    compare_linear(int4(136, 768, f.group, f.symmetric, true), 31, kInt4Tolerance,
                   fmt::format("linear {} m=31 n=136 k=768 bias", int4_name(f)));
    compare_linear(int4(1000, 2048, f.group, f.symmetric, false), 300, kInt4Tolerance,
                   fmt::format("linear {} m=300 n=1000 k=2048", int4_name(f)));
  }
  compare_linear(int4(131, 768, 64, false, true), 255, kInt4Tolerance, "linear int4-g64 m=255 n=131 k=768 bias");
  compare_linear(int4(4096, 256, 128, false, true), 1000, kInt4Tolerance, "linear int4-g128 m=1000 n=4096 k=256 bias");
  compare_linear(int4(4096, 1024, 32, false, false), 1000, kInt4Tolerance, "linear int4-g32 m=1000 n=4096 k=1024");
}

// F16/BF16 weights with m > 8: the split-activation GEMM. k % 8 == 0 (whole 16-byte rows), with
// and without a partial last 32-k stage; n below, at and past the 64-column tile.
TEST_F(GemmTest, DenseLinear) {
  const std::pair<int64_t, int64_t> shapes[] = {{8, 40}, {128, 2048}, {136, 328}, {1000, 96}, {513, 1024}, {64, 4096}};
  int index = 0;
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kF16})
    for (int64_t m : {9, 33, 100, 300})
      for (auto [n, k] : shapes) {
        const bool bias = index++ % 2 == 0;
        compare_linear(dense(format, n, k, bias), m, kSplitTolerance,
                       fmt::format("linear {} m={} n={} k={}{}", weight_format_name(format), m, n, k,
                                   bias ? " bias" : ""));
      }
}

// The MoE block for prefill: INT4 experts through the grouped path, a BF16 router through the
// split GEMM (m > 8). Activations and router weights are on a coarse grid (x multiples of 2^-6 in
// ±2, router multiples of 2^-8) so every logit is exact in f32 on both sides whatever the summation
// order: the top-k choice is then identical (ties break to the lower id on both), and the test
// measures the GEMMs, not near-tie flips of the routing. Skewed routing: experts 0..3 take most
// tokens and, with 128 experts and few tokens, most experts stay empty.
TEST_F(GemmTest, MoePrefill) {
  struct Config {
    int64_t experts, hidden, inter;
  };
  for (Config c : {Config{16, 512, 256}, Config{16, 1024, 768}, Config{128, 512, 256}}) {
    MoeWeights host, dev;
    for (int64_t e = 0; e < c.experts; ++e) {
      // Group sizes vary by config: 32, 128 and a whole-K group on the down projection.
      const int64_t group = c.inter == 768 ? 128 : 32;
      host.experts.push_back({int4(c.inter, c.hidden, group, e % 2 == 0, false),
                              int4(c.inter, c.hidden, group, e % 2 == 0, false),
                              int4(c.hidden, c.inter, c.experts == 128 ? -1 : group, e % 2 == 1, false)});
      const MlpWeights& ex = host.experts.back();
      dev.experts.push_back({gpu_->upload(ex.gate), gpu_->upload(ex.up), gpu_->upload(ex.down)});
    }
    auto grid = [](std::vector<float> v, float step) {
      for (auto& x : v) x = std::round(x / step) * step;
      return v;
    };
    for (bool skewed : {false, true}) {
      auto router = grid(random(c.experts * c.hidden, skewed ? 0.01f : 0.1f), 1.f / 256);
      if (skewed)
        for (int64_t e = 0; e < 4; ++e)
          for (int64_t i = 0; i < c.hidden; ++i) router[size_t(e * c.hidden + i)] = 0.5f;
      host.router = dense(WeightFormat::kBF16, c.experts, c.hidden, false, router);
      dev.router = gpu_->upload(host.router);
      // Mean rows per expert from 1 to 400: every tile size of the grouped GEMM (16 .. 128 rows);
      // m = 5 with top_k = 10 takes the prefill path at decode size (top_k > 8).
      for (auto [m, top_k] : {std::pair<int64_t, int64_t>{9, 4}, {40, 8}, {300, 4}, {300, 8}, {5, 10}, {1600, 4}}) {
        host.top_k = dev.top_k = top_k;
        host.normalize = dev.normalize = m != 40;
        auto x = grid(random(m * c.hidden, 2.f), 1.f / 64);
        if (skewed)
          for (auto& v : x) v = std::fabs(v) + 0.125f;  // positive inputs: the 0.5 rows dominate
        std::vector<float> want(size_t(m * c.hidden));
        cpu_->moe(host, x.data(), m, want.data());
        float* out = poisoned_gpu(m * c.hidden);
        gpu_->moe(dev, on_gpu(x), m, out);
        expect_close(to_host(out, m * c.hidden), want,
                     fmt::format("moe E={} {}x{} m={} top_k={}{}", c.experts, c.hidden, c.inter, m, top_k,
                                 skewed ? " skewed" : ""),
                     kInt4Tolerance);
        release_buffers();
      }
    }
  }
}

}  // namespace
}  // namespace nibble
