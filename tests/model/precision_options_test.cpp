// The options that trade accuracy for bytes, and what each costs against the same model without
// it on the same backend, over real code text (the bundled model's fixture prompt and greedy
// continuation, every position's logits):
//   --quantize-layers (LoadOptions::quantize_layers): 16-bit layers quantized to INT4 at load;
//   --kv-cache-dtype fp8 (LoadOptions::kv_cache_dtype F8_E4M3) against the f16 cache.
// Models:
//   - the bundled model (trained weights; its lm_head is tied to the embedding table, so the
//     4-bit lm_head is a copy of the table while the lookup keeps the 16-bit one);
//   - tests/fixtures/models/tiny-qwen3-moe (random weights, a separate lm_head).
// The figures are printed (BENCHMARKS.md records them); the bounds are ceilings ~1.5x above what
// round-to-nearest 4 bits gives on the CPU, which a broken quantizer (or a layer left unquantized:
// error 0) does not meet. The bundled model is small (hidden 256: two groups of 128 per row), so
// its errors overstate a 2048-wide model's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "core/status.h"
#include "format/safetensors.h"
#include "model/model.h"
#include "reference_outputs.h"

namespace nibble {
namespace {

struct Accuracy {
  double relative_error = 0;  // max |quantized - base| / max |base| over every position's logits
  double top1_agreement = 0;  // fraction of positions whose argmax is the same
  double mean_kl = 0;         // mean KL(base || quantized) of the next-token distributions, nats
  int64_t bytes_per_token = 0;
};

std::vector<float> all_logits(Model& model, const std::vector<int32_t>& prompt) {
  KvCache kv = model.make_kv_cache(int64_t(prompt.size()));
  std::vector<float> logits;
  model.forward(prompt, 0, kv, true, logits);
  model.release_graphs(kv);
  return logits;
}

class PrecisionOptionsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    try {
      backend_ = make_backend(GetParam());
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();
    }
    auto f = SafetensorsFile::open(std::string(NIBBLE_FIXTURES_DIR) + "/models/nibble-tiny-coder/bf16.safetensors");
    // The prompt and transformers' greedy continuation: real code text, teacher-forced.
    prompt_ = test::read_tensor<int32_t>(*f, "prompt_ids");
    for (int32_t id : test::read_tensor<int32_t>(*f, "greedy_ids")) prompt_.push_back(id);
  }

  Accuracy measure(const std::string& dir, const LoadOptions& load, const std::vector<int32_t>& prompt) {
    auto base_model = load_model(dir, *backend_);
    const std::vector<float> base = all_logits(*base_model, prompt);
    auto model = load_model(dir, *backend_, load);
    const std::vector<float> got = all_logits(*model, prompt);
    const int64_t vocab = model->config().vocab_size, n = int64_t(prompt.size());
    Accuracy a;
    double diff = 0, ref = 0;
    for (size_t i = 0; i < base.size(); ++i) {
      diff = std::max(diff, double(std::fabs(got[i] - base[i])));
      ref = std::max(ref, double(std::fabs(base[i])));
    }
    a.relative_error = diff / ref;
    int64_t same = 0;
    for (int64_t t = 0; t < n; ++t) {
      auto row = [&](const std::vector<float>& l) { return l.begin() + t * vocab; };
      same += std::max_element(row(base), row(base) + vocab) - row(base) ==
              std::max_element(row(got), row(got) + vocab) - row(got);
      auto log_z = [&](const std::vector<float>& l) {
        const double mx = *std::max_element(row(l), row(l) + vocab);
        double sum = 0;
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row(l)[v]) - mx);
        return mx + std::log(sum);
      };
      const double zb = log_z(base), zq = log_z(got);
      for (int64_t v = 0; v < vocab; ++v) {
        const double lp = double(row(base)[v]) - zb, lq = double(row(got)[v]) - zq;
        a.mean_kl += std::exp(lp) * (lp - lq) / double(n);
      }
    }
    a.top1_agreement = double(same) / double(n);
    a.bytes_per_token = model->weight_bytes_per_token() + model->kv_bytes_per_context_token();
    EXPECT_LT(a.bytes_per_token, base_model->weight_bytes_per_token() + base_model->kv_bytes_per_context_token())
        << "nothing was made smaller";
    return a;
  }
  std::unique_ptr<Backend> backend_;
  std::vector<int32_t> prompt_;
};

TEST_P(PrecisionOptionsTest, QuantizeLayersAgainstSixteenBitLayers) {
  struct Case {
    std::string model;
    std::vector<std::string> layers;
    double max_error;      // relative logit error ceiling
    double max_kl;         // mean KL ceiling, nats
    double min_agreement;  // top-1 agreement floor
  };
  const std::string bundled = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
  const std::string tiny = std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-qwen3-moe";
  const std::string bundled_int4 = bundled + "-int4";  // INT4 experts: on the GPU the fused MoE decode
  const Case cases[] = {
      {bundled, {"lm_head"}, 0.12, 0.03, 0.95},
      {bundled, {"qkv", "o"}, 0.4, 0.15, 0.85},
      {bundled, {"lm_head", "qkv", "o"}, 0.4, 0.2, 0.85},
      // The router: 4-bit logits can swap experts near a tie (the expert kernels are exact).
      {bundled, {"router"}, 0.15, 0.012, 0.95},
      {bundled_int4, {"router"}, 0.2, 0.006, 0.9},
      {bundled, {"lm_head", "router"}, 0.18, 0.04, 0.9},
      // Random weights: near-flat distributions whose argmax a small error moves; the lm_head
      // alone, for the untied path.
      {tiny, {"lm_head"}, 0.2, 0.03, 0.7},
  };
  for (const Case& c : cases) {
    std::string layers;
    for (auto& l : c.layers) layers += (layers.empty() ? "" : ",") + l;
    // The random fixture's vocabulary is 400: its prompt is the bundled prompt's ids modulo 400.
    std::vector<int32_t> prompt = prompt_;
    if (c.model == tiny)
      for (auto& id : prompt) id %= 400;
    LoadOptions load;
    load.quantize_layers = c.layers;
    const Accuracy a = measure(c.model, load, prompt);
    const std::string what = fmt::format("{} --quantize-layers {} on {}", c.model.substr(c.model.rfind('/') + 1),
                                         layers, GetParam());
    std::cout << "  " << what << ": max relative logit error " << a.relative_error << ", mean KL " << a.mean_kl
              << " nats, top-1 agreement " << a.top1_agreement * 100 << "% of " << prompt.size() << " positions, "
              << a.bytes_per_token << " bytes per token (weights + one position of KV)\n";
    EXPECT_GT(a.relative_error, 0) << what << ": the logits did not change";
    EXPECT_LE(a.relative_error, c.max_error) << what;
    EXPECT_LE(a.mean_kl, c.max_kl) << what;
    EXPECT_GE(a.top1_agreement, c.min_agreement) << what;
  }
}

// The prompt is short (40 positions), so decode attention reads few rows: the error is that of the
// rounded K and V themselves (3 mantissa bits, no scale) on every layer.
TEST_P(PrecisionOptionsTest, Fp8KvCacheAgainstF16) {
  struct Case {
    std::string model;
    double max_error, max_kl, min_agreement;
  };
  const Case cases[] = {{std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder", 0.15, 0.03, 0.95},
                        {std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-qwen3-moe", 0.3, 0.03, 0.7}};
  for (const Case& c : cases) {
    std::vector<int32_t> prompt = prompt_;
    if (c.model.ends_with("tiny-qwen3-moe"))
      for (auto& id : prompt) id %= 400;
    LoadOptions load;
    load.kv_cache_dtype = DType::F8_E4M3;
    const Accuracy a = measure(c.model, load, prompt);
    const std::string what =
        fmt::format("{} --kv-cache-dtype fp8 on {}", c.model.substr(c.model.rfind('/') + 1), GetParam());
    std::cout << "  " << what << ": max relative logit error " << a.relative_error << ", mean KL " << a.mean_kl
              << " nats, top-1 agreement " << a.top1_agreement * 100 << "% of " << prompt.size() << " positions\n";
    EXPECT_GT(a.relative_error, 0) << what << ": the logits did not change";
    EXPECT_LE(a.relative_error, c.max_error) << what;
    EXPECT_LE(a.mean_kl, c.max_kl) << what;
    EXPECT_GE(a.top1_agreement, c.min_agreement) << what;
  }
}

TEST(QuantizeLayers, BadListsAreRefused) {
  EXPECT_TRUE(parse_quantize_layers("").empty());
  EXPECT_EQ(parse_quantize_layers("lm_head,qkv,o,router"), (std::vector<std::string>{"lm_head", "qkv", "o", "router"}));
  auto message = [](const std::string& list) {
    try {
      parse_quantize_layers(list);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("lm_head,mlp").find("unknown layer 'mlp'"), std::string::npos) << message("lm_head,mlp");
  EXPECT_NE(message("lm_head,").find("unknown layer ''"), std::string::npos) << message("lm_head,");
  EXPECT_NE(message("experts").find("unknown layer 'experts'"), std::string::npos) << message("experts");
}

INSTANTIATE_TEST_SUITE_P(Backends, PrecisionOptionsTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace nibble
