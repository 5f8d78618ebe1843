// The bundled model (models/nibble-tiny-coder, BF16, and its `nibble quantize` GPTQ INT4 variant
// models/nibble-tiny-coder-int4) against Hugging Face transformers, on real code text rather than
// the random checkpoints of fixture_test.cpp: the prompt's text (safetensors metadata "prompt")
// must tokenize to transformers' prompt_ids, the float32 logits of every prompt position must
// match, and generate() must reproduce transformers' greedy continuation.
// tests/fixtures/models/nibble-tiny-coder/{bf16,int4}.safetensors come from
// `tools/make_fixtures.py bundled` (the INT4 reference runs the dequantized weights in float32).
//
// Tolerances are fixture_test.cpp's: max |ours - theirs| / max |theirs| <= 1e-4 with an f32 KV
// cache (both sides compute in f32 on the same weights, so more is a bug, not rounding) and 2e-3
// with the f16 cache (every cached K and V rounded by up to 2^-11 relative). The CUDA backend's
// INT4 kernels round activations and dequantised weights to f16 too (W4A16: kernels/gemv_mma.cuh),
// so the INT4 variant on CUDA is held to the 16-bit tolerance with either cache (4e-4 measured on
// an H100, against 8e-7 for BF16 weights with an f32 cache).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

#include "core/status.h"
#include "format/hf_config.h"
#include "format/safetensors.h"
#include "model/model.h"
#include "reference_outputs.h"
#include "runtime/generate.h"

namespace nibble {
namespace {

constexpr double kTolerance = 1e-4, kF16Tolerance = 2e-3;

struct Expected {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> logits;  // [prompt, vocab]
  std::string text, margin;   // the prompt's text; transformers' smallest top-2 greedy margin
};

Expected load_expected(const std::string& path) {
  auto f = SafetensorsFile::open(path);
  for (const char* key : {"prompt", "min_relative_margin"})
    NIBBLE_CHECK(f->metadata().count(key), "{}: no __metadata__ key '{}'", path, key);
  return {test::read_tensor<int32_t>(*f, "prompt_ids"), test::read_tensor<int32_t>(*f, "greedy_ids"),
          test::read_tensor<float>(*f, "logits"), f->metadata().at("prompt"), f->metadata().at("min_relative_margin")};
}

// (variant, device). A missing model or fixture fails: both are committed with this test.
class BundledModelTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {
 protected:
  void SetUp() override {
    try {
      backend_ = make_backend(std::get<1>(GetParam()));
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();
    }
    ASSERT_TRUE(std::filesystem::exists(model_dir() + "/config.json"))
        << model_dir() << "/config.json is missing (the INT4 variant is written by `nibble quantize`)";
    ASSERT_TRUE(std::filesystem::exists(expected_path()))
        << expected_path() << " is missing (written by `tools/make_fixtures.py bundled`)";
    want_ = load_expected(expected_path());
  }
  std::string variant() const { return std::get<0>(GetParam()); }
  std::string name() const { return variant() + " on " + std::get<1>(GetParam()); }
  std::string model_dir() const {
    return std::string(NIBBLE_MODELS_DIR) + (variant() == "bf16" ? "/nibble-tiny-coder" : "/nibble-tiny-coder-int4");
  }
  std::string expected_path() const {
    return std::string(NIBBLE_FIXTURES_DIR) + "/models/nibble-tiny-coder/" + variant() + ".safetensors";
  }
  std::unique_ptr<Backend> backend_;
  Expected want_;
};

TEST_P(BundledModelTest, PromptTokenizesLikeTransformers) {
  Tokenizer tok = Tokenizer::from_file(model_dir() + "/tokenizer.json");
  EXPECT_EQ(tok.encode(want_.text), want_.prompt) << name() << ": prompt \"" << want_.text << "\"";
}

TEST_P(BundledModelTest, LogitsMatchTransformers) {
  auto model = load_model(model_dir(), *backend_);
  ASSERT_EQ(want_.logits.size(), want_.prompt.size() * size_t(model->config().vocab_size));
  for (DType dtype : {DType::F32, DType::F16}) {
    const std::string what = name() + ", " + std::string(dtype_name(dtype)) + " KV cache";
    model->set_kv_dtype(dtype);
    KvCache kv = model->make_kv_cache(int64_t(want_.prompt.size()));
    std::vector<float> logits;
    model->forward(want_.prompt, 0, kv, true, logits);
    ASSERT_EQ(logits.size(), want_.logits.size());
    const double err = test::normalized_error(logits.data(), want_.logits.data(), logits.size());
    const bool f16_math = dtype == DType::F16 || (variant() == "int4" && backend_->name() == "cuda");
    EXPECT_LE(err, f16_math ? kF16Tolerance : kTolerance) << what << ": all-position logits";
    std::cout << what << ": max relative logit error " << err << "\n";
  }
}

TEST_P(BundledModelTest, GreedyMatchesTransformers) {
  auto model = load_model(model_dir(), *backend_);
  Tokenizer tok = Tokenizer::from_file(model_dir() + "/tokenizer.json");
  GenerateRequest req;
  req.prompt = want_.prompt;
  req.max_new_tokens = int64_t(want_.greedy.size());
  req.max_context = 256;
  req.sampling.temperature = 0;
  // The model's EOS ids, as `nibble run` uses them. transformers' reference ran all the steps
  // without stopping; generate() ends after emitting the first EOS.
  req.stop_ids = eos_token_ids(load_generation_config(model_dir()), model->config());
  auto eos = std::find_first_of(want_.greedy.begin(), want_.greedy.end(), req.stop_ids.begin(), req.stop_ids.end());
  const std::vector<int32_t> expected(want_.greedy.begin(), eos == want_.greedy.end() ? eos : eos + 1);
  GenerateResult r = generate(*model, tok, req, [](const GeneratedToken&, std::string_view) {});
  // The decode steps recorded for the request's cache went with it (a server makes one per request).
  EXPECT_EQ(backend_->graph_count(), 0u) << name();
  EXPECT_EQ(r.ids, expected) << name() << ": \"" << want_.text << "\" -> \"" << r.text
                             << "\"; transformers' smallest relative top-2 margin " << want_.margin;
  EXPECT_EQ(r.finish_reason, eos == want_.greedy.end() ? "length" : "stop");
}

INSTANTIATE_TEST_SUITE_P(Bundled, BundledModelTest,
                         ::testing::Combine(::testing::Values("bf16", "int4"), ::testing::Values("cpu", "cuda")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

}  // namespace
}  // namespace nibble
