// The generation loop: EOS ids, stop strings (never shown, even split across tokens), limits, and
// that the streamed pieces add up to the final text.
#include "runtime/generate.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/status.h"

namespace nibble {
namespace {

class GenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-qwen3-moe";
    backend_ = make_cpu_backend();
    model_ = load_model(dir, *backend_);
    tok_ = std::make_unique<Tokenizer>(Tokenizer::from_file(dir + "/tokenizer.json"));
  }
  GenerateResult gen(GenerateRequest req, std::string* streamed = nullptr) {
    if (req.prompt.empty()) req.prompt = tok_->encode("def main():\n    return");
    if (req.max_context == 0) req.max_context = 256;
    std::string s;
    auto r = generate(*model_, *tok_, req, [&](const GeneratedToken&, std::string_view t) { s += t; });
    EXPECT_EQ(s, r.text) << "streamed pieces must add up to the text";
    if (streamed) *streamed = s;
    return r;
  }
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(GenerateTest, StopStringEndsGenerationAndIsNeverShown) {
  GenerateRequest req;
  req.max_new_tokens = 40;
  req.sampling.temperature = 0;
  GenerateResult full = gen(req);
  ASSERT_EQ(full.finish_reason, "length");
  ASSERT_GT(full.text.size(), 12u);
  // A stop string from the middle of the greedy text, likely spanning a token boundary.
  const std::string stop = full.text.substr(full.text.size() / 2, 3);
  req.stop_strings = {stop, "this never appears \x01"};
  GenerateResult cut = gen(req);
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(stop)));
  EXPECT_EQ(cut.text.find(stop), std::string::npos);
  EXPECT_LT(cut.ids.size(), full.ids.size());
}

TEST_F(GenerateTest, EosIdStopsAfterIt) {
  GenerateRequest req;
  req.max_new_tokens = 40;
  req.sampling.temperature = 0;
  GenerateResult full = gen(req);
  req.stop_ids = {full.ids[5]};
  GenerateResult cut = gen(req);
  EXPECT_EQ(cut.finish_reason, "stop");
  const size_t first = size_t(std::find(full.ids.begin(), full.ids.end(), full.ids[5]) - full.ids.begin());
  EXPECT_EQ(cut.ids, std::vector<int32_t>(full.ids.begin(), full.ids.begin() + long(first) + 1));
}

TEST_F(GenerateTest, SeededSamplingIsReproducible) {
  GenerateRequest req;
  req.max_new_tokens = 24;
  req.sampling.temperature = 1.0f;
  req.sampling.seed = 42;
  auto a = gen(req), b = gen(req);
  EXPECT_EQ(a.ids, b.ids);
  req.sampling.seed = 43;
  auto c = gen(req);
  EXPECT_NE(a.ids, c.ids);
}

// Without logprobs the token is picked by Backend::apply_penalties then argmax or sample (on the
// device where there is one); with logprobs the logits come back and runtime/Sampler picks on the
// host. Both walk the same generator, so the same seed gives the same tokens, for every filter and
// penalty.
TEST_F(GenerateTest, DeviceSamplingMatchesHostSampling) {
  for (auto [temperature, top_k, top_p, min_p, repetition, frequency, presence] :
       {std::tuple<float, int64_t, float, float, float, float, float>{1.0f, 0, 1.f, 0.f, 1.f, 0.f, 0.f},
        {0.7f, 20, 1.f, 0.f, 1.05f, 0.f, 0.f}, {1.3f, 0, 0.9f, 0.f, 1.f, 0.3f, 0.5f},
        {0.9f, 50, 0.8f, 0.05f, 1.2f, 0.2f, -0.3f}, {0.f, 0, 1.f, 0.f, 1.5f, 0.f, 0.f},
        {0.f, 0, 1.f, 0.f, 0.9f, 1.f, 0.5f}}) {
    GenerateRequest req;
    req.max_new_tokens = 24;
    req.sampling.temperature = temperature;
    req.sampling.top_k = top_k;
    req.sampling.top_p = top_p;
    req.sampling.min_p = min_p;
    req.sampling.repetition_penalty = repetition;
    req.sampling.frequency_penalty = frequency;
    req.sampling.presence_penalty = presence;
    req.sampling.seed = 7;
    const std::string what = fmt::format("temperature {}, top_k {}, top_p {}, min_p {}, penalties {} {} {}",
                                         temperature, top_k, top_p, min_p, repetition, frequency, presence);
    const GenerateResult device = gen(req);
    req.top_logprobs = 0;  // logits to the host: runtime/Sampler picks
    const GenerateResult host = gen(req);
    EXPECT_EQ(device.ids, host.ids) << what;
    if (repetition != 1.f || frequency != 0.f || presence != 0.f) {  // the penalties change the output
      req.sampling.repetition_penalty = 1.f;
      req.sampling.frequency_penalty = req.sampling.presence_penalty = 0.f;
      EXPECT_NE(gen(req).ids, device.ids) << what;
    }
  }
}

TEST_F(GenerateTest, ContextLimits) {
  GenerateRequest req;
  req.prompt = {1, 2, 3, 4, 5};
  req.max_context = 8;
  req.max_new_tokens = 100;
  req.sampling.temperature = 0;
  auto r = gen(req);
  EXPECT_EQ(r.ids.size(), 3u);  // the context, not max_new_tokens, ends it
  EXPECT_EQ(r.finish_reason, "length");
  req.max_context = 5;
  EXPECT_THROW(gen(req), Error);
  req.prompt = {1, 999};
  req.max_context = 64;
  EXPECT_THROW(gen(req), Error);
}

// Stepping a Generation with the prompt in chunks (chunked prefill, as the server's engine may)
// gives the same tokens as one prefill, and interleaving two generations step by step gives each
// what it gets alone.
TEST_F(GenerateTest, ChunkedPrefillAndInterleavedStepsMatchOneShot) {
  model_->set_kv_dtype(DType::F32);
  GenerateRequest req;
  req.prompt = tok_->encode("def main():\n    values = [1, 2, 3]\n    return");
  req.max_context = 256;
  req.max_new_tokens = 12;
  req.sampling.temperature = 0;
  ASSERT_GT(req.prompt.size(), 10u);
  const GenerateResult whole = gen(req);
  GenerateRequest other = req;
  other.prompt = tok_->encode("class A:\n    def f(self):");
  other.sampling.temperature = 0.8f;
  other.sampling.seed = 5;
  const GenerateResult other_alone = gen(other);

  Generation a(*model_, *tok_, req), b(*model_, *tok_, other);
  std::string text_a, text_b;
  std::vector<int64_t> remaining;
  while (!a.done() || !b.done()) {
    if (!a.done()) {
      a.step([&](const GeneratedToken&, std::string_view t) { text_a += t; }, 4);
      remaining.push_back(a.prompt_remaining());
    }
    if (!b.done()) b.step([&](const GeneratedToken&, std::string_view t) { text_b += t; }, 3);
  }
  EXPECT_EQ(a.result().ids, whole.ids);
  EXPECT_EQ(text_a, whole.text);
  EXPECT_EQ(b.result().ids, other_alone.ids);
  EXPECT_EQ(text_b, other_alone.text);
  // The prompt went in chunks of 4: the remainder fell by 4 per step until the first token.
  const int64_t n = int64_t(req.prompt.size());
  for (size_t i = 0; i + 1 < size_t((n + 3) / 4); ++i) EXPECT_EQ(remaining[i], n - 4 * int64_t(i + 1));
}

}  // namespace
}  // namespace nibble
