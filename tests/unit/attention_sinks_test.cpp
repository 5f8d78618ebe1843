// The CPU reference attention's gpt-oss options against a direct transcription of transformers'
// eager_attention_forward (modular_gpt_oss.py): scores q·k·scale for every key, the sliding-window
// mask (key j visible from query i when i - window < j <= i), the sink logit concatenated as a last
// column, a softmax over the row and the sink's column dropped. Random inputs, GQA 3:1, queries at
// scattered positions, windows shorter and longer than the context, with and without sinks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "runtime/kv_cache.h"

namespace nibble {
namespace {

std::vector<float> transcribed(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                               const std::vector<int32_t>& positions, const std::vector<float>* sinks,
                               int64_t window, int64_t n_head, int64_t n_kv, int64_t hd, float scale) {
  const int64_t m = int64_t(positions.size()), group = n_head / n_kv;
  std::vector<float> out(size_t(m * n_head * hd), 0.f);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t h = 0; h < n_head; ++h) {
      const int64_t i = positions[size_t(t)], kvh = h / group;
      std::vector<double> logits;  // every key 0..i, masked ones at -inf, then the sink
      for (int64_t j = 0; j <= i; ++j) {
        const bool visible = window == 0 || j > i - window;
        double s = 0;
        for (int64_t d = 0; d < hd; ++d) s += double(q[size_t((t * n_head + h) * hd + d)]) * k[size_t((j * n_kv + kvh) * hd + d)];
        logits.push_back(visible ? s * scale : -INFINITY);
      }
      if (sinks) logits.push_back((*sinks)[size_t(h)]);
      double mx = -INFINITY, sum = 0;
      for (double l : logits) mx = std::max(mx, l);
      for (double& l : logits) sum += l = std::exp(l - mx);
      for (int64_t j = 0; j <= i; ++j)
        for (int64_t d = 0; d < hd; ++d)
          out[size_t((t * n_head + h) * hd + d)] += float(logits[size_t(j)] / sum * v[size_t((j * n_kv + kvh) * hd + d)]);
    }
  return out;
}

TEST(AttentionSinks, CpuMatchesTransformersEagerAttention) {
  const int64_t n_head = 6, n_kv = 2, hd = 24, ctx = 40;
  const float scale = 1.f / std::sqrt(float(hd));
  auto backend = make_cpu_backend();
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto randoms = [&](int64_t n, float std) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& e : x) e = normal(rng) * std;
    return x;
  };
  const std::vector<float> k = randoms(ctx * n_kv * hd, 1.f), v = randoms(ctx * n_kv * hd, 1.f);
  KvCache cache(*backend, 1, ctx, n_kv, hd, DType::F32, 2);
  // Blocks of 4 positions in reverse pool order: the table is followed.
  std::vector<int32_t> table(static_cast<size_t>(cache.n_blocks()));
  for (size_t b = 0; b < table.size(); ++b) table[b] = int32_t(table.size() - 1 - b);
  cache.set_block_table(table);
  const KvPages pages = cache.layer(0);
  for (int64_t p = 0; p < ctx; ++p) {
    const int64_t row = kv_pool_row(table.data(), 2, p);
    std::copy_n(k.data() + p * n_kv * hd, n_kv * hd, static_cast<float*>(pages.k) + row * n_kv * hd);
    std::copy_n(v.data() + p * n_kv * hd, n_kv * hd, static_cast<float*>(pages.v) + row * n_kv * hd);
  }
  const std::vector<int32_t> positions = {0, 1, 4, 5, 6, 17, 38, 39};
  const int64_t m = int64_t(positions.size());
  // Scores of std ~2.5 and sinks of std 2: some rows put most of their weight on the sink.
  const std::vector<float> q = randoms(m * n_head * hd, 2.5f), sinks = randoms(n_head, 2.f);
  for (int64_t window : {int64_t(0), int64_t(1), int64_t(5), int64_t(128)})
    for (bool with_sinks : {false, true}) {
      std::vector<float> got(size_t(m * n_head * hd));
      backend->attention(q.data(), pages, m, positions.data(), ctx, n_head, n_kv, hd, scale, got.data(),
                         with_sinks ? sinks.data() : nullptr, window);
      const auto want = transcribed(q, k, v, positions, with_sinks ? &sinks : nullptr, window, n_head, n_kv, hd, scale);
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-5 * (1 + std::fabs(want[i])))
            << "window " << window << (with_sinks ? " with sinks" : "") << ", element " << i;
    }
  // The options are live: each changes the output of this case.
  std::vector<float> plain(size_t(m * n_head * hd)), windowed(plain.size()), sunk(plain.size());
  backend->attention(q.data(), pages, m, positions.data(), ctx, n_head, n_kv, hd, scale, plain.data());
  backend->attention(q.data(), pages, m, positions.data(), ctx, n_head, n_kv, hd, scale, windowed.data(), nullptr, 5);
  backend->attention(q.data(), pages, m, positions.data(), ctx, n_head, n_kv, hd, scale, sunk.data(), sinks.data());
  EXPECT_NE(plain, windowed);
  EXPECT_NE(plain, sunk);
}

}  // namespace
}  // namespace nibble
