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

// Penalties on raw logits (vLLM's, applied before temperature): every token seen in the prompt
// or the output has its logit divided by `repetition` when positive, multiplied when not; every
// token of the output then loses frequency x its count + presence.
struct Penalties {
  float repetition = 1.f;  // > 0
  float frequency = 0.f;   // [-2, 2]
  float presence = 0.f;    // [-2, 2]
  bool active() const { return repetition != 1.f || frequency != 0.f || presence != 0.f; }
};
// A distinct token of a sequence's prompt or output, with how often the output holds it (0: the
// prompt only). A sequence's list names each token once, so a device applies it in parallel.
struct PenaltyToken {
  int32_t id;
  int32_t output_count;
};
// One row of a batch of logits to penalise: its tokens are tokens[first, first + count).
struct PenaltyRow {
  int64_t logits_row;
  int64_t first, count;
  Penalties penalties;
};

// The reference: penalises logits in place (ids outside the row are ignored).
void apply_penalties(std::span<float> logits, const Penalties& p, std::span<const PenaltyToken> tokens);

// The reference: `work` and `order` are scratch kept by the caller between calls.
int32_t sample_logits(std::span<const float> logits, const SampleInputs& in, std::vector<float>& work,
                      std::vector<int32_t>& order);

}  // namespace nibble
