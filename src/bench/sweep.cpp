#include "bench/sweep.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "runtime/sampler.h"

namespace nibble {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void mean_std(const std::vector<double>& v, double& mean, double& std_dev) {
  mean = 0;
  for (double x : v) mean += x;
  mean /= double(v.size());
  double var = 0;
  for (double x : v) var += (x - mean) * (x - mean);
  std_dev = v.size() > 1 ? std::sqrt(var / double(v.size() - 1)) : 0;
}

}  // namespace

std::vector<SweepResult> run_sweep(Model& model, const SweepOptions& o, double copy_bandwidth) {
  const int64_t vocab = model.config().vocab_size;
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int32_t> token(0, int32_t(vocab - 1));
  auto random_tokens = [&](int64_t n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = token(rng);
    return t;
  };
  const int64_t max_new = std::max(o.generate_tokens,
                                   *std::max_element(o.prompt_tokens.begin(), o.prompt_tokens.end()));
  std::vector<SweepResult> results;
  std::vector<float> logits;
  SamplingParams sampling = o.sampling;
  sampling.seed = o.seed;
  Sampler sampler(sampling, {});
  for (int64_t depth : o.depths) {
    std::vector<std::vector<double>> pp_tok_s(o.prompt_tokens.size()), pp_ttft(o.prompt_tokens.size());
    std::vector<StepProfile> pp_profile(o.prompt_tokens.size());
    std::vector<std::string> pp_profile_error(o.prompt_tokens.size());
    std::vector<double> tg_tok_s;
    KvCache kv = model.make_kv_cache(depth + max_new + o.profile_steps);
    StepProfile profile;
    std::string profile_error;
    for (int rep = 0; rep < o.repetitions + 1; ++rep) {  // repetition 0 warms up and is not kept
      const bool keep = rep > 0;
      // The context: `depth` tokens, prefilled in chunks (not timed).
      constexpr int64_t kChunk = 2048;
      const auto context = random_tokens(depth);
      for (int64_t pos = 0; pos < depth; pos += kChunk) {
        const int64_t n = std::min(kChunk, depth - pos);
        model.forward(std::span(context).subspan(size_t(pos), size_t(n)), pos, kv, false, logits);
      }
      for (size_t i = 0; i < o.prompt_tokens.size(); ++i) {
        const auto prompt = random_tokens(o.prompt_tokens[i]);
        const auto t0 = Clock::now();
        model.forward_greedy(prompt, depth, kv);  // the first token is part of time-to-first-token
        const double s = seconds_since(t0);
        if (keep) {
          pp_tok_s[i].push_back(double(prompt.size()) / s);
          pp_ttft[i].push_back(s * 1e3);
        }
        // After the last repetition's, the same prefill again under a device trace (one "step").
        if (rep == o.repetitions && o.profile_steps > 0 && model.backend().start_trace(&pp_profile_error[i])) {
          model.forward_greedy(prompt, depth, kv);
          pp_profile[i] = profile_steps(model.backend().stop_trace(), 1);
        }
      }
      if (o.generate_tokens > 0) {
        // Tokens picked on the device and decode steps pipelined, as `nibble run` does (greedy at
        // temperature 0, else drawn): step n + 1 is queued on step n's token before the host reads it.
        auto enqueue = [&](int32_t token, int64_t pos) {
          if (o.sampling.temperature == 0) return model.decode_enqueue(token, pos, kv);
          const SampleInputs in = sampler.next_device_inputs();
          model.decode_enqueue(token, pos, kv, &in);
        };
        auto decode = [&](int32_t first, int64_t pos, int64_t n) {
          enqueue(first, pos);
          int32_t last = first;
          for (int64_t step = 0; step < n; ++step) {
            if (step + 1 < n) enqueue(-1, pos + step + 1);
            last = model.decode_take(kv);
          }
          return last;
        };
        int32_t next = token(rng);
        const auto t0 = Clock::now();
        next = decode(next, depth, o.generate_tokens);
        if (keep) tg_tok_s.push_back(double(o.generate_tokens) / seconds_since(t0));
        // After the last repetition's timed steps, the same steps again under a device trace.
        if (rep == o.repetitions && o.profile_steps > 0) {
          if (model.backend().start_trace(&profile_error)) {
            next = decode(next, depth + o.generate_tokens, o.profile_steps);
            profile = profile_steps(model.backend().stop_trace(), o.profile_steps);
          }
        }
      }
    }
    for (size_t i = 0; i < o.prompt_tokens.size(); ++i) {
      SweepResult r;
      r.test = "pp" + std::to_string(o.prompt_tokens[i]);
      r.depth = depth;
      double unused;
      mean_std(pp_tok_s[i], r.tok_s_mean, r.tok_s_std);
      mean_std(pp_ttft[i], r.ttft_ms_mean, unused);
      r.profile = std::move(pp_profile[i]);
      r.profile_error = std::move(pp_profile_error[i]);
      results.push_back(r);
    }
    if (o.generate_tokens > 0) {
      SweepResult r;
      r.test = "tg" + std::to_string(o.generate_tokens);
      r.depth = depth;
      mean_std(tg_tok_s, r.tok_s_mean, r.tok_s_std);
      // A step at context c reads the weights and c tokens of KV; averaged over the test's steps.
      const double avg_context = double(depth) + double(o.generate_tokens - 1) / 2;
      r.bytes_per_token = double(model.weight_bytes_per_token()) +
                          avg_context * double(model.kv_bytes_per_context_token());
      r.gb_s = r.bytes_per_token * r.tok_s_mean / 1e9;
      r.roofline_pct = 100.0 * r.bytes_per_token * r.tok_s_mean / copy_bandwidth;
      r.profile = std::move(profile);
      r.profile_error = std::move(profile_error);
      results.push_back(r);
    }
  }
  return results;
}

}  // namespace nibble
