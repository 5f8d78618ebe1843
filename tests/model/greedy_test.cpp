// Greedy sampling on the device (Model::forward_greedy, Backend::argmax) picks what the host
// argmax of the same step's logits picks, on the CPU and (when present) the GPU, eager and
// recorded; and the argmax op itself against the CPU reference, ties included.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "core/status.h"
#include "model/model.h"

namespace nibble {
namespace {

const std::string kTinyMoe = std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-qwen3-moe";

class GreedyTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    try {
      backend_ = make_backend(GetParam());
    } catch (const Error& e) {
      GTEST_SKIP() << GetParam() << " backend unavailable: " << e.what();
    }
  }
  std::unique_ptr<Backend> backend_;
};

TEST_P(GreedyTest, DeviceArgmaxMatchesHostArgmax) {
  auto model = load_model(kTinyMoe, *backend_, LoadOptions{});
  const std::vector<int32_t> prompt = {11, 300, 7, 93, 5, 250, 3, 17, 64, 2};  // vocabulary 400
  KvCache kv_logits = model->make_kv_cache(64), kv_greedy = model->make_kv_cache(64);
  std::vector<float> logits;
  model->forward(prompt, 0, kv_logits, false, logits);
  int32_t want = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  int32_t got = model->forward_greedy(prompt, 0, kv_greedy);
  ASSERT_EQ(got, want) << "prefill";
  for (int64_t step = 0; step < 12; ++step) {  // decode steps: recorded graphs on the GPU
    const int64_t pos = int64_t(prompt.size()) + step;
    model->forward({&want, 1}, pos, kv_logits, false, logits);
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    got = model->forward_greedy({&got, 1}, pos, kv_greedy);
    ASSERT_EQ(got, next) << "decode step " << step;
    want = next;
  }
}

TEST_P(GreedyTest, ArgmaxOpTiesAndRows) {
  auto cpu = make_cpu_backend();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-5.f, 5.f);
  for (int64_t n : {1, 63, 1000, 151936}) {  // 63: fewer elements than the GPU kernel's 64 slices
    const int64_t rows = 3;
    std::vector<float> x(size_t(rows * n));
    for (auto& v : x) v = d(rng);
    if (n > 10) {  // row 1: the maximum twice, the lower index must win
      x[size_t(n + n / 2)] = 9.f;
      x[size_t(n + n / 3)] = 9.f;
    }
    std::vector<int32_t> want(static_cast<size_t>(rows)), got(static_cast<size_t>(rows));
    cpu->argmax(x.data(), rows, n, want.data());
    Buffer dx(*backend_, x.size() * 4), dout(*backend_, size_t(rows) * 4);
    backend_->copy_to_backend(dx.data(), x.data(), x.size() * 4);
    backend_->argmax(dx.data(), rows, n, dout.data<int32_t>());
    backend_->copy_to_host(got.data(), dout.data(), got.size() * 4);
    EXPECT_EQ(got, want) << "n=" << n;
    if (n > 10) {
      EXPECT_EQ(want[1], int32_t(n / 3));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, GreedyTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace nibble
