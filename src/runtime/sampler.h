// Turns a row of logits into the next token, the way vLLM does for one request: penalties on the
// raw logits (repetition over prompt and output, presence/frequency over output), then
// temperature, then min-p, top-k and top-p, then a draw from the survivors with the request's own
// seeded generator. Temperature 0 is greedy (argmax, lowest id on ties). Deterministic for a seed
// on every platform: the generator is xoshiro256** and the draw walks the candidates in a fixed
// order.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/sampling.h"

namespace nibble {

struct SamplingParams {
  float temperature = 1.f;
  int64_t top_k = 0;  // 0 or -1: off
  float top_p = 1.f;
  float min_p = 0.f;
  float repetition_penalty = 1.f;
  float presence_penalty = 0.f;
  float frequency_penalty = 0.f;
  uint64_t seed = 0;
};

// Validates ranges; throws Error naming the bad parameter.
void validate(const SamplingParams& p);

struct TokenLogprob {
  int32_t id;
  float logprob;
};

class Sampler {
 public:
  Sampler(const SamplingParams& params, std::span<const int32_t> prompt);

  // Picks the next token from logits[vocab]. Records it as output (for penalties).
  int32_t sample(std::span<const float> logits);
  // The same pick on the device: Backend::apply_penalties with penalties() and penalty_tokens()
  // when penalties().active(), then Backend::argmax at temperature 0, else Backend::sample with
  // next_device_inputs() (which advances the generator as sample() would); record() notes the
  // token the device picked.
  float temperature() const { return p_.temperature; }
  SampleInputs next_device_inputs();
  Penalties penalties() const { return {p_.repetition_penalty, p_.frequency_penalty, p_.presence_penalty}; }
  // The distinct tokens of the prompt and the output so far, with their output counts (empty
  // unless penalties are active).
  std::span<const PenaltyToken> penalty_tokens() const { return seen_; }
  void record(int32_t id);

  // log-softmax of raw logits: the chosen token's logprob and the top `k` (vLLM's logprobs, which
  // are those of the model's distribution before any sampling parameter is applied).
  static float logprob_of(std::span<const float> logits, int32_t id);
  static std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int64_t k);

 private:
  double uniform();  // [0, 1)
  SampleInputs device_inputs(double uniform) const;
  SamplingParams p_;
  void note(int32_t id, bool output);  // adds to seen_
  std::vector<PenaltyToken> seen_;
  std::unordered_map<int32_t, int32_t> seen_index_;  // id -> its place in seen_
  uint64_t state_[4];
  std::vector<float> work_, probs_;
  std::vector<int32_t> order_;
};

}  // namespace nibble
