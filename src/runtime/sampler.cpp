#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/status.h"

namespace nibble {

void validate(const SamplingParams& p) {
  NIBBLE_CHECK(std::isfinite(p.temperature) && p.temperature >= 0, "temperature must be >= 0, got {}",
               p.temperature);
  NIBBLE_CHECK(p.top_k >= -1, "top_k must be -1, 0 (off) or positive, got {}", p.top_k);
  NIBBLE_CHECK(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1], got {}", p.top_p);
  NIBBLE_CHECK(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1], got {}", p.min_p);
  NIBBLE_CHECK(p.repetition_penalty > 0 && std::isfinite(p.repetition_penalty),
               "repetition_penalty must be > 0, got {}", p.repetition_penalty);
  NIBBLE_CHECK(p.presence_penalty >= -2 && p.presence_penalty <= 2,
               "presence_penalty must be in [-2, 2], got {}", p.presence_penalty);
  NIBBLE_CHECK(p.frequency_penalty >= -2 && p.frequency_penalty <= 2,
               "frequency_penalty must be in [-2, 2], got {}", p.frequency_penalty);
}

namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Sampler::Sampler(const SamplingParams& params, std::span<const int32_t> prompt) : p_(params) {
  validate(p_);
  for (int32_t id : prompt) ++prompt_counts_[id];
  uint64_t s = p_.seed;
  for (auto& w : state_) w = splitmix64(s);
}

double Sampler::uniform() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return double(result >> 11) * 0x1.0p-53;
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int64_t vocab = int64_t(logits.size());
  work_.assign(logits.begin(), logits.end());
  if (p_.repetition_penalty != 1.f) {
    auto penalise = [&](int32_t id) {
      if (id < 0 || id >= vocab) return;
      float& l = work_[size_t(id)];
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    };
    for (auto& [id, n] : prompt_counts_) penalise(id);
    for (auto& [id, n] : output_counts_)
      if (!prompt_counts_.count(id)) penalise(id);
  }
  for (auto& [id, n] : output_counts_) {
    if (id < 0 || id >= vocab) continue;
    work_[size_t(id)] -= p_.frequency_penalty * float(n) + p_.presence_penalty;
  }

  int32_t chosen;
  if (p_.temperature == 0.f) {
    chosen = int32_t(std::max_element(work_.begin(), work_.end()) - work_.begin());
  } else {
    // Softmax at temperature, then filter: min-p against the best probability, top-k, top-p.
    const float mx = *std::max_element(work_.begin(), work_.end());
    for (auto& l : work_) l = std::exp((l - mx) / p_.temperature);
    order_.resize(size_t(vocab));
    std::iota(order_.begin(), order_.end(), 0);
    int64_t keep = vocab;
    if (p_.top_k > 0) keep = std::min(keep, p_.top_k);
    auto by_prob = [&](int32_t a, int32_t b) {
      return work_[size_t(a)] > work_[size_t(b)] || (work_[size_t(a)] == work_[size_t(b)] && a < b);
    };
    if (keep < vocab) {
      std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_prob);
    } else {
      std::sort(order_.begin(), order_.end(), by_prob);
    }
    order_.resize(size_t(keep));
    if (p_.min_p > 0) {
      const float threshold = p_.min_p * work_[size_t(order_[0])];
      while (order_.size() > 1 && work_[size_t(order_.back())] < threshold) order_.pop_back();
    }
    double kept = 0;
    for (int32_t id : order_) kept += work_[size_t(id)];
    if (p_.top_p < 1.f) {  // smallest prefix whose mass reaches top_p (of the kept mass)
      // The relative slack makes an exact tie (probabilities 0.5 + 0.3 and top_p 0.8) keep the
      // nucleus the user meant, not one more token that only float rounding let in.
      const double target = double(p_.top_p) * kept * (1 - 1e-6);
      double acc = 0;
      size_t n = 0;
      while (n < order_.size()) {
        acc += work_[size_t(order_[n++])];
        if (acc >= target) break;
      }
      order_.resize(n);
      kept = acc;
    }
    const double r = uniform() * kept;
    double acc = 0;
    chosen = order_.back();
    for (int32_t id : order_) {
      acc += work_[size_t(id)];
      if (r < acc) {
        chosen = id;
        break;
      }
    }
  }
  ++output_counts_[chosen];
  return chosen;
}

float Sampler::logprob_of(std::span<const float> logits, int32_t id) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l - mx));
  return float(double(logits[size_t(id)] - mx) - std::log(sum));
}

std::vector<TokenLogprob> Sampler::top_logprobs(std::span<const float> logits, int64_t k) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l - mx));
  const float log_z = float(std::log(sum)) + mx;
  k = std::min<int64_t>(k, int64_t(logits.size()));
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  std::vector<TokenLogprob> out;
  for (int64_t i = 0; i < k; ++i) out.push_back({ids[size_t(i)], logits[size_t(ids[size_t(i)])] - log_z});
  return out;
}

}  // namespace nibble
