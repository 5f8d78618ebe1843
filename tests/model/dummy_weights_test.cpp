// --load-format dummy: random weights of the config's exact shapes, generated on the backend. The
// hash-based generator gives every backend the same weights, so the CPU and a GPU must agree on
// the logits of a dummy model as they do on a real one.
#include <gtest/gtest.h>

#include <cmath>

#include "core/status.h"
#include "model/model.h"

namespace nibble {
namespace {

const std::string kTinyMoe = std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-qwen3-moe";

std::vector<float> dummy_logits(Backend& backend, const std::string& quantization) {
  LoadOptions load;
  load.load_format = "dummy";
  load.quantization = quantization;
  load.group_size = 32;
  auto model = load_model(kTinyMoe, backend, load);
  KvCache kv = model->make_kv_cache(8);
  std::vector<int32_t> prompt = {3, 141, 59, 26, 5, 358};
  std::vector<float> logits;
  model->forward(prompt, 0, kv, true, logits);
  return logits;
}

TEST(DummyWeights, LoadAndRunDeterministically) {
  auto cpu = make_cpu_backend();
  for (const char* q : {"", "int4"}) {
    auto a = dummy_logits(*cpu, q), b = dummy_logits(*cpu, q);
    ASSERT_EQ(a, b) << "dummy weights must be reproducible";
    double max_abs = 0;
    for (float v : a) {
      ASSERT_TRUE(std::isfinite(v));
      max_abs = std::max(max_abs, double(std::fabs(v)));
    }
    EXPECT_GT(max_abs, 1e-3) << "dummy weights must not be (near) zero";
  }
  EXPECT_NE(dummy_logits(*cpu, ""), dummy_logits(*cpu, "int4"));
  LoadOptions bad;
  bad.load_format = "dummy";
  bad.quantization = "int3";
  EXPECT_THROW(load_model(kTinyMoe, *cpu, bad), Error);
  bad.load_format = "auto";
  bad.quantization = "int4";
  EXPECT_THROW(load_model(kTinyMoe, *cpu, bad), Error);
}

TEST(DummyWeights, BackendsAgree) {
  std::unique_ptr<Backend> gpu;
  try {
    gpu = make_backend("cuda");
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();
  }
  auto cpu = make_cpu_backend();
  for (const char* q : {"", "int4"}) {
    auto want = dummy_logits(*cpu, q), got = dummy_logits(*gpu, q);
    ASSERT_EQ(want.size(), got.size());
    double diff = 0, ref = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      diff = std::max(diff, double(std::fabs(got[i] - want[i])));
      ref = std::max(ref, double(std::fabs(want[i])));
    }
    EXPECT_LE(diff / ref, 1e-4) << "quantization '" << q << "'";
  }
}

}  // namespace
}  // namespace nibble
