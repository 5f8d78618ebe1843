// The prefill-vs-decode sweep (llama-bench's pp/tg tests, as the user's llama-benchy runs them):
// at each context depth d, `pp P` times the prefill of P new tokens after d tokens of context
// (tok/s and time to first token), `tg N` times N single-token decode steps after d tokens.
// Each figure is the mean ± std over repetitions; decode also reports the bytes a step reads
// (weights + KV cache) per second against the measured copy bandwidth: the roofline.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/profile.h"
#include "model/model.h"
#include "runtime/sampler.h"

namespace nibble {

struct SweepOptions {
  std::vector<int64_t> prompt_tokens{512};
  int64_t generate_tokens = 128;
  std::vector<int64_t> depths{0};
  int repetitions = 3;
  uint64_t seed = 42;
  // > 0 (--profile): trace this many more decode steps at each depth, and one more prefill of
  // each prompt size after the last repetition's.
  int64_t profile_steps = 0;
  // Decode sampling: temperature 0 is greedy (argmax on the device), else the device draw with
  // these filters (backend/sampling.h); penalties are not applied.
  SamplingParams sampling{.temperature = 0};
};

struct SweepResult {
  std::string test;  // "pp512", "tg128"
  int64_t depth = 0;
  double tok_s_mean = 0, tok_s_std = 0;
  double ttft_ms_mean = 0;   // pp only
  double bytes_per_token = 0;  // tg only: weights + KV read by one step
  double gb_s = 0, roofline_pct = 0;
  StepProfile profile;        // with profile_steps: where a decode step's (tg) or the prefill's (pp) time goes
  std::string profile_error;  // why there is no profile (no trace on this backend)
};

std::vector<SweepResult> run_sweep(Model& model, const SweepOptions& options, double copy_bandwidth);

}  // namespace nibble
