// Greedy sampling on the device (Model::forward_greedy, Backend::argmax) picks what the host
// argmax of the same step's logits picks, on the CPU and (when present) the GPU, eager and
// recorded; pipelined decode steps pick what single steps pick; and the argmax op itself against
// the CPU reference, ties included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "core/status.h"
#include "model/model.h"
#include "runtime/generate.h"
#include "tokenizer/tokenizer.h"

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

// Pipelined decode (Model::decode_enqueue: each step on the token the step before it picked,
// still on the device) gives the tokens of the same steps run one at a time, greedy and drawn,
// across a context bucket (a graph recorded while a step is queued).
TEST_P(GreedyTest, PipelinedDecodeMatchesSteps) {
  auto model = load_model(kTinyMoe, *backend_, LoadOptions{});
  std::mt19937 rng(11);
  std::vector<int32_t> prompt(250);
  for (auto& t : prompt) t = int32_t(rng() % 400);
  const int64_t n = int64_t(prompt.size()), steps = 14;  // positions 250 .. 263: buckets 256 and 512
  for (const bool drawn : {false, true}) {
    SCOPED_TRACE(drawn ? "drawn" : "greedy");
    std::vector<SampleInputs> draws(static_cast<size_t>(steps));
    for (auto& d : draws) d = {std::uniform_real_distribution<double>(0, 1)(rng), 1.5f, 0.95f, 0.f, 50};
    auto pick = [&](std::span<const int32_t> in, int64_t pos, KvCache& kv, int64_t step) {
      return drawn ? model->forward_sample(in, pos, kv, draws[size_t(step)]) : model->forward_greedy(in, pos, kv);
    };
    KvCache kv_steps = model->make_kv_cache(n + steps + 1), kv_piped = model->make_kv_cache(n + steps + 1);
    std::vector<int32_t> want;
    int32_t t = model->forward_greedy(prompt, 0, kv_steps);
    const int32_t first = model->forward_greedy(prompt, 0, kv_piped);
    ASSERT_EQ(t, first);
    for (int64_t s = 0; s < steps; ++s) want.push_back(t = pick({&t, 1}, n + s, kv_steps, s));

    std::vector<int32_t> got;
    auto enqueue = [&](int32_t token, int64_t s) {
      model->decode_enqueue(token, n + s, kv_piped, drawn ? &draws[size_t(s)] : nullptr);
    };
    enqueue(first, 0);
    for (int64_t s = 0; s < steps; ++s) {
      if (s + 1 < steps) {
        ASSERT_TRUE(model->decode_can_chain(kv_piped, n + s + 1));
        enqueue(-1, s + 1);
      }
      got.push_back(model->decode_take(kv_piped));
    }
    EXPECT_EQ(got, want);
  }
}

// A generation decodes pipelined (Generation::step queues the next step before it reads this
// one's token): the same tokens and text as a model that runs each step alone
// (NIBBLE_NO_DECODE_PIPELINE), greedy and drawn, to the token limit and to an EOS id in the
// middle (the step queued past it is dropped), with a generation of another cache in between.
TEST_P(GreedyTest, PipelinedGenerationMatchesSteps) {
  const Tokenizer tok = Tokenizer::from_file(kTinyMoe + "/tokenizer.json");
  ::setenv("NIBBLE_NO_DECODE_PIPELINE", "1", 1);
  auto stepped = load_model(kTinyMoe, *backend_, LoadOptions{});
  ::unsetenv("NIBBLE_NO_DECODE_PIPELINE");
  auto piped = load_model(kTinyMoe, *backend_, LoadOptions{});
  for (const float temperature : {0.f, 0.8f}) {
    SCOPED_TRACE(temperature);
    GenerateRequest req;
    req.prompt = tok.encode("def main():\n    values = [1, 2]\n    return");
    req.max_context = 128;
    req.max_new_tokens = 24;
    req.sampling.temperature = temperature;
    req.sampling.seed = 3;
    auto none = [](const GeneratedToken&, std::string_view) {};
    const GenerateResult want = generate(*stepped, tok, req, none);
    ASSERT_EQ(want.ids.size(), 24u);
    const GenerateResult got = generate(*piped, tok, req, none);
    EXPECT_EQ(got.ids, want.ids);
    EXPECT_EQ(got.text, want.text);
    req.stop_ids = {want.ids[9]};
    const GenerateResult want_cut = generate(*stepped, tok, req, none);
    ASSERT_EQ(want_cut.finish_reason, "stop");
    Generation a(*piped, tok, req), b(*piped, tok, req);
    while (!a.done()) {
      a.step(none);
      if (a.result().ids.size() == 4) b.step(none);  // b's prefill between two of a's steps
    }
    EXPECT_EQ(a.result().ids, want_cut.ids);
    EXPECT_EQ(a.result().text, want_cut.text);
    EXPECT_EQ(a.result().finish_reason, "stop");
    while (!b.done()) b.step(none);
    EXPECT_EQ(b.result().ids, want_cut.ids);
  }
}

// The queue's rules are errors, not corrupt tokens: a chained step needs the step before it, over
// the same cache; another cache's step breaks the chain; at most kDecodeQueue steps a cache.
TEST_P(GreedyTest, PipelinedDecodeRules) {
  auto model = load_model(kTinyMoe, *backend_, LoadOptions{});
  const std::vector<int32_t> prompt = {11, 300, 7, 93, 5};
  KvCache a = model->make_kv_cache(32), b = model->make_kv_cache(32);
  EXPECT_THROW(model->decode_take(a), Error);
  EXPECT_THROW(model->decode_enqueue(-1, 5, a), Error);  // nothing to chain on
  const int32_t t = model->forward_greedy(prompt, 0, a);
  model->forward_greedy(prompt, 0, b);
  model->decode_enqueue(t, 5, a);
  EXPECT_FALSE(model->decode_can_chain(a, 7));
  EXPECT_THROW(model->decode_enqueue(-1, 7, a), Error);  // not the next position
  model->decode_enqueue(-1, 6, a);
  EXPECT_FALSE(model->decode_room(a));
  EXPECT_THROW(model->decode_enqueue(-1, 7, a), Error);  // kDecodeQueue steps of `a` queued
  model->decode_enqueue(t, 5, b);                         // another cache's step breaks a's chain
  model->decode_take(a);
  EXPECT_FALSE(model->decode_can_chain(a, 7));
  EXPECT_THROW(model->decode_enqueue(-1, 7, a), Error);
  EXPECT_THROW(model->decode_enqueue(t, 32, a), Error);  // past the cache
  EXPECT_THROW(model->decode_enqueue(400, 7, a), Error);  // outside the vocabulary
  model->decode_take(a);
  model->decode_take(b);
  EXPECT_THROW(model->decode_take(b), Error);
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
