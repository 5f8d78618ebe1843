// Sampler: greedy, seeding, top-k / top-p / min-p truncation, the distribution of draws, vLLM's
// penalties, parameter validation and logprobs. Logits come from a seeded std::mt19937 so every
// run sees the same (non-trivial) inputs.
#include "runtime/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/status.h"

namespace nibble {
namespace {

std::vector<float> random_logits(std::mt19937& rng, size_t vocab, float stddev = 2.f) {
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> l(vocab);
  for (auto& x : l) x = d(rng);
  return l;
}

// Logits whose softmax (at temperature 1) is exactly the given probabilities, up to float rounding.
std::vector<float> logits_of(const std::vector<double>& probs) {
  std::vector<float> l;
  for (double p : probs) l.push_back(float(std::log(p)));
  return l;
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - mx) / temperature);
  for (auto& x : p) x /= sum;
  return p;
}

// Counts of each token over `draws` samples with fixed logits.
std::map<int32_t, int> histogram(const SamplingParams& params, const std::vector<float>& logits,
                                 int draws) {
  Sampler s(params, {});
  std::map<int32_t, int> h;
  for (int i = 0; i < draws; ++i) ++h[s.sample(logits)];
  return h;
}

std::set<int32_t> drawn(const SamplingParams& params, const std::vector<float>& logits, int draws) {
  std::set<int32_t> out;
  for (auto& [id, n] : histogram(params, logits, draws)) out.insert(id);
  return out;
}

// Pearson chi-square of observed counts against expected probabilities.
double chi_square(const std::map<int32_t, int>& h, const std::vector<double>& p, int draws) {
  double chi2 = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    double expected = p[i] * draws;
    double observed = h.count(int32_t(i)) ? h.at(int32_t(i)) : 0;
    chi2 += (observed - expected) * (observed - expected) / expected;
  }
  return chi2;
}

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  std::mt19937 rng(1);
  SamplingParams p;
  p.temperature = 0;
  for (int trial = 0; trial < 50; ++trial) {
    auto l = random_logits(rng, 300);
    Sampler s(p, {});
    EXPECT_EQ(s.sample(l), int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
  }
  std::vector<float> ties = {0.5f, 3.f, -1.f, 3.f, 3.f};
  Sampler s(p, {});
  EXPECT_EQ(s.sample(ties), 1);
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedDifferent) {
  auto run = [](uint64_t seed) {
    std::mt19937 rng(7);  // same logits stream for every sampler
    SamplingParams p;
    p.seed = seed;
    Sampler s(p, {});
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(random_logits(rng, 50, 1.f)));
    return out;
  };
  EXPECT_EQ(run(1234), run(1234));
  EXPECT_NE(run(1234), run(1235));
  EXPECT_NE(run(0), run(1));
}

TEST(Sampler, TopKOneIsArgmaxEvenWhenHot) {
  std::mt19937 rng(2);
  SamplingParams p;
  p.temperature = 100.f;  // nearly uniform without truncation
  p.top_k = 1;
  Sampler s(p, {});
  for (int i = 0; i < 500; ++i) {
    auto l = random_logits(rng, 64);
    ASSERT_EQ(s.sample(l), int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
  }
}

TEST(Sampler, TopKNeverLeavesTheKBest) {
  std::mt19937 rng(3);
  auto l = random_logits(rng, 40, 0.5f);  // flat enough that truncation matters
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  for (int64_t k : {2, 5, 17}) {
    SamplingParams p;
    p.top_k = k;
    p.seed = uint64_t(k);
    std::set<int32_t> best(order.begin(), order.begin() + k);
    // Every draw among the k best, and every one of them reachable (not over-truncated).
    EXPECT_EQ(drawn(p, l, 5000), best) << "k=" << k;
  }
}

TEST(Sampler, TopPKeepsSmallestNucleus) {
  auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  SamplingParams p;
  p.top_p = 0.75f;  // 0.5 < 0.75 <= 0.8: first two
  EXPECT_EQ(drawn(p, l, 4000), (std::set<int32_t>{0, 1}));
  p.top_p = 0.9f;  // 0.8 < 0.9 <= 0.95: first three
  EXPECT_EQ(drawn(p, l, 4000), (std::set<int32_t>{0, 1, 2}));
  p.top_p = 0.4f;  // the top token alone reaches it
  EXPECT_EQ(drawn(p, l, 4000), (std::set<int32_t>{0}));
  // Just either side of the 0.8 boundary.
  p.top_p = 0.79f;
  EXPECT_EQ(drawn(p, l, 4000), (std::set<int32_t>{0, 1}));
  p.top_p = 0.81f;
  EXPECT_EQ(drawn(p, l, 4000), (std::set<int32_t>{0, 1, 2}));
}

// Exactly on the boundary (0.5 + 0.3 == top_p 0.8) the nucleus is the first two tokens, although
// 0.8f is 0.80000001 and the float probabilities sum to 1.59999996 of a kept mass 1.99999994.
TEST(Sampler, TopPExactBoundaryKeepsOnlyNucleus) {
  auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  SamplingParams p;
  p.top_p = 0.8f;
  EXPECT_EQ(drawn(p, l, 4000), (std::set<int32_t>{0, 1}));
}

TEST(Sampler, TopPFrequenciesAreRenormalisedNucleus) {
  // Inside the nucleus the draw follows the renormalised probabilities 0.5/0.8, 0.3/0.8.
  auto l = logits_of({0.5, 0.3, 0.15, 0.05});
  SamplingParams p;
  p.top_p = 0.75f;
  const int draws = 20000;
  auto h = histogram(p, l, draws);
  EXPECT_LT(chi_square(h, {0.625, 0.375}, draws), 15.0);
}

TEST(Sampler, MinPDropsTokensBelowFractionOfMax) {
  auto l = logits_of({0.4, 0.3, 0.15, 0.1, 0.05});
  SamplingParams p;
  p.min_p = 0.3f;  // threshold 0.12: keeps 0.4, 0.3, 0.15
  EXPECT_EQ(drawn(p, l, 5000), (std::set<int32_t>{0, 1, 2}));
  p.min_p = 0.8f;  // threshold 0.32: only the top
  EXPECT_EQ(drawn(p, l, 2000), (std::set<int32_t>{0}));
  p.min_p = 0.f;
  EXPECT_EQ(drawn(p, l, 5000), (std::set<int32_t>{0, 1, 2, 3, 4}));
}

TEST(Sampler, FrequenciesMatchSoftmaxAndTemperatureSharpens) {
  std::mt19937 rng(4);
  auto l = random_logits(rng, 10, 1.f);
  const int draws = 20000;
  SamplingParams p;
  p.seed = 99;
  auto h1 = histogram(p, l, draws);
  // 9 degrees of freedom: chi2 > 40 has probability ~5e-6 for a correct sampler.
  EXPECT_LT(chi_square(h1, softmax(l, 1.0), draws), 40.0);
  auto probs = softmax(l, 1.0);
  for (size_t i = 0; i < probs.size(); ++i) {  // and each token within 5 standard errors
    double se = std::sqrt(probs[i] * (1 - probs[i]) / draws);
    EXPECT_NEAR(h1[int32_t(i)] / double(draws), probs[i], 5 * se + 1e-9) << "token " << i;
  }
  p.temperature = 0.5f;  // probabilities proportional to p^2
  auto h05 = histogram(p, l, draws);
  EXPECT_LT(chi_square(h05, softmax(l, 0.5), draws), 40.0);
  EXPECT_GT(chi_square(h05, softmax(l, 1.0), draws), 200.0);  // really different from T=1
  int32_t best = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
  EXPECT_GT(h05[best], h1[best]);
}

TEST(Sampler, RepetitionPenaltyOncePerSeenToken) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 1.2f;
  // Positive logit divided once: 2.0/1.2 = 1.67 still beats 1.5 (twice would give 1.39) even
  // though token 0 occurs three times in the prompt.
  std::vector<int32_t> prompt = {0, 0, 0};
  EXPECT_EQ(Sampler(p, prompt).sample(std::vector<float>{2.f, 1.5f}), 0);
  EXPECT_EQ(Sampler(p, prompt).sample(std::vector<float>{2.f, 1.7f}), 1);  // 1.67 < 1.7
  // Negative logit multiplied: -1.0 * 1.2 = -1.2 loses to -1.1.
  EXPECT_EQ(Sampler(p, prompt).sample(std::vector<float>{-1.f, -1.1f}), 1);
  // Without the penalty the same rows pick token 0.
  p.repetition_penalty = 1.f;
  EXPECT_EQ(Sampler(p, prompt).sample(std::vector<float>{2.f, 1.7f}), 0);
  // Output tokens are penalised too: the first pick (0) makes the second flip to 1.
  p.repetition_penalty = 1.2f;
  Sampler s(p, {});
  std::vector<float> row = {2.f, 1.8f};
  EXPECT_EQ(s.sample(row), 0);
  EXPECT_EQ(s.sample(row), 1);  // 2/1.2 = 1.67 < 1.8
  EXPECT_EQ(s.sample(row), 0);  // both penalised once: 1.67 > 1.5
}

TEST(Sampler, PresenceAndFrequencyPenaltiesOnOutputOnly) {
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.5f;
  // Token 0 in the prompt is not penalised by presence.
  Sampler s(p, std::vector<int32_t>{0, 0});
  std::vector<float> row = {1.f, 0.8f};
  EXPECT_EQ(s.sample(row), 0);
  EXPECT_EQ(s.sample(row), 1);  // 0 now at 0.5 < 0.8
  EXPECT_EQ(s.sample(row), 0);  // 1 at 0.3 < 0.5
  EXPECT_EQ(s.sample(row), 0);  // presence does not grow with count: 0.5 > 0.3

  // Frequency grows with count: logit -= 0.15 * count.
  SamplingParams f;
  f.temperature = 0;
  f.frequency_penalty = 0.15f;
  Sampler sf(f, std::vector<int32_t>{1, 1, 1});
  std::vector<int32_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(sf.sample(row));
  // 1.0 vs 0.8 -> 0; 0.85 vs 0.8 -> 0; 0.7 vs 0.8 -> 1; 0.7 vs 0.65 -> 0; 0.55 vs 0.65 -> 1;
  // 0.55 vs 0.5 -> 0.
  EXPECT_EQ(got, (std::vector<int32_t>{0, 0, 1, 0, 1, 0}));
}

TEST(Sampler, PenaltiesMatchReferenceOnRandomRows) {
  // Greedy with all three penalties against a direct transcription of vLLM's apply_penalties.
  std::mt19937 rng(5);
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 1.3f;
  p.presence_penalty = 0.4f;
  p.frequency_penalty = 0.2f;
  std::vector<int32_t> prompt = {3, 7, 7, 11};
  Sampler s(p, prompt);
  std::map<int32_t, int> out_count;
  for (int step = 0; step < 100; ++step) {
    auto l = random_logits(rng, 16, 0.7f);
    std::vector<float> ref = l;
    for (int32_t id = 0; id < 16; ++id) {
      bool seen = std::count(prompt.begin(), prompt.end(), id) || out_count.count(id);
      if (seen) ref[id] = ref[id] > 0 ? ref[id] / p.repetition_penalty : ref[id] * p.repetition_penalty;
      if (out_count.count(id)) ref[id] -= p.frequency_penalty * float(out_count[id]) + p.presence_penalty;
    }
    int32_t expect = int32_t(std::max_element(ref.begin(), ref.end()) - ref.begin());
    int32_t got = s.sample(l);
    ASSERT_EQ(got, expect) << "step " << step;
    ++out_count[got];
  }
}

TEST(Sampler, ValidateRejectsOutOfRange) {
  auto bad = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    return p;
  };
  EXPECT_NO_THROW(validate(SamplingParams{}));
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.temperature = -0.1f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.top_p = 0.f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.top_p = 1.01f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.min_p = 1.5f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.repetition_penalty = 0.f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.repetition_penalty = -1.f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.presence_penalty = 3.f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.frequency_penalty = -3.f; })), Error);
  EXPECT_THROW(validate(bad([](SamplingParams& p) { p.top_k = -2; })), Error);
  EXPECT_NO_THROW(validate(bad([](SamplingParams& p) { p.top_k = -1; })));
  // The message names the parameter; the constructor validates too.
  try {
    validate(bad([](SamplingParams& p) { p.top_p = 0.f; }));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_p"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Sampler(bad([](SamplingParams& p) { p.temperature = -1.f; }), {}), Error);
}

TEST(Sampler, LogprobsMatchDoubleLogSoftmax) {
  std::mt19937 rng(6);
  auto l = random_logits(rng, 1000, 3.f);
  double mx = *std::max_element(l.begin(), l.end()), sum = 0;
  for (float x : l) sum += std::exp(double(x) - mx);
  auto ref = [&](int32_t id) { return double(l[id]) - mx - std::log(sum); };
  for (int32_t id = 0; id < 1000; ++id)
    ASSERT_NEAR(Sampler::logprob_of(l, id), ref(id), 1e-5) << id;

  auto top = Sampler::top_logprobs(l, 20);
  ASSERT_EQ(top.size(), 20u);
  std::vector<int32_t> order(l.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b]; });
  for (size_t i = 0; i < top.size(); ++i) {
    EXPECT_EQ(top[i].id, order[i]) << i;
    EXPECT_NEAR(top[i].logprob, ref(top[i].id), 1e-5) << i;
    if (i) {
      EXPECT_GE(top[i - 1].logprob, top[i].logprob);
    }
  }
  EXPECT_EQ(Sampler::top_logprobs(std::vector<float>{1.f, 2.f}, 5).size(), 2u);  // k clamped
}

}  // namespace
}  // namespace nibble
