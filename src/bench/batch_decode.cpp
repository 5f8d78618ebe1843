#include "bench/batch_decode.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "core/status.h"

namespace nibble {

std::vector<BatchDecodeResult> run_batch_decode(Model& model, const std::vector<int64_t>& batches, int64_t depth,
                                                int64_t steps, int repetitions, uint64_t seed,
                                                int64_t traced_steps) {
  using Clock = std::chrono::steady_clock;
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t block = 16, per_row = (depth + steps * (repetitions + 1) + traced_steps + block) / block + 1;
  auto pool = model.make_kv_pool(max_batch * per_row + 1, 4, max_batch, per_row);
  for (int64_t r = 0; r < max_batch; ++r) {
    std::vector<int32_t> blocks;
    for (int64_t b = 0; b < per_row; ++b) blocks.push_back(int32_t(1 + r * per_row + b));
    pool->set_row(r, blocks);
  }
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int32_t vocab = int32_t(model.config().vocab_size);
  std::vector<BatchDecodeResult> results;
  for (int64_t batch : batches) {
    // The context: each sequence's own random tokens, prefilled in chunks of up to 2048 tokens.
    std::vector<std::vector<int32_t>> context(static_cast<size_t>(batch));
    for (auto& c : context)
      for (int64_t i = 0; i <= depth; ++i) c.push_back(int32_t(rng() % uint32_t(vocab)));
    BatchOutput out;
    for (int64_t r = 0; r < batch; ++r)
      for (int64_t p = 0; p < depth; p += 2048) {
        BatchEntry e;
        e.tokens = std::span<const int32_t>(context[size_t(r)]).subspan(size_t(p), size_t(std::min<int64_t>(2048, depth - p)));
        e.pos0 = p;
        e.row = r;
        e.output = BatchEntry::Output::kNone;
        model.forward_batch({&e, 1}, *pool, out);
      }
    std::vector<int64_t> pos(static_cast<size_t>(batch), depth);
    std::vector<int32_t> last(static_cast<size_t>(batch));
    for (int64_t r = 0; r < batch; ++r) last[size_t(r)] = context[size_t(r)][size_t(depth)];
    auto step = [&] {
      std::vector<BatchEntry> entries(static_cast<size_t>(batch));
      for (int64_t r = 0; r < batch; ++r) {
        entries[size_t(r)].tokens = {&last[size_t(r)], 1};
        entries[size_t(r)].pos0 = pos[size_t(r)]++;
        entries[size_t(r)].row = r;
        entries[size_t(r)].output = BatchEntry::Output::kGreedy;
      }
      model.forward_batch(entries, *pool, out);
      for (int64_t r = 0; r < batch; ++r) last[size_t(r)] = out.tokens[size_t(r)];
    };
    step();  // records the step's graph
    std::vector<double> rates;
    for (int rep = 0; rep < repetitions; ++rep) {
      const auto t0 = Clock::now();
      for (int64_t s = 0; s < steps; ++s) step();
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      rates.push_back(double(batch * steps) / seconds);
    }
    double mean = 0, var = 0;
    for (double r : rates) mean += r / double(rates.size());
    for (double r : rates) var += (r - mean) * (r - mean) / double(rates.size());
    BatchDecodeResult result;
    result.batch = batch;
    result.depth = depth;
    result.step_ms = 1e3 * double(batch) / mean;
    result.tok_s = mean;
    result.tok_s_std = std::sqrt(var);
    if (traced_steps > 0 && model.backend().start_trace(&result.profile_error)) {
      for (int64_t s = 0; s < traced_steps; ++s) step();
      result.profile = profile_steps(model.backend().stop_trace(), traced_steps);
    }
    results.push_back(std::move(result));
  }
  model.release_graphs(*pool);
  return results;
}

}  // namespace nibble
