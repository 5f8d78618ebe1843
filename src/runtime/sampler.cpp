#include "runtime/sampler.h"

#include <algorithm>
#include <climits>
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
  if (penalties().active())
    for (int32_t id : prompt) note(id, false);
  uint64_t s = p_.seed;
  for (auto& w : state_) w = splitmix64(s);
}

SampleInputs Sampler::device_inputs(double uniform) const {
  SampleInputs in;
  in.uniform = uniform;
  in.temperature = p_.temperature;
  in.top_p = p_.top_p;
  in.min_p = p_.min_p;
  in.top_k = int32_t(std::min<int64_t>(std::max<int64_t>(p_.top_k, 0), INT32_MAX));
  return in;
}

SampleInputs Sampler::next_device_inputs() { return device_inputs(uniform()); }

void Sampler::note(int32_t id, bool output) {
  auto [it, added] = seen_index_.try_emplace(id, int32_t(seen_.size()));
  if (added) seen_.push_back({id, 0});
  if (output) ++seen_[size_t(it->second)].output_count;
}

void Sampler::record(int32_t id) {
  if (penalties().active()) note(id, true);
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
  work_.assign(logits.begin(), logits.end());
  apply_penalties(work_, penalties(), seen_);
  const int32_t chosen = p_.temperature == 0.f
                             ? int32_t(std::max_element(work_.begin(), work_.end()) - work_.begin())
                             : sample_logits(work_, device_inputs(uniform()), probs_, order_);
  record(chosen);
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
