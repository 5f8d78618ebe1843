// The fixture every GPU-vs-CPU op test shares: a CUDA backend (the test is skipped without one)
// and the CPU reference, fresh random inputs, device copies kept alive for the test, outputs
// poisoned with NaN first (an element a kernel forgets to write fails), and one error measure:
// max |gpu - cpu| / max |cpu| over the output, against a tolerance each test states and derives.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/fp8.h"
#include "core/status.h"

#include <fmt/format.h>

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

  // A paged KV cache held on the host (the CPU backend's view) and copied to the GPU: pools of
  // n_blocks · 2^log2 rows of `row` elements, logical block b at pool block table[b], the table a
  // random permutation, so a kernel that ignores it reads the wrong rows. Rows no position maps to
  // hold NaN: a kernel that reads past the context fails.
  struct PagedKv {
    DType dtype;
    int log2;
    int64_t row;
    std::vector<int32_t> table;
    std::vector<uint8_t> k, v;
    int32_t* gpu_table = nullptr;
    uint8_t *gpu_k = nullptr, *gpu_v = nullptr;
    KvPages host() { return {k.data(), v.data(), dtype, table.data(), log2}; }
    KvPages gpu() { return {gpu_k, gpu_v, dtype, gpu_table, log2}; }
    int64_t pool_row(int64_t p) const { return kv_pool_row(table.data(), log2, p); }
    // Element i of pool row r as f32.
    float at(const std::vector<uint8_t>& pool, int64_t r, int64_t i) const {
      const size_t e = size_t(r * row + i);
      if (dtype == DType::F32) return reinterpret_cast<const float*>(pool.data())[e];
      if (dtype == DType::F8_E4M3) return e4m3_to_f32(pool[e]);
      return f16_to_f32(reinterpret_cast<const uint16_t*>(pool.data())[e]);
    }
  };
  PagedKv paged_kv(int64_t ctx, int64_t row, DType dtype, int log2) {
    PagedKv kv;
    kv.dtype = dtype;
    kv.log2 = log2;
    kv.row = row;
    const int64_t block = int64_t(1) << log2, n_blocks = std::max<int64_t>(1, (ctx + block - 1) / block);
    kv.table.resize(size_t(n_blocks));
    std::iota(kv.table.begin(), kv.table.end(), 0);
    std::shuffle(kv.table.begin(), kv.table.end(), rng_);
    const size_t elements = size_t(n_blocks * block * row), size = dtype_size_bytes(dtype);
    kv.k.resize(elements * size);
    kv.v.resize(elements * size);
    for (auto* pool : {&kv.k, &kv.v}) {
      if (dtype == DType::F32)
        std::fill_n(reinterpret_cast<float*>(pool->data()), elements, std::numeric_limits<float>::quiet_NaN());
      else if (dtype == DType::F8_E4M3)
        std::fill_n(pool->data(), elements, uint8_t(0x7f));  // E4M3 NaN
      else
        std::fill_n(reinterpret_cast<uint16_t*>(pool->data()), elements, uint16_t(0x7e00));  // f16 NaN
    }
    return kv;
  }
  // Fills positions 0..ctx-1 with random values (exactly representable in the pool's type).
  void fill_random(PagedKv& kv, int64_t ctx) {
    for (auto* pool : {&kv.k, &kv.v}) {
      const auto x = random(ctx * kv.row);
      for (int64_t p = 0; p < ctx; ++p)
        for (int64_t i = 0; i < kv.row; ++i) {
          const size_t e = size_t(kv.pool_row(p) * kv.row + i);
          if (kv.dtype == DType::F32)
            reinterpret_cast<float*>(pool->data())[e] = x[size_t(p * kv.row + i)];
          else if (kv.dtype == DType::F8_E4M3)
            (*pool)[e] = f32_to_e4m3(x[size_t(p * kv.row + i)]);
          else
            reinterpret_cast<uint16_t*>(pool->data())[e] = f32_to_f16(x[size_t(p * kv.row + i)]);
        }
    }
  }
  void upload(PagedKv& kv) {
    kv.gpu_table = on_gpu(kv.table);
    kv.gpu_k = on_gpu(kv.k);
    kv.gpu_v = on_gpu(kv.v);
  }
  // One sequence per token over one shared, shuffled pool of blocks of 16 (random values
  // everywhere): token m - 1 - t is sequence t, whose table row holds its blocks, at the last
  // position of its context contexts[t]; `host` and `dev` view the pool with those tables.
  struct Sequences {
    PagedKv kv;
    std::vector<int32_t> tables, seq_rows, positions;
    int64_t stride = 0;
    KvPages host, dev;
    // The pool row of token t's own position.
    int64_t token_row(int64_t t) const {
      return kv_pool_row(tables.data() + int64_t(seq_rows[size_t(t)]) * stride, 4, positions[size_t(t)]);
    }
  };
  Sequences sequences(const std::vector<int32_t>& contexts, int64_t row, DType dtype) {
    constexpr int64_t block = 16;
    const int64_t m = int64_t(contexts.size());
    Sequences s;
    int64_t total = 0;
    for (int32_t c : contexts) {
      s.stride = std::max<int64_t>(s.stride, (c + block - 1) / block);
      total += (c + block - 1) / block;
    }
    s.kv = paged_kv(total * block, row, dtype, 4);  // its table: a shuffled permutation
    s.tables.assign(size_t(m * s.stride), 0);
    s.seq_rows.resize(size_t(m));
    s.positions.resize(size_t(m));
    int64_t used = 0;
    for (int64_t t = 0; t < m; ++t) {
      const int64_t n = (contexts[size_t(t)] + block - 1) / block;
      for (int64_t b = 0; b < n; ++b) s.tables[size_t(t * s.stride + b)] = s.kv.table[size_t(used++)];
      s.seq_rows[size_t(m - 1 - t)] = int32_t(t);  // rows in the reverse of token order
      s.positions[size_t(m - 1 - t)] = contexts[size_t(t)] - 1;
    }
    fill_random(s.kv, total * block);  // every pool row holds values: none may be read by another sequence
    upload(s.kv);
    s.host = s.kv.host(), s.dev = s.kv.gpu();
    s.host.block_table = s.tables.data();
    s.host.seq_rows = s.seq_rows.data();
    s.host.table_stride = s.dev.table_stride = s.stride;
    s.dev.block_table = on_gpu(s.tables);
    s.dev.seq_rows = on_gpu(s.seq_rows);
    return s;
  }

  // The GPU pools back on the host, as f32 for positions 0..ctx-1 (logical order) of K then V.
  std::vector<float> gpu_positions(const PagedKv& kv, int64_t ctx, bool values) {
    std::vector<uint8_t> pool((values ? kv.v : kv.k).size());
    gpu_->copy_to_host(pool.data(), values ? kv.gpu_v : kv.gpu_k, pool.size());
    std::vector<float> out(size_t(ctx * kv.row));
    for (int64_t p = 0; p < ctx; ++p)
      for (int64_t i = 0; i < kv.row; ++i) out[size_t(p * kv.row + i)] = kv.at(pool, kv.pool_row(p), i);
    return out;
  }
  std::vector<float> host_positions(const PagedKv& kv, int64_t ctx, bool values) {
    std::vector<float> out(size_t(ctx * kv.row));
    for (int64_t p = 0; p < ctx; ++p)
      for (int64_t i = 0; i < kv.row; ++i) out[size_t(p * kv.row + i)] = kv.at(values ? kv.v : kv.k, kv.pool_row(p), i);
    return out;
  }

  // Backend::attention on both backends: random q [m, n_head, head_dim] and a paged K/V cache
  // (shuffled block table, blocks of 2^block_log2 positions) holding exactly ctx positions, query
  // token t at positions[t] (m = positions.size()), the context bound max_context (a recorded
  // decode step passes one above the real context); the outputs compared at `tolerance`. sinks
  // (one per q head) and window: gpt-oss's options, as Backend::attention takes them.
  struct AttentionShape {
    int64_t n_head, n_head_kv, head_dim;
  };
  void expect_attention_close(AttentionShape s, const std::vector<int32_t>& positions, int64_t ctx,
                              int64_t max_context, const std::string& what, double tolerance,
                              DType kv_dtype = DType::F16, int block_log2 = 4,
                              const std::vector<float>* sinks = nullptr, int64_t window = 0) {
    const int64_t m = int64_t(positions.size()), row = s.n_head_kv * s.head_dim;
    auto q = random(m * s.n_head * s.head_dim);
    PagedKv kv = paged_kv(ctx, row, kv_dtype, block_log2);
    fill_random(kv, ctx);
    upload(kv);
    const float scale = 1.f / std::sqrt(float(s.head_dim));
    std::vector<float> want(size_t(m * s.n_head * s.head_dim));
    cpu_->attention(q.data(), kv.host(), m, positions.data(), max_context, s.n_head, s.n_head_kv, s.head_dim, scale,
                    want.data(), sinks ? sinks->data() : nullptr, window);
    float* out = poisoned_gpu(int64_t(want.size()));
    gpu_->attention(on_gpu(q), kv.gpu(), m, on_gpu(positions), max_context, s.n_head, s.n_head_kv, s.head_dim,
                    scale, out, sinks ? on_gpu(*sinks) : nullptr, window);
    expect_close(to_host(out, int64_t(want.size())), want,
                 what + fmt::format(" {} KV block {}", dtype_name(kv_dtype), 1 << block_log2),
                 tolerance);
  }

  int cases_ = 0;
  std::mt19937 rng_;
  std::unique_ptr<Backend> gpu_, cpu_;
  std::vector<Buffer> buffers_;
};

}  // namespace nibble
