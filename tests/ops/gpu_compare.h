// The fixture every GPU-vs-CPU op test shares: a CUDA backend (the test is skipped without one)
// and the CPU reference, fresh random inputs, device copies kept alive for the test, outputs
// poisoned with NaN first (an element a kernel forgets to write fails), and one error measure:
// max |gpu - cpu| / max |cpu| over the output, against a tolerance each test states and derives.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"

namespace nibble {

class GpuCompareTest : public ::testing::Test {
 protected:
  explicit GpuCompareTest(uint32_t seed) : rng_(seed) {}

  void SetUp() override {
    try {
      gpu_ = make_backend("cuda");
    } catch (const Error& e) {
      GTEST_SKIP() << "no CUDA backend here: " << e.what();
    }
    cpu_ = make_cpu_backend();
  }
  // A test that ran on a GPU must have compared something.
  void TearDown() override {
    if (gpu_) {
      EXPECT_GT(cases_, 0) << "no case was compared";
    }
  }

  std::vector<float> random(int64_t n, float scale = 1.f) {
    std::uniform_real_distribution<float> d(-scale, scale);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng_);
    return v;
  }

  // Device copy of host data, kept alive until release_buffers() or the end of the test.
  template <typename T>
  T* on_gpu(const std::vector<T>& host) {
    buffers_.emplace_back(*gpu_, host.size() * sizeof(T));
    gpu_->copy_to_backend(buffers_.back().data(), host.data(), host.size() * sizeof(T));
    return buffers_.back().template data<T>();
  }
  float* poisoned_gpu(int64_t n) {
    return on_gpu(std::vector<float>(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN()));
  }
  std::vector<float> to_host(const float* dev, int64_t n) {
    std::vector<float> out(static_cast<size_t>(n));
    gpu_->copy_to_host(out.data(), dev, out.size() * sizeof(float));
    return out;
  }
  void release_buffers() { buffers_.clear(); }

  void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what,
                    double tolerance) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double diff = 0, ref = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << what << ": element " << i << " is " << got[i];
      diff = std::max(diff, double(std::fabs(got[i] - want[i])));
      ref = std::max(ref, double(std::fabs(want[i])));
    }
    ASSERT_GT(ref, 0) << what << ": the reference is all zeros";
    EXPECT_LE(diff / ref, tolerance) << what;
    ++cases_;
  }

  // Backend::attention on both backends: random q [m, n_head, head_dim] and K/V caches of exactly
  // ctx rows, query token t at positions[t] (m = positions.size()), the context bound max_context
  // (a recorded decode step passes one above the real context); the outputs compared at `tolerance`.
  struct AttentionShape {
    int64_t n_head, n_head_kv, head_dim;
  };
  void expect_attention_close(AttentionShape s, const std::vector<int32_t>& positions, int64_t ctx,
                              int64_t max_context, const std::string& what, double tolerance) {
    const int64_t m = int64_t(positions.size()), row = s.n_head_kv * s.head_dim;
    auto q = random(m * s.n_head * s.head_dim), k = random(ctx * row), v = random(ctx * row);
    const float scale = 1.f / std::sqrt(float(s.head_dim));
    std::vector<float> want(size_t(m * s.n_head * s.head_dim));
    cpu_->attention(q.data(), k.data(), v.data(), m, positions.data(), max_context, s.n_head, s.n_head_kv,
                    s.head_dim, scale, want.data());
    float* out = poisoned_gpu(int64_t(want.size()));
    gpu_->attention(on_gpu(q), on_gpu(k), on_gpu(v), m, on_gpu(positions), max_context, s.n_head, s.n_head_kv,
                    s.head_dim, scale, out);
    expect_close(to_host(out, int64_t(want.size())), want, what, tolerance);
  }

  int cases_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<Backend> gpu_, cpu_;
  std::vector<Buffer> buffers_;
};

}  // namespace nibble
