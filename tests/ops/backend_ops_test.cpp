// Every op of every non-CPU backend against the CPU reference, on fresh random inputs (never
// zeros), awkward shapes (sizes that are not tile multiples, GQA ratios, empty experts, skewed
// routing) and every weight format. Outputs are poisoned with NaN first, so an element a kernel
// forgets to write fails the test. Error = max |ours - cpu| / max |cpu| over the output; where both
// sides compute in f32 the tolerance is 1e-5 (summation order is the only difference). The
// W4A16 tensor-core paths (interleaved INT4: the decode GEMVs for m <= 8 rows, the GEMMs above,
// and the MoE kernels built on both) round activations and dequantised weights to f16: 1e-3 there
// (kF16Tolerance, derived in tests/ops/gemm_test.cpp). F16/BF16 weights keep 1e-5 (f32 GEMVs, and
// split f32 activations for m > 8).
// Without a GPU (or in a build without CUDA) the tests report as skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "backend/backend.h"
#include "core/status.h"
#include "model/model.h"
#include "gpu_compare.h"

#if defined(NIBBLE_HAVE_CUDA)
#include "backend/cuda/launch.h"
#endif

namespace nibble {
namespace {

constexpr double kTolerance = 1e-5;
constexpr double kF16Tolerance = 1e-3;

// Whether the CUDA backend runs this INT4 weight through its f16 tensor-core kernels: the
// interleaved layout (k % 256 == 0, groups of a power of two >= 32 or all of k), at every m.
bool f16_path(WeightFormat format, int64_t k, int64_t group) {
  const bool interleaved = k % 256 == 0 && (group < 0 || group >= k || (group >= 32 && (group & (group - 1)) == 0));
  return format == WeightFormat::kInt4 && interleaved;
}

class OpsTest : public GpuCompareTest {
 protected:
  OpsTest() : GpuCompareTest(1234) {}
  void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                    double tolerance = kTolerance) {
    GpuCompareTest::expect_close(got, want, what, tolerance);
  }

  // A random weight of shape [n, k] in `format` (INT4: random codes, zeros and positive scales).
  LinearWeight random_weight(WeightFormat format, int64_t n, int64_t k, int64_t group = 32, bool bias = false,
                             bool symmetric = false) {
    LinearWeight w;
    if (format == WeightFormat::kInt4) {
      Int4Matrix m;
      m.n = n;
      m.k = k;
      m.group_size = group > 0 ? group : k;
      m.n_groups = (k + m.group_size - 1) / m.group_size;
      std::uniform_int_distribution<int> code(0, 255), zero(0, 15);
      std::uniform_real_distribution<float> scale(0.005f, 0.05f);
      m.codes.resize(size_t(n * m.row_bytes()));
      for (auto& c : m.codes) c = uint8_t(code(rng_));
      m.scales.resize(size_t(n * m.n_groups));
      for (auto& s : m.scales) s = f32_to_f16(scale(rng_));
      m.zeros.resize(size_t(n * m.n_groups));
      for (auto& z : m.zeros) z = symmetric ? 8 : uint8_t(zero(rng_));
      w = int4_weight("w", std::move(m));
    } else {
      auto values = random(n * k, 0.1f);
      std::shared_ptr<std::vector<uint16_t>> half;
      std::shared_ptr<std::vector<float>> full;
      if (format == WeightFormat::kF32) {
        full = std::make_shared<std::vector<float>>(values);
        w.dense = full->data();
        w.storage.push_back(full);
      } else {
        half = std::make_shared<std::vector<uint16_t>>(values.size());
        for (size_t i = 0; i < values.size(); ++i)
          (*half)[i] = format == WeightFormat::kF16 ? f32_to_f16(values[i]) : f32_to_bf16(values[i]);
        w.dense = half->data();
        w.storage.push_back(half);
      }
      w.name = "w";
      w.n = n;
      w.k = k;
      w.format = format;
    }
    if (bias) {
      WeightVector b = host_vector(random(n));
      w.bias = b.data;
      w.storage.push_back(b.storage);
    }
    return w;
  }

  // m rows x through linear (when `plain`), rms_norm_linear and linear_add (the decode GEMVs'
  // fused forms) on both backends, every output poisoned first.
  void expect_fused_forms(const LinearWeight& host, const LinearWeight& dev, const std::vector<float>& x, int64_t m,
                          double tolerance, const std::string& what, bool plain = true) {
    const int64_t n = host.n, k = host.k;
    std::vector<float> want(size_t(m * n));
    if (plain) {
      cpu_->linear(host, x.data(), m, want.data());
      float* out = poisoned_gpu(m * n);
      gpu_->linear(dev, on_gpu(x), m, out);
      expect_close(to_host(out, m * n), want, "linear " + what, tolerance);
    }

    WeightVector norm = host_vector(random(k));
    cpu_->rms_norm_linear(x.data(), norm, 1e-6f, host, m, want.data());
    float* out = poisoned_gpu(m * n);
    gpu_->rms_norm_linear(on_gpu(x), gpu_->upload(norm), 1e-6f, dev, m, out);
    expect_close(to_host(out, m * n), want, "rms_norm_linear " + what, tolerance);

    auto residual = random(m * n, 2.f);
    want = residual;
    cpu_->linear_add(host, x.data(), m, want.data());
    float* res = on_gpu(residual);
    gpu_->linear_add(dev, on_gpu(x), m, res);
    expect_close(to_host(res, m * n), want, "linear_add " + what, tolerance);
  }

  // One token of a random INT4 weight through the fused forms, at the f16 paths' tolerance;
  // `path` names the kernel.
  void expect_int4_one_token(const std::string& path, int64_t n, int64_t k, int64_t group, bool bias, bool symmetric) {
    LinearWeight host = random_weight(WeightFormat::kInt4, n, k, group, bias, symmetric);
    expect_fused_forms(host, gpu_->upload(host), random(k, 3.f), 1, kF16Tolerance,
                       fmt::format("{} g{}{} n={} k={}", path, group, symmetric ? " sym" : "", n, k));
    release_buffers();
  }

  // m rows of random inputs (|x| up to x_scale) against a random BF16 weight with a bias through
  // the fused forms, at the exact kernel's tolerance.
  void expect_bf16_rows(int64_t n, int64_t k, int64_t m, float x_scale) {
    LinearWeight host = random_weight(WeightFormat::kBF16, n, k, 0, true);
    expect_fused_forms(host, gpu_->upload(host), random(m * k, x_scale), m, kTolerance,
                       fmt::format("bf16 m={} n={} k={}", m, n, k));
    release_buffers();
  }
};

TEST_F(OpsTest, Linear) {
  struct Format {
    WeightFormat format;
    int64_t group;
    const char* name;
    bool symmetric = false;
  };
  // Shapes: not multiples of any tile (row-major INT4 / exact kernels), and the decode GEMV
  // layouts: K a multiple of 1024 (whole 16-byte groups), 768 (a partial group of 3 chunks),
  // 4096 (4 warps along K), 4352 (8 warps, a partial fifth group), 9216 (two groups for some warps,
  // and 147 KB of staged activations at m = 8), n = 100 (a partial 16-row tile), n = 20000 (more
  // rows than the dense GEMV's grid: its warps stride over row groups), 5120 x 2048 (Qwen3-30B-A3B's
  // q/k/v: 320 tiles, 3 a block at m = 1 on a 132-SM GPU, the last block's third tile past n).
  // At m = 1 with K a multiple of 1024, 64 x 4096, 5120 x 2048 and 4096 x 2048 (two tiles a
  // block, as a 4-bit lm_head's 151,936 x 2048) split each group between two warps (MmaTile's
  // SUB), for every group size.
  for (Format f : {Format{WeightFormat::kF32, 0, "f32"}, Format{WeightFormat::kF16, 0, "f16"},
                   Format{WeightFormat::kBF16, 0, "bf16"}, Format{WeightFormat::kInt4, 32, "int4-g32"},
                   Format{WeightFormat::kInt4, 64, "int4-g64"}, Format{WeightFormat::kInt4, 128, "int4-g128"},
                   Format{WeightFormat::kInt4, 128, "int4-g128-sym", true},
                   Format{WeightFormat::kInt4, -1, "int4-channel"}}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{136, 96}, {200, 328}, {8, 2048}, {1000, 40}, {4096, 2048},
                        {2048, 768}, {9000, 256}, {100, 1024}, {64, 4096}, {24, 4352}, {40, 9216}, {20000, 256},
                        {5120, 2048}}) {
      for (int64_t m : {1, 2, 3, 5, 8, 16, 33}) {
        const bool bias = m == 5;
        LinearWeight host = random_weight(f.format, n, k, f.group, bias, f.symmetric);
        LinearWeight dev = gpu_->upload(host);
        auto x = random(m * k);
        std::vector<float> want(size_t(m * n));
        cpu_->linear(host, x.data(), m, want.data());
        float* out = poisoned_gpu(m * n);
        gpu_->linear(dev, on_gpu(x), m, out);
        expect_close(to_host(out, m * n), want, fmt::format("linear {} m={} n={} k={}", f.name, m, n, k),
                     f16_path(f.format, k, f.group) ? kF16Tolerance : kTolerance);
      }
    }
  }
}

// The streamed INT4 GEMV (kernels/int4_stream.cuh: one token, taken when switched on, on an sm_90+
// GPU, whole 16-row tiles, k % 256 == 0) against the CPU reference: K from one
// partial group of 1024 (768: eight tiles at once) to nine groups (9216: a warp's second group), a
// partial last group (4352), every group size, zero points or none, a bias, the fused RMS norm and
// the residual add; 20000 x 256 has more tiles than a wave of blocks. Its products are the register
// GEMV's (mma_group_dot on the same words): the same tolerance.
TEST_F(OpsTest, LinearInt4Streamed) {
#if defined(NIBBLE_HAVE_CUDA)
  cuda::set_int4_stream(true);
#endif
  for (auto [group, symmetric] : {std::pair<int64_t, bool>{32, false}, {64, false}, {128, false}, {128, true}, {-1, false}})
    for (auto [n, k] : {std::pair<int64_t, int64_t>{4096, 2048}, {2048, 768}, {64, 4096}, {16, 9216}, {5120, 2048},
                        {2048, 4352}, {20000, 256}})
      expect_int4_one_token("streamed", n, k, group, n == 2048, symmetric);
#if defined(NIBBLE_HAVE_CUDA)
  cuda::set_int4_stream(false);
#endif
}

// The strided INT4 GEMV (kernels::gemv_int4_mma_strided_kernel: one token, a long matrix of K
// 2048, one wave of blocks over its tiles; a 4-bit lm_head) against the CPU reference, forced on
// (it is taken from 32 tiles an SM): Qwen3's head (151,936 x 2048: rounds the grid does not
// divide), 70,008 rows (a partial last tile), 8,008 (fewer tiles than the grid takes, one round
// a block), every group size, zero points or none, a bias, the fused RMS norm and the residual
// add, in the shape taken by default (a warp to whole tiles). The products are the register
// GEMV's (MmaTile): the same tolerance.
TEST_F(OpsTest, LinearInt4Strided) {
#if defined(NIBBLE_HAVE_CUDA)
  cuda::set_int4_strided(1);
#endif
  for (auto [group, symmetric] : {std::pair<int64_t, bool>{32, false}, {64, false}, {128, false}, {128, true}})
    for (int64_t n : {151936, 70008, 8008})
      if (n != 151936 || group == 128)  // the head's shape at its group size
        expect_int4_one_token("strided", n, 2048, group, n == 8008, symmetric);
#if defined(NIBBLE_HAVE_CUDA)
  cuda::set_int4_strided(-1);
#endif
}

// Prefill-sized 16-bit linears (more than 8 rows) go to cuBLASLt with x split into two 16-bit
// halves (backend/cuda/cublaslt.h): near-f32, the exact kernel's tolerance, with and without a
// bias, with shapes that are not multiples of any tile. Where the library is missing the exact
// kernel runs and the test still holds.
TEST_F(OpsTest, LinearDensePrefillRows) {
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kF16})
    for (auto [n, k] : {std::pair<int64_t, int64_t>{5120, 2880}, {200, 328}, {1000, 4096}})
      for (int64_t m : {9, 16, 65, 300}) {
        const bool bias = m == 65 || m == 9;
        LinearWeight host = random_weight(format, n, k, 0, bias);
        LinearWeight dev = gpu_->upload(host);
        auto x = random(m * k);
        std::vector<float> want(size_t(m * n));
        cpu_->linear(host, x.data(), m, want.data());
        float* out = poisoned_gpu(m * n);
        gpu_->linear(dev, on_gpu(x), m, out);
        expect_close(to_host(out, m * n), want,
                     fmt::format("linear {} m={} n={} k={}{}", format == WeightFormat::kBF16 ? "bf16" : "f16", m, n,
                                 k, bias ? " bias" : ""),
                     kTolerance);
        release_buffers();
      }
}

// BF16 weights of decode shapes (m <= 8) take the tensor-core GEMV (kernels/gemv_dense_mma.cuh)
// with x split into two bf16 halves: held to the exact kernel's tolerance through linear (with a
// bias), the fused norm and the fused residual add. Shapes: gpt-oss's q/k/v and o (4 and 8 warps
// along K), K with a partial 32-k pair (2888) and a partial batch, N not a multiple of the 8-row
// tile; large values (|x| up to 300) keep the lo half's share of the products in view.
TEST_F(OpsTest, LinearBf16Decode) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{5120, 2880}, {2880, 4096}, {1003, 2888}, {300, 1000}})
    for (int64_t m : {1, 2, 5, 8}) expect_bf16_rows(n, k, m, 300.f);
}

// BF16 decode rows against a long matrix (from 32 tiles an SM: an lm_head), which the tensor-core
// GEMV reads with 4 warps along K and 8 KB or 4 KB batches a warp, its blocks striding over the
// tiles: Qwen3's head (151,936 x 2048: one 8 KB batch a warp), 40,000 x 4096 (two a warp),
// 70,003 x 2880 (a partial last tile; 4 KB batches, three a warp, the last one partial), with 1
// to 3 rows, through linear with a bias, the fused norm and the fused residual add, at the exact
// kernel's tolerance.
TEST_F(OpsTest, LinearBf16LongMatrix) {
  for (auto [n, k] : {std::pair<int64_t, int64_t>{151936, 2048}, {40000, 4096}, {70003, 2880}})
    for (int64_t m : {1, 2, 3})
      if (m == 1 || (n != 151936 && m == (k == 4096 ? 2 : 3))) expect_bf16_rows(n, k, m, 30.f);
}

// An lm_head-sized 16-bit weight (2^27 elements and up) with 4-8 rows takes the tensor-core GEMM
// instead of the GEMV (CudaBackend::dense_gemm_first), through linear and the fused norm form;
// with 1-3 rows the BF16 tensor-core GEMV, whose blocks then stride over the 8-row tiles.
TEST_F(OpsTest, LargeDenseWeightFewRows) {
  const int64_t n = 65536, k = 2048;
  LinearWeight host = random_weight(WeightFormat::kBF16, n, k);
  LinearWeight dev = gpu_->upload(host);
  const WeightVector norm = host_vector(random(k)), dev_norm = gpu_->upload(norm);
  for (int64_t m : {1, 3, 4, 8}) {
    auto x = random(m * k);
    std::vector<float> want(size_t(m * n)), normed(x.size());
    cpu_->linear(host, x.data(), m, want.data());
    float* out = poisoned_gpu(m * n);
    gpu_->linear(dev, on_gpu(x), m, out);
    expect_close(to_host(out, m * n), want, fmt::format("linear bf16 m={} n={} k={}", m, n, k));
    cpu_->rms_norm(x.data(), norm, m, k, 1e-6f, normed.data());
    cpu_->linear(host, normed.data(), m, want.data());
    out = poisoned_gpu(m * n);
    gpu_->rms_norm_linear(on_gpu(x), dev_norm, 1e-6f, dev, m, out);
    expect_close(to_host(out, m * n), want, fmt::format("rms_norm_linear bf16 m={} n={} k={}", m, n, k));
    release_buffers();
  }
}

TEST_F(OpsTest, EmbedNormRopeElementwise) {
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kF16, WeightFormat::kBF16}) {
    LinearWeight table = random_weight(f, 301, 72);
    std::vector<int32_t> ids = {0, 300, 17, 17, 5};
    std::vector<float> want(ids.size() * 72);
    cpu_->embed(table, ids.data(), int64_t(ids.size()), want.data());
    float* out = poisoned_gpu(int64_t(want.size()));
    gpu_->embed(gpu_->upload(table), on_gpu(ids), int64_t(ids.size()), out);
    expect_close(to_host(out, int64_t(want.size())), want, "embed");
  }
  for (auto [rows, dim] : {std::pair<int64_t, int64_t>{1, 40}, {7, 2048}, {64, 96}}) {
    auto x = random(rows * dim, 3.f);
    WeightVector w = host_vector(random(dim));
    std::vector<float> want(x.size());
    cpu_->rms_norm(x.data(), w, rows, dim, 1e-6f, want.data());
    float* out = poisoned_gpu(rows * dim);
    gpu_->rms_norm(on_gpu(x), gpu_->upload(w), rows, dim, 1e-6f, out);
    expect_close(to_host(out, rows * dim), want, fmt::format("rms_norm {}x{}", rows, dim));
    // Fused with the residual add before it: both the updated residual and the norm.
    auto delta = random(rows * dim, 3.f);
    std::vector<float> want_x = x, want_norm(x.size());
    cpu_->add_rms_norm(delta.data(), want_x.data(), w, rows, dim, 1e-6f, want_norm.data());
    float* dx = on_gpu(x);
    float* dn = poisoned_gpu(rows * dim);
    gpu_->add_rms_norm(on_gpu(delta), dx, gpu_->upload(w), rows, dim, 1e-6f, dn);
    expect_close(to_host(dx, rows * dim), want_x, fmt::format("add_rms_norm residual {}x{}", rows, dim));
    expect_close(to_host(dn, rows * dim), want_norm, fmt::format("add_rms_norm norm {}x{}", rows, dim));
  }
  // The attention prologue: q/k per-head norm (or none), RoPE at arbitrary positions, KV write.
  for (const char* rope_type : {"default", "yarn"}) {
    for (bool norms : {true, false}) {
      ModelConfig c;
      c.head_dim = 128;
      c.rope.theta = 1e6;
      c.rope.type = rope_type;
      c.rope.factor = 4;
      c.rope.original_max_position_embeddings = 4096;
      RopeTable host = make_rope_table(c);
      RopeTable dev{gpu_->upload(host.inv_freq), host.attention_factor};
      const int64_t m = 3, nh = 6, nkv = 2, hd = 128, ctx = 40000, row = nkv * hd;
      using PagedKv = GpuCompareTest::PagedKv;
      std::vector<int32_t> positions = {5, 30001, 7};
      WeightVector qn = norms ? host_vector(random(hd)) : WeightVector{}, kn = norms ? host_vector(random(hd)) : WeightVector{};
      auto q = random(m * nh * hd, 2.f), k = random(m * row, 2.f), v = random(m * row);
      const WeightVector dqn = norms ? gpu_->upload(qn) : qn, dkn = norms ? gpu_->upload(kn) : kn;
      // f32 pools are compared exactly; f16 ones may differ by one f16 rounding step (2^-11
      // relative) where the GPU's f32 value lands on the other side of a rounding boundary, E4M3
      // ones by one E4M3 step (at most 1/8 of the element).
      for (DType dtype : {DType::F32, DType::F16, DType::F8_E4M3}) {
        const double tolerance = dtype == DType::F32 ? kTolerance : dtype == DType::F16 ? 1e-3 : 0.125;
        // Blocks of 16 positions, logical blocks shuffled over the pool (a position lands in
        // the row its block table entry says, not at row `position`).
        PagedKv want_kv = paged_kv(ctx, row, dtype, 4);
        std::vector<float> want_q = q;
        cpu_->qk_norm_rope_kv_write(want_q.data(), want_q.data(), nh * hd, k.data(), v.data(), row, qn, kn, 1e-6f,
                                    host, positions.data(), m, nh, nkv, hd, want_kv.host());
        // The positions written, in logical order, and the rest of the pool still NaN.
        auto written = [&](const std::vector<float>& all) {
          std::vector<float> out;
          for (int32_t p : positions) out.insert(out.end(), all.begin() + p * row, all.begin() + (p + 1) * row);
          return out;
        };
        const auto want_k = written(host_positions(want_kv, ctx, false));
        const auto want_v = written(host_positions(want_kv, ctx, true));
        const std::string what = fmt::format("qk_norm_rope_kv {}{} {}", rope_type, norms ? " norms" : "",
                                             dtype_name(dtype));
        for (bool fused : {false, true}) {
          PagedKv kv = paged_kv(ctx, row, dtype, 4);
          kv.table = want_kv.table;
          upload(kv);
          float* dq = nullptr;
          if (!fused) {
            dq = on_gpu(q);
            gpu_->qk_norm_rope_kv_write(dq, dq, nh * hd, on_gpu(k), on_gpu(v), row, dqn, dkn, 1e-6f, dev,
                                        on_gpu(positions), m, nh, nkv, hd, kv.gpu());
          } else {
            // One [q | k | v] row per token (strided inputs, q to its own buffer).
            const int64_t total = nh * hd + 2 * row;
            std::vector<float> rows(size_t(m * total));
            for (int64_t t = 0; t < m; ++t) {
              std::copy_n(q.begin() + t * nh * hd, nh * hd, rows.begin() + t * total);
              std::copy_n(k.begin() + t * row, row, rows.begin() + t * total + nh * hd);
              std::copy_n(v.begin() + t * row, row, rows.begin() + t * total + nh * hd + row);
            }
            float* df = on_gpu(rows);
            dq = poisoned_gpu(int64_t(q.size()));
            gpu_->qk_norm_rope_kv_write(df, dq, total, df + nh * hd, df + nh * hd + row, total, dqn, dkn, 1e-6f, dev,
                                        on_gpu(positions), m, nh, nkv, hd, kv.gpu());
          }
          const std::string w = what + (fused ? " fused" : "");
          expect_close(to_host(dq, int64_t(q.size())), want_q, w + " q", kTolerance);
          expect_close(written(gpu_positions(kv, ctx, false)), want_k, w + " k cache", tolerance);
          expect_close(written(gpu_positions(kv, ctx, true)), want_v, w + " v cache", tolerance);
          std::vector<uint8_t> pool(kv.k.size());
          gpu_->copy_to_host(pool.data(), kv.gpu_k, pool.size());
          int64_t finite = 0;
          for (int64_t r = 0; r < int64_t(pool.size() / dtype_size_bytes(dtype)) / row; ++r)
            for (int64_t i = 0; i < row; ++i) finite += std::isfinite(kv.at(pool, r, i));
          EXPECT_EQ(finite, m * row) << w << ": the kernel wrote K rows other than the tokens' positions";
          release_buffers();
        }
      }
    }
  }
  const int64_t count = 1001;
  auto a = random(count, 4.f), b = random(count, 4.f);
  std::vector<float> want(count);
  cpu_->silu_mul(a.data(), b.data(), count, want.data());
  float* out = poisoned_gpu(count);
  gpu_->silu_mul(on_gpu(a), on_gpu(b), count, out);
  expect_close(to_host(out, count), want, "silu_mul");
  want = b;
  cpu_->add(a.data(), count, want.data());
  float* y = on_gpu(b);
  gpu_->add(on_gpu(a), count, y);
  expect_close(to_host(y, count), want, "add");
}

// Attention over paged caches (shuffled block tables, NaN in unused rows) of both element types.
// Which kernel runs: m <= 8 with head_dim 64/128 is the split-K decode (f16 KV: tensor cores, GQA
// group <= 16; f32 KV: CUDA cores, group <= 8); m > 8 with head_dim 64/128 and group <= 8 is the
// flash-attention prefill, with a larger group the decode kernels in chunks of tokens; everything
// else the exact one-warp-per-head kernel. Tensor-core paths
// round q and the softmax numerators to f16 (and f32 K/V in the prefill): 2e-3, derived in
// tests/ops/flash_attention_test.cpp; the rest compute in f32 on the same K/V values: kTolerance.
TEST_F(OpsTest, Attention) {
  using Shape = AttentionShape;
  for (DType dtype : {DType::F16, DType::F32, DType::F8_E4M3}) {
    for (Shape s : {Shape{4, 2, 40}, Shape{32, 4, 128}, Shape{5, 1, 24}, Shape{8, 8, 64}, Shape{16, 1, 64}}) {
      // m = 300: a prefill that the GPU runs in two chunks of query tokens. Contexts from 1 to
      // 9,301 (max_context 300 above; 20,000 for the last decode, a bucket whose splits past the
      // position end at once) take every split size of the decode kernels.
      for (auto [m, pos0] : {std::pair<int64_t, int64_t>{1, 0}, {6, 0}, {1, 300}, {5, 17}, {33, 70}, {1, 3000},
                             {8, 1000}, {1, 9000}, {300, 40}}) {
        std::vector<int32_t> positions(static_cast<size_t>(m));
        for (int64_t t = 0; t < m; ++t) positions[size_t(t)] = int32_t(pos0 + t);
        const int64_t group = s.n_head / s.n_head_kv;
        const bool hd_ok = s.head_dim == 64 || s.head_dim == 128;
        // m > 8 and group > 8 runs the decode kernel in chunks of tokens.
        const bool tensor_cores = hd_ok && ((m > 8 && group <= 8) || (dtype != DType::F32 && group <= 16));
        // Blocks of 16 positions, and of 1 and 64 for one shape each.
        const int log2 = s.head_dim == 64 ? (s.n_head == 8 ? 0 : 6) : 4;
        expect_attention_close(s, positions, pos0 + m, pos0 == 9000 ? 20000 : pos0 + m + 300,
                               fmt::format("attention {}/{}x{} m={} pos0={}", s.n_head, s.n_head_kv, s.head_dim, m, pos0),
                               tensor_cores ? 2e-3 : kTolerance, dtype, log2);
        release_buffers();
      }
    }
  }
}

// Decode attention's split merge counts each (token, kv head) pair's arrivals on a count that only
// grows, each launch adding a multiple of 2^16 in all (kernels/attention.cuh): consecutive launches
// on one backend with different numbers of splits holding positions (one split alone, which never
// counts; a sliding window past the first splits; several tokens of different lengths) must each
// merge their own launch's partials. A launch that left a count off its multiple would give the
// next launch wrong arrival ranks: a merge before every partial is stored, or none. Twice through,
// so every pair's count has passed several launches.
TEST_F(OpsTest, AttentionSplitMergeCountAcrossLaunches) {
  const AttentionShape s{32, 4, 128};  // 8 q heads a kv head: several mergers a pair
  ::setenv("NIBBLE_ATTN_CLUSTER", "0", 1);  // the merge through L2 at every context
  struct Step {
    std::vector<int32_t> positions;
    int64_t window;
  };
  const std::vector<Step> steps = {{{3000}, 0},           {{40}, 0},    {{5000}, 1000},
                                   {{700, 2900, 12}, 0}, {{9000}, 4096}, {{2500}, 0}};
  for (int round = 0; round < 2; ++round) {
    for (const Step& step : steps) {
      const int64_t ctx = *std::max_element(step.positions.begin(), step.positions.end()) + 1;
      expect_attention_close(s, step.positions, ctx, ctx + 200,
                             fmt::format("round {} position {} of {} window {}", round, step.positions[0],
                                         step.positions.size(), step.window),
                             2e-3, DType::F16, 4, nullptr, step.window);
      release_buffers();
    }
  }
  ::unsetenv("NIBBLE_ATTN_CLUSTER");
}

// Decode attention's splits as the blocks of one cluster, merged through distributed shared memory
// (CUDA, sm_90 on; NIBBLE_ATTN_CLUSTER forces the cluster size, where every pair's cluster fits
// at once, else the launcher falls back to the merge through L2): one position (all but one block
// empty), a few tiles, contexts to 9,001, a sliding window past the first blocks, several tokens
// of different lengths, GQA groups of 8 and 16 (4 warps a block), gpt-oss's shape with sinks,
// f16 and E4M3 caches. The split merge through L2 runs in AttentionSplitMergeCountAcrossLaunches.
TEST_F(OpsTest, AttentionClusterMerge) {
  struct Case {
    AttentionShape s;
    std::vector<int32_t> positions;
    int64_t window;
    bool sinks;
  };
  const std::vector<Case> cases = {{{32, 4, 128}, {0}, 0, false},       {{32, 4, 128}, {39}, 0, false},
                                   {{32, 4, 128}, {700}, 0, false},     {{32, 4, 128}, {9000}, 0, false},
                                   {{32, 4, 128}, {5000}, 1000, false}, {{32, 4, 128}, {700, 2900, 12}, 0, false},
                                   {{16, 1, 64}, {3000}, 0, false},     {{64, 8, 64}, {2500}, 128, true},
                                   {{64, 8, 64}, {130}, 128, true}};
  for (const char* size : {"8", "16"}) {
    ::setenv("NIBBLE_ATTN_CLUSTER", size, 1);
    for (DType dtype : {DType::F16, DType::F8_E4M3}) {
      for (const Case& c : cases) {
        const int64_t ctx = *std::max_element(c.positions.begin(), c.positions.end()) + 1;
        const std::vector<float> sinks = c.sinks ? random(c.s.n_head) : std::vector<float>{};
        expect_attention_close(c.s, c.positions, ctx, ctx + 100,
                               fmt::format("cluster {} {}/{}x{} position {} of {} window {}", size, c.s.n_head,
                                           c.s.n_head_kv, c.s.head_dim, c.positions[0], c.positions.size(), c.window),
                               2e-3, dtype, 4, c.sinks ? &sinks : nullptr, c.window);
        release_buffers();
      }
    }
  }
  ::unsetenv("NIBBLE_ATTN_CLUSTER");
}

// Several sequences in one step (a server's batch): each sequence owns a row of the block table
// (KvPages::seq_rows, table_stride) over one shared, shuffled pool; tokens of different
// sequences and lengths are interleaved in one call. The KV write lands in each token's own
// sequence, and attention reads only its own sequence's rows (other sequences' rows hold values
// that would change the result). m = 5 takes the decode kernels at once, m = 37 in token chunks
// (the flash kernel serves one sequence per launch).
TEST_F(OpsTest, AttentionSeveralSequences) {
  using Shape = AttentionShape;
  for (DType dtype : {DType::F16, DType::F32, DType::F8_E4M3}) {
    for (Shape s : {Shape{32, 4, 128}, Shape{8, 8, 64}}) {
      for (int64_t m : {5, 37}) {
        const int64_t row = s.n_head_kv * s.head_dim;
        std::vector<int32_t> contexts;  // one sequence per token, lengths 1 .. ~1100
        for (int64_t t = 0; t < m; ++t) contexts.push_back(int32_t(1 + (t * 397 + 13) % 1100));
        Sequences seqs = sequences(contexts, row, dtype);
        PagedKv& kv = seqs.kv;
        const KvPages &host = seqs.host, &dev = seqs.dev;
        const std::vector<int32_t>& positions = seqs.positions;
        const std::string what = fmt::format("{} sequences {}/{}x{} {}", m, s.n_head, s.n_head_kv, s.head_dim,
                                             dtype_name(dtype));
        // The write of each token's new K/V row, then attention over all.
        ModelConfig c;
        c.head_dim = s.head_dim;
        c.rope.theta = 1e6;
        RopeTable rope = make_rope_table(c);
        RopeTable dev_rope{gpu_->upload(rope.inv_freq), rope.attention_factor};
        auto q = random(m * s.n_head * s.head_dim), k = random(m * row), v = random(m * row);
        std::vector<float> want_q = q;
        cpu_->qk_norm_rope_kv_write(want_q.data(), want_q.data(), s.n_head * s.head_dim, k.data(), v.data(), row, {},
                                    {}, 1e-6f, rope, positions.data(), m, s.n_head, s.n_head_kv, s.head_dim, host);
        float* dq = on_gpu(q);
        gpu_->qk_norm_rope_kv_write(dq, dq, s.n_head * s.head_dim, on_gpu(k), on_gpu(v), row, {}, {}, 1e-6f,
                                    dev_rope, on_gpu(positions), m, s.n_head, s.n_head_kv, s.head_dim, dev);
        expect_close(to_host(dq, int64_t(q.size())), want_q, what + " q", kTolerance);
        std::vector<uint8_t> pool(kv.k.size());
        gpu_->copy_to_host(pool.data(), kv.gpu_k, pool.size());
        std::vector<float> got_k, want_k;
        for (int64_t t = 0; t < m; ++t) {
          const int64_t r = seqs.token_row(t);
          for (int64_t i = 0; i < row; ++i) {
            got_k.push_back(kv.at(pool, r, i));
            want_k.push_back(kv.at(kv.k, r, i));
          }
        }
        expect_close(got_k, want_k, what + " k cache",
                     dtype == DType::F32 ? kTolerance : dtype == DType::F16 ? 1e-3 : 0.125);
        std::vector<float> want(q.size());
        const float scale = 1.f / std::sqrt(float(s.head_dim));
        cpu_->attention(want_q.data(), host, m, positions.data(), 1100 + 100, s.n_head, s.n_head_kv, s.head_dim,
                        scale, want.data());
        float* out = poisoned_gpu(int64_t(want.size()));
        gpu_->attention(dq, dev, m, on_gpu(positions), 1100 + 100, s.n_head, s.n_head_kv, s.head_dim, scale, out);
        // Each side attends over the cache it wrote: with E4M3, an element the two sides rounded
        // to neighbouring steps changes the scores a little.
        expect_close(to_host(out, int64_t(want.size())), want, what + " attention",
                     dtype == DType::F8_E4M3 ? 1e-2
                     : dtype == DType::F16 || s.n_head / s.n_head_kv <= 8 ? 2e-3 : kTolerance);
        release_buffers();
      }
    }
  }
}

// The attention prologue fused into decode attention (CUDA: kernels/attention.cuh
// AttentionPrologue) against the CPU's composition of qk_norm_rope_kv_write and attention: q, k
// and v raw in one projection row per token with q/k norms and a YaRN factor, one sequence per
// token (contexts of 1 to ~1100 positions: the new row in the first, a middle and the last of
// several splits), Qwen3's and gpt-oss's head shapes (the latter with sinks and a window), F16
// and E4M3 caches. Both the output and the new K/V rows written to the cache are compared.
TEST_F(OpsTest, QkNormRopeAttentionFused) {
  using Shape = AttentionShape;
  for (DType dtype : {DType::F16, DType::F8_E4M3}) {
    for (Shape s : {Shape{32, 4, 128}, Shape{64, 8, 64}}) {
      const bool gpt_oss = s.head_dim == 64;
      // One token at 700 and at 3,000 positions (on sm_90 both split over a cluster's blocks), five at once.
      for (auto [m, one] : {std::pair<int64_t, int32_t>{1, 700}, {1, 3000}, {5, 0}}) {
        const int64_t row = s.n_head_kv * s.head_dim, nq = s.n_head * s.head_dim, total_row = nq + 2 * row;
        std::vector<int32_t> contexts;
        for (int64_t t = 0; t < m; ++t) contexts.push_back(int32_t(m == 1 ? one : 1 + (t * 397 + 13) % 1100));
        const int64_t max_context = std::max<int64_t>(1200, one + 100);
        Sequences seqs = sequences(contexts, row, dtype);
        PagedKv& kv = seqs.kv;
        const KvPages &host = seqs.host, &dev = seqs.dev;
        const std::vector<int32_t>& positions = seqs.positions;
        ModelConfig c;
        c.head_dim = s.head_dim;
        c.rope.theta = 1e6;
        RopeTable rope = make_rope_table(c);
        rope.attention_factor = 1.25f;  // a YaRN-style factor on cos and sin
        RopeTable dev_rope{gpu_->upload(rope.inv_freq), rope.attention_factor};
        WeightVector qn, kn, dqn, dkn;
        if (!gpt_oss) {  // gpt-oss has no q/k norms
          auto positive = [&](int64_t n) {
            auto w = random(n, 0.5f);
            for (auto& x : w) x += 1.f;
            return w;
          };
          qn = host_vector(positive(s.head_dim)), kn = host_vector(positive(s.head_dim));
          dqn = gpu_->upload(qn), dkn = gpu_->upload(kn);
        }
        std::vector<float> sinks = gpt_oss ? random(s.n_head) : std::vector<float>{};
        const int64_t window = gpt_oss ? 128 : 0;
        const auto qkv = random(m * total_row, 2.f);
        const float scale = 1.f / std::sqrt(float(s.head_dim));
        const std::string what = fmt::format("fused prologue {}/{}x{} m={} context {} {}", s.n_head, s.n_head_kv,
                                             s.head_dim, m, contexts[0], dtype_name(dtype));
        std::vector<float> want(size_t(m * nq)), q_scratch(size_t(m * nq));
        cpu_->qk_norm_rope_attention(qkv.data(), total_row, qkv.data() + nq, qkv.data() + nq + row, total_row, qn, kn,
                                     1e-6f, rope, positions.data(), m, s.n_head, s.n_head_kv, s.head_dim, host, max_context,
                                     scale, q_scratch.data(), want.data(), gpt_oss ? sinks.data() : nullptr, window);
        float* dqkv = on_gpu(qkv);
        float* out = poisoned_gpu(m * nq);
        gpu_->qk_norm_rope_attention(dqkv, total_row, dqkv + nq, dqkv + nq + row, total_row, dqn, dkn, 1e-6f, dev_rope,
                                     on_gpu(positions), m, s.n_head, s.n_head_kv, s.head_dim, dev, max_context, scale,
                                     poisoned_gpu(m * nq), out, gpt_oss ? on_gpu(sinks) : nullptr, window);
        expect_close(to_host(out, m * nq), want, what + " attention", dtype == DType::F8_E4M3 ? 1e-2 : 2e-3);
        for (bool values : {false, true}) {
          std::vector<uint8_t> pool(kv.k.size());
          gpu_->copy_to_host(pool.data(), values ? kv.gpu_v : kv.gpu_k, pool.size());
          std::vector<float> got, expected;
          for (int64_t t = 0; t < m; ++t) {
            const int64_t r = seqs.token_row(t);
            for (int64_t i = 0; i < row; ++i) {
              got.push_back(kv.at(pool, r, i));
              expected.push_back(kv.at(values ? kv.v : kv.k, r, i));
            }
          }
          expect_close(got, expected, what + (values ? " v cache" : " k cache"),
                       dtype == DType::F16 ? 1e-3 : 0.125);
        }
        release_buffers();
      }
    }
  }
}

// Backend::sample against the reference (backend/sampling.h) on the same logits: vocabularies of
// 1,000 and Qwen3's 151,936, peaked and flat rows, every filter alone and together, draws across
// [0, 1). Exact token equality: the GPU sums the kept mass in f64 in another order, which moves a
// prefix by ~1e-16 relative, far from any boundary these random rows put a draw near.
TEST_F(OpsTest, Sample) {
  for (int64_t n : {1000, 151936}) {
    for (float spread : {2.f, 12.f}) {  // nearly flat, and peaked
      auto logits = random(n, spread);
      float* dx = on_gpu(logits);
      for (auto [temperature, top_k, top_p, min_p] :
           {std::tuple<float, int32_t, float, float>{1.f, 0, 1.f, 0.f}, {0.6f, 40, 1.f, 0.f}, {1.f, 0, 0.9f, 0.f},
            {1.2f, 0, 1.f, 0.1f}, {0.8f, 200, 0.7f, 0.02f}, {2.f, 1, 1.f, 0.f}}) {
        for (double u : {0.0, 0.31, 0.77, 0.999}) {
          SampleInputs in;
          in.uniform = u;
          in.temperature = temperature;
          in.top_k = top_k;
          in.top_p = top_p;
          in.min_p = min_p;
          int32_t want = -1, got = -2;
          cpu_->sample(logits.data(), n, &in, &want);
          buffers_.emplace_back(*gpu_, 4);
          int32_t* dout = buffers_.back().data<int32_t>();
          gpu_->sample(dx, n, on_gpu(std::vector<SampleInputs>{in}), dout);
          gpu_->copy_to_host(&got, dout, 4);
          EXPECT_EQ(got, want) << "n " << n << ", spread " << spread << ", T " << temperature << ", top_k " << top_k
                               << ", top_p " << top_p << ", min_p " << min_p << ", u " << u;
          ++cases_;
        }
      }
      release_buffers();
    }
  }
}

// Penalties over several rows of one batch (rows in a shuffled order, one row without tokens,
// prompt-only and output tokens, repetition above and below 1, negative presence): the same bits
// as the reference, and the argmax of the penalised rows the same token.
TEST_F(OpsTest, Penalties) {
  constexpr int64_t n = 151936, rows = 5;
  auto logits = random(rows * n, 8.f);
  std::vector<PenaltyRow> table;
  std::vector<PenaltyToken> tokens;
  std::uniform_int_distribution<int32_t> id(0, int32_t(n - 1)), count(0, 3);
  const Penalties settings[] = {{1.3f, 0.f, 0.f}, {0.8f, 0.5f, 0.25f}, {1.f, -0.4f, 1.5f}, {1.1f, 2.f, -2.f}};
  for (int64_t r : {3, 0, 4, 1}) {
    std::set<int32_t> ids;
    // Each row's most likely token is penalised, so argmax can move.
    if (r != 1) ids.insert(int32_t(std::max_element(logits.begin() + r * n, logits.begin() + (r + 1) * n) -
                                   (logits.begin() + r * n)));
    while (ids.size() < size_t(r == 1 ? 0 : 400 + 700 * r)) ids.insert(id(rng_));
    table.push_back({r, int64_t(tokens.size()), int64_t(ids.size()), settings[table.size()]});
    for (int32_t t : ids) tokens.push_back({t, count(rng_)});
  }
  std::vector<float> want = logits;
  cpu_->apply_penalties(want.data(), n, table.data(), int64_t(table.size()), tokens.data());
  ASSERT_NE(want, logits);
  float* dx = on_gpu(logits);
  gpu_->apply_penalties(dx, n, on_gpu(table), int64_t(table.size()), on_gpu(tokens));
  const std::vector<float> got = to_host(dx, rows * n);
  EXPECT_EQ(got, want) << "the penalised logits differ from the reference";
  std::vector<int32_t> want_ids(rows), got_ids(rows);
  cpu_->argmax(want.data(), rows, n, want_ids.data());
  buffers_.emplace_back(*gpu_, rows * 4);
  gpu_->argmax(dx, rows, n, buffers_.back().data<int32_t>());
  gpu_->copy_to_host(got_ids.data(), buffers_.back().data(), rows * 4);
  EXPECT_EQ(got_ids, want_ids);
  ++cases_;
}

// A greedy decode step's end in one launch (the slices' last block merges and advances the next
// step's inputs): the picks, ids and positions of the reference, for several rows and vocabularies,
// with the maximum tied at two indices (the lower wins) and a row of NaNs (index 0), and three
// calls in a row (the counters are left zeroed for the next).
TEST_F(OpsTest, ArgmaxAdvanceDecode) {
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{1, 201088}, {3, 151936}, {2, 1000}, {4, 37}}) {
    std::vector<int32_t> positions0(static_cast<size_t>(rows));
    for (auto& p : positions0) p = std::uniform_int_distribution<int32_t>(0, 40000)(rng_);
    int32_t* d_ids = nullptr;
    int32_t* d_pos = nullptr;
    int32_t* d_out = nullptr;
    for (auto* ptr : {&d_ids, &d_pos, &d_out}) {
      buffers_.emplace_back(*gpu_, size_t(rows) * 4);
      *ptr = buffers_.back().data<int32_t>();
    }
    gpu_->copy_to_backend(d_pos, positions0.data(), size_t(rows) * 4);
    std::vector<int32_t> want_pos = positions0;
    for (int call = 0; call < 3; ++call) {
      auto logits = random(rows * n, 6.f);
      const int64_t r_tie = call % rows;
      std::uniform_int_distribution<int64_t> at(0, n - 1);
      const int64_t a = at(rng_), b = at(rng_);
      const float top = 100.f + float(call);
      logits[size_t(r_tie * n + a)] = top, logits[size_t(r_tie * n + b)] = top;
      if (rows > 1 && call == 2) {  // a row of NaNs beside the tied one
        const int64_t r_nan = (r_tie + 1) % rows;
        std::fill(logits.begin() + r_nan * n, logits.begin() + (r_nan + 1) * n, std::nanf(""));
      }
      std::vector<int32_t> want_out(static_cast<size_t>(rows)), want_ids(want_out.size());
      cpu_->argmax_advance_decode(logits.data(), rows, n, want_out.data(), want_ids.data(), want_pos.data());
      ASSERT_EQ(want_out[size_t(r_tie)], int32_t(std::min(a, b)));
      gpu_->argmax_advance_decode(on_gpu(logits), rows, n, d_out, d_ids, d_pos);
      std::vector<int32_t> got_out(want_out.size()), got_ids(want_out.size()), got_pos(want_out.size());
      gpu_->copy_to_host(got_out.data(), d_out, size_t(rows) * 4);
      gpu_->copy_to_host(got_ids.data(), d_ids, size_t(rows) * 4);
      gpu_->copy_to_host(got_pos.data(), d_pos, size_t(rows) * 4);
      EXPECT_EQ(got_out, want_out) << "rows " << rows << ", n " << n << ", call " << call;
      EXPECT_EQ(got_ids, want_out) << "rows " << rows << ", n " << n << ", call " << call;
      EXPECT_EQ(got_pos, want_pos) << "rows " << rows << ", n " << n << ", call " << call;
      // The plain argmax takes the same one-launch path and leaves the inputs alone.
      std::vector<int32_t> again(want_out.size());
      gpu_->argmax(on_gpu(logits), rows, n, d_out);
      gpu_->copy_to_host(again.data(), d_out, size_t(rows) * 4);
      EXPECT_EQ(again, want_out);
      ++cases_;
    }
    release_buffers();
  }
}

TEST_F(OpsTest, MoeRoute) {
  for (auto [m, experts, top_k] : {std::tuple<int64_t, int64_t, int64_t>{1, 7, 3}, {13, 128, 8}, {40, 16, 1}}) {
    for (bool normalize : {true, false}) {
      // Distinct logits (a shuffled ramp plus small noise): no near ties to order differently.
      std::vector<float> logits(size_t(m * experts));
      for (int64_t t = 0; t < m; ++t) {
        std::vector<int> order(static_cast<size_t>(experts));
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng_);
        for (int64_t e = 0; e < experts; ++e)
          logits[size_t(t * experts + e)] = 0.05f * float(order[size_t(e)]) + random(1, 0.01f)[0];
      }
      std::vector<int32_t> want_ids(size_t(m * top_k)), got_ids(want_ids.size());
      std::vector<float> want_w(want_ids.size());
      cpu_->moe_route(logits.data(), m, experts, top_k, normalize, want_ids.data(), want_w.data());
      float* w = poisoned_gpu(m * top_k);
      buffers_.emplace_back(*gpu_, got_ids.size() * 4);
      int32_t* ids = buffers_.back().data<int32_t>();
      gpu_->moe_route(on_gpu(logits), m, experts, top_k, normalize, ids, w);
      gpu_->copy_to_host(got_ids.data(), ids, got_ids.size() * 4);
      EXPECT_EQ(got_ids, want_ids);
      expect_close(to_host(w, m * top_k), want_w, fmt::format("moe_route m={} E={} k={}", m, experts, top_k));
    }
  }
}

TEST_F(OpsTest, MoeBlock) {
  // 96/48: shapes only the exact kernels take; 512/256 and 1024/768 (the down projection has three
  // chunks per row, as in Qwen3-30B-A3B): the fused decode path (m <= 8, INT4).
  for (auto [H, inter] : {std::pair<int64_t, int64_t>{96, 48}, {512, 256}, {1024, 768}})
  for (WeightFormat f : {WeightFormat::kBF16, WeightFormat::kInt4}) {
    const int64_t E = 16;
    for (int64_t m : {1, 3, 8, 40}) {
      for (bool skewed : {false, true}) {
        MoeWeights host, dev;
        host.top_k = dev.top_k = 4;
        host.normalize = dev.normalize = true;
        host.router = random_weight(WeightFormat::kBF16, E, H);
        if (skewed) {  // experts 0..3 win for most tokens; the others stay empty
          auto router = random(E * H, 0.01f);
          for (int64_t e = 0; e < 4; ++e)
            for (int64_t i = 0; i < H; ++i) router[size_t(e * H + i)] = 0.5f;
          auto owned = std::make_shared<std::vector<float>>(router);
          host.router = LinearWeight{};
          host.router.name = "router";
          host.router.n = E;
          host.router.k = H;
          host.router.format = WeightFormat::kF32;
          host.router.dense = owned->data();
          host.router.storage.push_back(owned);
        }
        dev.router = gpu_->upload(host.router);
        for (int64_t e = 0; e < E; ++e) {
          host.experts.push_back({random_weight(f, inter, H), random_weight(f, inter, H), random_weight(f, H, inter)});
          const MlpWeights& ex = host.experts.back();
          dev.experts.push_back({gpu_->upload(ex.gate), gpu_->upload(ex.up), gpu_->upload(ex.down)});
        }
        auto x = random(m * H, 2.f);
        if (skewed)
          for (auto& v : x) v = std::fabs(v) + 0.1f;  // positive inputs: the 0.5 rows dominate
        std::vector<float> want(size_t(m * H));
        cpu_->moe(host, x.data(), m, want.data());
        float* out = poisoned_gpu(m * H);
        gpu_->moe(dev, on_gpu(x), m, out);
        // INT4 experts here use 32-wide groups (random_weight's default).
        const bool f16 = f16_path(f, H, 32) || f16_path(f, inter, 32);
        expect_close(to_host(out, m * H), want,
                     fmt::format("moe {} {}x{} m={}{}", weight_format_name(f), H, inter, m, skewed ? " skewed" : ""),
                     f16 ? kF16Tolerance : kTolerance);
      }
    }
  }
}

// The residual-stream fusions (norm in the projection's prologue, add in its store, and both
// around the MoE block) against the CPU's composition of the plain ops. m <= 8 takes the fused
// decode kernels, m = 12 the composed fallback.
TEST_F(OpsTest, FusedResidualOps) {
  for (auto [format, group] : {std::pair<WeightFormat, int64_t>{WeightFormat::kInt4, 128}, {WeightFormat::kInt4, 32},
                               {WeightFormat::kBF16, 0}, {WeightFormat::kF32, 0}})
    // 32 x 3072: a router's few rows (the split-K dense GEMV; at m = 1 its one-pass form, 1 or 2
    // BF16 vectors a thread, 3 F32); 5120 x 2048: Qwen3-30B-A3B's normed q/k/v.
    for (auto [n, k] : {std::pair<int64_t, int64_t>{136, 1024}, {2048, 768}, {520, 2048}, {32, 3072}, {5120, 2048}})
      for (int64_t m : {1, 3, 8, 12}) {
        LinearWeight host = random_weight(format, n, k, group, m == 3);
        LinearWeight dev = gpu_->upload(host);
        const std::string what = fmt::format("{} g{} m={} n={} k={}", weight_format_name(format), group, m, n, k);
        const double tolerance = f16_path(format, k, group) ? kF16Tolerance : kTolerance;
        expect_fused_forms(host, dev, random(m * k, 3.f), m, tolerance, what, /*plain=*/false);
      }

  // The expert kernels route from the router's logits (1, 2, 4 and 16 experts a lane; m = 2
  // without renormalising over the top k). Up to H = 2048 the router stages the normalised rows
  // for gate/up; H = 4096 has gate/up stage them itself. NIBBLE_MOE_ROUTER_ROUTES=1 runs the
  // cluster router (E <= 128) and the last-block counter (E = 512) instead. Also Qwen3-30B-A3B's
  // expert shapes (2048 x 768, top 8, symmetric), a partial group of 1024 k along H (1280), and
  // 32- and 64-wide groups with and without zero points. An INT4 router (--quantize-layers
  // router) takes the INT4 decode GEMV, whose activations are f16: its cases draw x until every
  // token's k-th and (k+1)-th logits are apart by 0.2% of the largest (~10x that rounding's
  // typical effect), so that the CPU and the GPU pick the same experts; 128 experts of 2048 take
  // the GEMV's few-tiles shape and hand gate/up the staged rows.
  for (auto [H, inter, E, top_k, group, symmetric, router_format] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, WeightFormat>{1024, 768, 16, 4, 128, false,
                                                                                  WeightFormat::kBF16},
        {512, 256, 128, 8, 128, false, WeightFormat::kBF16}, {256, 256, 512, 8, 128, false, WeightFormat::kBF16},
        {512, 256, 40, 8, 128, false, WeightFormat::kBF16}, {4096, 256, 64, 6, 128, false, WeightFormat::kBF16},
        {2048, 768, 16, 8, 128, true, WeightFormat::kBF16}, {1280, 768, 24, 8, 32, false, WeightFormat::kBF16},
        {1280, 512, 12, 5, 64, true, WeightFormat::kBF16}, {2048, 768, 128, 8, 128, true, WeightFormat::kInt4},
        {1024, 256, 40, 4, 128, false, WeightFormat::kInt4}})
    for (int64_t m : {1, 2, 8, 12}) {
      MoeWeights host, dev;
      host.top_k = dev.top_k = top_k;
      // Not renormalised over the top k (the softmax's full sum, which down's warp 0 makes): m = 2,
      // and 40 experts at m = 1.
      host.normalize = dev.normalize = m != 2 && !(m == 1 && E == 40);
      host.router = random_weight(router_format, E, H, 128);
      dev.router = gpu_->upload(host.router);
      for (int64_t e = 0; e < E; ++e) {
        host.experts.push_back({random_weight(WeightFormat::kInt4, inter, H, group, false, symmetric),
                                random_weight(WeightFormat::kInt4, inter, H, group, false, symmetric),
                                random_weight(WeightFormat::kInt4, H, inter, group, false, symmetric)});
        const MlpWeights& ex = host.experts.back();
        dev.experts.push_back({gpu_->upload(ex.gate), gpu_->upload(ex.up), gpu_->upload(ex.down)});
      }
      WeightVector norm = host_vector(random(H));
      auto x = random(m * H, 2.f);
      for (int attempt = 0; router_format == WeightFormat::kInt4; ++attempt) {
        ASSERT_LT(attempt, 100) << "no x with separated top-k logits";
        std::vector<float> normed(size_t(m * H)), logits(size_t(m * E));
        cpu_->rms_norm(x.data(), norm, m, H, 1e-6f, normed.data());
        cpu_->linear(host.router, normed.data(), m, logits.data());
        bool apart = true;
        for (int64_t t = 0; t < m; ++t) {
          std::vector<float> row(logits.begin() + t * E, logits.begin() + (t + 1) * E);
          std::sort(row.begin(), row.end(), std::greater<>());
          apart = apart && row[size_t(top_k - 1)] - row[size_t(top_k)] >= 2e-3f * std::max(row[0], -row.back());
        }
        if (apart) break;
        x = random(m * H, 2.f);
      }
      std::vector<float> want = x;
      cpu_->rms_norm_moe_add(norm, 1e-6f, host, m, want.data());
      float* got = on_gpu(x);
      // Twice on the GPU: the fused router's block counter must be back at 0 after each launch.
      for (int rep = 0; rep < 2; ++rep) {
        gpu_->copy_to_backend(got, x.data(), x.size() * 4);
        gpu_->rms_norm_moe_add(gpu_->upload(norm), 1e-6f, dev, m, got);
        // INT4 experts: f16 activations on the tensor cores at every m. With an INT4 router its
        // logits come from f16 activations too, and the routing weights carry their error.
        expect_close(to_host(got, m * H), want,
                     fmt::format("rms_norm_moe_add {}x{} E={} k={} g{}{}{} m={} rep {}", H, inter, E, top_k, group,
                                 symmetric ? " sym" : "",
                                 router_format == WeightFormat::kInt4 ? " int4 router" : "", m, rep),
                     router_format == WeightFormat::kInt4 ? 3 * kF16Tolerance : kF16Tolerance);
      }
    }
}

// The o projection and the MoE block as one op (Backend::linear_add_rms_norm_moe_add): at one
// token the CUDA backend folds the router into the INT4 o GEMV, whose blocks add fixed-point
// shares of the logits and of Σx² that the expert kernels route and normalise from, cleared for
// the next call by the next INT4 GEMV or the next fold (three calls check both). Cases: Qwen3-30B-A3B's shapes
// (o 4096 -> 2048, 128 experts of 768, top 8, BF16 router), 256 experts (two a thread) with an
// F16 router, 512 experts on 8 warps along K without renormalising over the top k, and an o
// projection of 2048 k whose GEMV has two tiles a block (not folded: the composed ops). Two
// tokens take the composed ops too.
TEST_F(OpsTest, RouterFoldedIntoO) {
  struct Case {
    int64_t H, o_k, inter, E, top_k;
    WeightFormat router_format;
    bool normalize, folds;
  };
  for (const Case& c : {Case{2048, 4096, 768, 128, 8, WeightFormat::kBF16, true, true},
                        Case{1024, 4096, 256, 256, 8, WeightFormat::kF16, true, true},
                        Case{512, 5120, 256, 512, 6, WeightFormat::kBF16, false, true},
                        Case{1024, 2048, 256, 40, 4, WeightFormat::kBF16, true, false}})
    for (int64_t m : {1, 2}) {
      MoeWeights host, dev;
      host.top_k = dev.top_k = c.top_k;
      host.normalize = dev.normalize = c.normalize;
      host.router = random_weight(c.router_format, c.E, c.H);
      dev.router = gpu_->upload(host.router);
      for (int64_t e = 0; e < c.E; ++e) {
        host.experts.push_back({random_weight(WeightFormat::kInt4, c.inter, c.H, 128, false, true),
                                random_weight(WeightFormat::kInt4, c.inter, c.H, 128, false, true),
                                random_weight(WeightFormat::kInt4, c.H, c.inter, 128, false, true)});
        const MlpWeights& ex = host.experts.back();
        dev.experts.push_back({gpu_->upload(ex.gate), gpu_->upload(ex.up), gpu_->upload(ex.down)});
      }
      const LinearWeight o_host = random_weight(WeightFormat::kInt4, c.H, c.o_k, 128, false, false);
      const LinearWeight o_dev = gpu_->upload(o_host);
      const WeightVector norm_host = host_vector(random(c.H));
      const WeightVector norm_dev = gpu_->upload(norm_host);
      const std::string what = fmt::format("o {}->{}, {} experts of {}, top {}, {} router{}, m={}", c.o_k, c.H, c.E,
                                           c.inter, c.top_k, weight_format_name(c.router_format),
                                           c.normalize ? "" : ", not renormalised", m);
      for (int call = 0; call < 3; ++call) {
        const auto x = random(m * c.H, 2.f), a = random(m * c.o_k, 1.f);
        std::vector<float> want = x;
        cpu_->linear_add_rms_norm_moe_add(o_host, a.data(), norm_host, 1e-6f, host, m, want.data());
        float* got = on_gpu(x);
#if defined(NIBBLE_HAVE_CUDA)
        const int64_t folds_before = cuda::router_fold_launches();
#endif
        gpu_->linear_add_rms_norm_moe_add(o_dev, on_gpu(a), norm_dev, 1e-6f, dev, m, got);
        expect_close(to_host(got, m * c.H), want, fmt::format("{}, call {}", what, call), kF16Tolerance);
#if defined(NIBBLE_HAVE_CUDA)
        EXPECT_EQ(cuda::router_fold_launches() - folds_before, c.folds && m == 1 ? 1 : 0) << what;
#endif
        // After the first call an INT4 decode GEMV zeroes the sums (as the next layer's q/k/v
        // would); after the second the third call's fold does.
        if (call == 0) gpu_->linear_add(o_dev, on_gpu(random(c.o_k)), 1, on_gpu(random(c.H)));
      }
    }
}

// The one-token INT4 MoE decode kernels at Qwen3-30B-A3B's shapes (hidden 2048, groups of 128,
// 128 experts) sit on an sm_90 SM (where they are tuned) as the decode step's overlap needs
// (kernels/gemv_mma.cuh): gate/up in
// one wave of three blocks an SM (384 blocks on 132 SMs), and a down block resident beside one
// gate/up block: each of the four register quarters of an SM (16 K registers, one a scheduler;
// a warp's registers rounded up to 256, all in one quarter) holds a gate/up warp and two down
// warps. A change that adds registers to either kernel fails here rather than quietly costing a
// second wave or a late down (BENCHMARKS.md).
TEST(DecodeResidency, Int4MoeOneToken) {
#if defined(NIBBLE_HAVE_CUDA)
  const cuda::Int4MoeDecodeResidency r = cuda::int4_moe_decode_residency(2048, 128, 128);
  if (r.compute_capability == 0) GTEST_SKIP() << "no CUDA device";
  if (r.compute_capability != 90) GTEST_SKIP() << "tuned for sm_90; this device is sm_" << r.compute_capability;
  ASSERT_GT(r.gate_up_registers, 0) << "gate/up's attributes";
  ASSERT_GT(r.down_registers, 0) << "down's attributes";
  EXPECT_GE(r.gate_up_blocks_per_sm, 3) << "gate/up: " << r.gate_up_registers << " registers a thread";
  auto warp_registers = [](int registers) { return (registers * 32 + 255) / 256 * 256; };
  const int gate_up_warps = r.gate_up_threads / 32 / 4, down_warps = r.down_threads / 32 / 4;  // a quarter
  EXPECT_EQ(gate_up_warps, 1);
  EXPECT_EQ(down_warps, 2);
  EXPECT_LE(gate_up_warps * warp_registers(r.gate_up_registers) + down_warps * warp_registers(r.down_registers),
            16384)
      << "gate/up " << r.gate_up_registers << " and down " << r.down_registers << " registers a thread";
#else
  GTEST_SKIP() << "a CUDA build";
#endif
}

}  // namespace
}  // namespace nibble
