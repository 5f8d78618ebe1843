// Batched decode (what a server's engine runs): B sequences at context depth d each take one
// token per step through Model::forward_batch over a shared KvPool, recorded and replayed as the
// engine's steps are. Reports the step time and aggregate tokens/s per batch size, beside the
// batch-1 tg of the sweep (bench/sweep.h): the model's side of serving throughput, without HTTP.
#pragma once

#include <cstdint>
#include <vector>

#include <string>

#include "bench/profile.h"
#include "model/model.h"

namespace nibble {

struct BatchDecodeResult {
  int64_t batch = 0, depth = 0;
  double step_ms = 0, tok_s = 0, tok_s_std = 0;
  StepProfile profile;        // traced_steps > 0: where a step's device time goes
  std::string profile_error;  // why there is no profile
};

// traced_steps > 0: after the timed steps, that many more under a device trace (bench --profile).
std::vector<BatchDecodeResult> run_batch_decode(Model& model, const std::vector<int64_t>& batches, int64_t depth,
                                                int64_t steps, int repetitions, uint64_t seed,
                                                int64_t traced_steps = 0);

}  // namespace nibble
