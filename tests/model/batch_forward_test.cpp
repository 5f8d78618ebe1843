// Model::forward_batch: several sequences in one step over a shared KvPool compute what each
// computes alone (Model::forward over its own KvCache). Sequences of different lengths, prompt
// chunks mixed with decode tokens in one step, table rows of shuffled blocks, a sequence that
// starts from blocks another one filled (prefix caching), batch sizes that take the recorded
// steps' padding (5 decoding -> bucket 8, then 3 -> bucket 4), tokens picked on the device with
// penalties (greedy and drawn) beside plain greedy picks and logits rows. Teacher-forced: both sides are
// fed the same tokens, so a difference cannot hide behind a diverged continuation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <map>
#include <random>

#include "core/status.h"
#include "dummy_models.h"
#include "model/model.h"

namespace nibble {
namespace {

struct Reference {
  std::vector<std::vector<float>> logits;  // per step: after the prompt, then after each fed token
  std::vector<int32_t> fed;                // tokens fed after the prompt (the reference's greedy picks)
};

Reference run_alone(Model& model, const std::vector<int32_t>& prompt, int64_t steps) {
  KvCache kv = model.make_kv_cache(int64_t(prompt.size()) + steps + 1);
  Reference ref;
  std::vector<float> logits;
  model.forward(prompt, 0, kv, false, logits);
  for (int64_t s = 0; s <= steps; ++s) {
    ref.logits.push_back(logits);
    if (s == steps) break;
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ref.fed.push_back(next);
    model.forward({&next, 1}, int64_t(prompt.size()) + s, kv, false, logits);
  }
  model.release_graphs(kv);
  return ref;
}

// A sequence's distinct tokens among its first `upto`, with their counts after the prompt: what
// runtime/Sampler keeps for penalties.
std::vector<PenaltyToken> penalty_tokens(const std::vector<int32_t>& t, int64_t n_prompt, int64_t upto) {
  std::vector<PenaltyToken> out;
  std::map<int32_t, size_t> index;
  for (int64_t i = 0; i < upto; ++i) {
    auto [it, added] = index.try_emplace(t[size_t(i)], out.size());
    if (added) out.push_back({t[size_t(i)], 0});
    if (i >= n_prompt) ++out[it->second].output_count;
  }
  return out;
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, double(std::fabs(got[i] - want[i])));
    ref = std::max(ref, double(std::fabs(want[i])));
  }
  return diff / ref;
}

void check_batches(Backend& backend, double tolerance) {
  LoadOptions load;
  load.load_format = "dummy";
  load.quantization = "int4";
  load.group_size = 32;
  auto model = load_model(decode_shaped_config(), backend, load);
  const int64_t vocab = model->config().vocab_size, steps = 12;
  std::mt19937 rng(7);
  // Five prompts of 3 to 90 tokens; prompt 4 starts with prompt 3's first 64 tokens (4 blocks).
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t n : {3, 37, 90, 70, 80}) {
    std::vector<int32_t> p;
    for (int64_t i = 0; i < n; ++i) p.push_back(int32_t(rng() % uint32_t(vocab)));
    prompts.push_back(p);
  }
  std::copy_n(prompts[3].begin(), 64, prompts[4].begin());
  std::vector<Reference> refs;
  for (auto& p : prompts) refs.push_back(run_alone(*model, p, steps));

  // The pool: 8 rows of up to 8 blocks of 16; each sequence's blocks drawn from a shuffled list.
  const int64_t n_blocks = 64;
  auto pool = model->make_kv_pool(n_blocks, 4, 8, 8);
  std::vector<int32_t> free_blocks(n_blocks - 1);
  std::iota(free_blocks.begin(), free_blocks.end(), 1);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  const int64_t n = int64_t(prompts.size());
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    const int64_t len = int64_t(prompts[size_t(s)].size()) + steps + 1, blocks = (len + 15) / 16;
    for (int64_t b = 0; b < blocks; ++b) {
      if (s == 4 && b < 4) {
        tables[4].push_back(tables[3][size_t(b)]);  // shares prompt 3's first 4 blocks
        continue;
      }
      tables[size_t(s)].push_back(free_blocks.back());
      free_blocks.pop_back();
    }
    pool->set_row(s, tables[size_t(s)]);
  }
  using Output = BatchEntry::Output;
  std::vector<int64_t> done(static_cast<size_t>(n), 0);// tokens of the sequence in the cache
  std::vector<int64_t> step(static_cast<size_t>(n), 0);// reference step of its next output
  auto all_tokens = [&](int64_t s) {
    std::vector<int32_t> t = prompts[size_t(s)];
    t.insert(t.end(), refs[size_t(s)].fed.begin(), refs[size_t(s)].fed.end());
    return t;
  };
  std::vector<std::vector<int32_t>> tokens;
  for (int64_t s = 0; s < n; ++s) tokens.push_back(all_tokens(s));
  done[4] = 64;  // its first 64 positions are prompt 3's, computed by sequence 3

  // Step plan: which sequences take part and how many tokens each feeds (0: sits out).
  // Sequence 4 waits for 3 to fill the shared blocks; 0 and 1 decode while 2 and 3 prefill in chunks.
  std::vector<std::vector<int64_t>> plan = {
      {3, 37, 40, 64, 0},  // 0 and 1 whole prompts, 2 and 3 first chunks
      {1, 1, 50, 6, 16},   // 2 and 3 finish, 4 from position 64 (16 tokens)
  };
  for (int64_t i = 0; i < steps; ++i) plan.push_back({1, 1, 1, 1, 1});  // 5 decoding: bucket 8
  for (int step_no = 0; step_no < int(plan.size()) + 2; ++step_no) {
    std::vector<int64_t> feed = step_no < int(plan.size()) ? plan[size_t(step_no)] : std::vector<int64_t>{0, 1, 1, 1, 0};
    std::vector<BatchEntry> entries;
    std::vector<int64_t> who;
    std::vector<std::vector<PenaltyToken>> seen(static_cast<size_t>(n));
    for (int64_t s = 0; s < n; ++s) {
      const int64_t k = std::min(feed[size_t(s)], int64_t(tokens[size_t(s)].size()) - done[size_t(s)]);
      if (k <= 0) continue;
      BatchEntry e;
      e.tokens = std::span<const int32_t>(tokens[size_t(s)]).subspan(size_t(done[size_t(s)]), size_t(k));
      e.pos0 = done[size_t(s)];
      e.row = s;
      const bool last_of_known = done[size_t(s)] + k >= int64_t(prompts[size_t(s)].size());
      e.output = !last_of_known ? Output::kNone : (s % 2 ? Output::kGreedy : Output::kLogits);
      // Sequence 3 picks greedily after penalties, sequence 2 draws after penalties.
      if (last_of_known && (s == 2 || s == 3)) {
        seen[size_t(s)] = penalty_tokens(tokens[size_t(s)], int64_t(prompts[size_t(s)].size()), e.pos0 + k);
        e.penalties = {s == 3 ? Penalties{1.3f, 0.5f, 0.2f} : Penalties{1.1f, 0.f, 0.4f}, seen[size_t(s)]};
        if (s == 2) {
          e.output = Output::kSample;
          e.sample.uniform = double(step[size_t(s)] % 7) / 7 + 0.05;
          e.sample.temperature = 0.8f;
          e.sample.top_k = 40;
        }
      }
      entries.push_back(e);
      who.push_back(s);
    }
    if (entries.empty()) continue;
    BatchOutput out;
    model->forward_batch(entries, *pool, out);
    size_t logits_at = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      const int64_t s = who[i];
      done[size_t(s)] += int64_t(entries[i].tokens.size());
      if (entries[i].output == Output::kNone) continue;
      const auto& want = refs[size_t(s)].logits[size_t(step[size_t(s)])];
      const std::string what = "sequence " + std::to_string(s) + " step " + std::to_string(step[size_t(s)]);
      if (entries[i].output == Output::kLogits) {
        std::vector<float> got(out.logits.begin() + int64_t(logits_at), out.logits.begin() + int64_t(logits_at) + vocab);
        logits_at += size_t(vocab);
        EXPECT_LE(relative_error(got, want), tolerance) << what;
      } else {
        std::vector<float> penalized = want;
        apply_penalties(penalized, entries[i].penalties.penalties, entries[i].penalties.tokens);
        if (entries[i].penalties.active()) {
          EXPECT_NE(penalized, want);
        }
        std::vector<float> work;
        std::vector<int32_t> order;
        const int32_t want_id =
            entries[i].output == Output::kSample
                ? sample_logits(penalized, entries[i].sample, work, order)
                : int32_t(std::max_element(penalized.begin(), penalized.end()) - penalized.begin());
        EXPECT_EQ(out.tokens[i], want_id) << what;
      }
      ++step[size_t(s)];
    }
  }
  for (int64_t s = 0; s < n; ++s) EXPECT_GE(step[size_t(s)], steps) << "sequence " << s << " did not run to the end";
  model->release_graphs(*pool);
}

TEST(BatchForward, CpuEqualsOneSequenceAtATime) {
  auto cpu = make_cpu_backend();
  // The CPU reference computes each row alone: the batch changes nothing but the order of work.
  check_batches(*cpu, 1e-6);
}

TEST(BatchForward, CudaEqualsOneSequenceAtATime) {
  std::unique_ptr<Backend> gpu;
  try {
    gpu = make_backend("cuda");
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();
  }
  // Batches of more than 8 rows take the GEMM kernels instead of the GEMVs, whose f16 rounding
  // of activations and summation order differ: the 16-bit tolerance.
  check_batches(*gpu, 2e-3);
}

}  // namespace
}  // namespace nibble
