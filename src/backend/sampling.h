// Drawing a token from one row of logits: temperature, then min-p, top-k and top-p, then a draw
// with a given uniform number, candidates walked from the most likely (ties: lower id first). This
// is the definition every backend's Backend::sample matches and runtime/Sampler uses after its
// penalties, so a step sampled on the GPU picks what the CPU reference picks for the same logits.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace nibble {

// The parameters of one draw, as the device reads them: a step's inputs, copied to the backend's
// memory before the step (a recorded decode step replays with whatever they hold).
struct SampleInputs {
  double uniform = 0;       // in [0, 1): the request's generator's next number
  float temperature = 1.f;  // > 0 (temperature 0 is greedy: Backend::argmax)
  float top_p = 1.f;        // (0, 1]
  float min_p = 0.f;        // [0, 1]
  int32_t top_k = 0;        // <= 0: off
};

// The reference: `work` and `order` are scratch kept by the caller between calls.
int32_t sample_logits(std::span<const float> logits, const SampleInputs& in, std::vector<float>& work,
                      std::vector<int32_t>& order);

}  // namespace nibble
