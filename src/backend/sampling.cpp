#include "backend/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace nibble {

void apply_penalties(std::span<float> logits, const Penalties& p, std::span<const PenaltyToken> tokens) {
  const int64_t vocab = int64_t(logits.size());
  for (const PenaltyToken& t : tokens) {
    if (t.id < 0 || t.id >= vocab) continue;
    float& l = logits[size_t(t.id)];
    l = l > 0 ? l / p.repetition : l * p.repetition;
    if (t.output_count > 0) l -= p.frequency * float(t.output_count) + p.presence;
  }
}

int32_t sample_logits(std::span<const float> logits, const SampleInputs& in, std::vector<float>& work,
                      std::vector<int32_t>& order) {
  const int64_t vocab = int64_t(logits.size());
  // Softmax numerators at temperature, then filter: min-p against the best, top-k, top-p.
  const float mx = *std::max_element(logits.begin(), logits.end());
  work.resize(size_t(vocab));
  for (int64_t i = 0; i < vocab; ++i) work[size_t(i)] = std::exp((logits[size_t(i)] - mx) / in.temperature);
  order.resize(size_t(vocab));
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = vocab;
  if (in.top_k > 0) keep = std::min<int64_t>(keep, in.top_k);
  auto by_prob = [&](int32_t a, int32_t b) {
    return work[size_t(a)] > work[size_t(b)] || (work[size_t(a)] == work[size_t(b)] && a < b);
  };
  if (keep < vocab)
    std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_prob);
  else
    std::sort(order.begin(), order.end(), by_prob);
  order.resize(size_t(keep));
  if (in.min_p > 0) {
    const float threshold = in.min_p * work[size_t(order[0])];
    while (order.size() > 1 && work[size_t(order.back())] < threshold) order.pop_back();
  }
  double kept = 0;
  for (int32_t id : order) kept += work[size_t(id)];
  if (in.top_p < 1.f) {  // smallest prefix whose mass reaches top_p (of the kept mass)
    // The relative slack makes an exact tie (probabilities 0.5 + 0.3 and top_p 0.8) keep the
    // nucleus the user meant, not one more token that only float rounding let in.
    const double target = double(in.top_p) * kept * (1 - 1e-6);
    double acc = 0;
    size_t n = 0;
    while (n < order.size()) {
      acc += work[size_t(order[n++])];
      if (acc >= target) break;
    }
    order.resize(n);
    kept = acc;
  }
  const double r = in.uniform * kept;
  double acc = 0;
  for (int32_t id : order) {
    acc += work[size_t(id)];
    if (r < acc) return id;
  }
  return order.back();
}

}  // namespace nibble
