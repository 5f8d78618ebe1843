// The engine with gpt-oss's sliding-window layers in a KV pool of their own (EngineOptions::
// sliding_blocks): sequences keep there only the blocks their windows reach. Greedy outputs must
// be those of the engine that keeps every position of every layer, with prompts sharing a prefix
// (prefix-cache hits that need the window's blocks), a main pool small enough to preempt, a
// sliding pool at its minimum, and both pools whole again at the end.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/model.h"
#include "server/engine.h"

namespace nibble {
namespace {

const std::string kDir = std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-gpt-oss-mxfp4";

// The prompts' greedy continuations; `waves` submits them one after another (each waits for the
// one before), else all at once.
std::vector<std::vector<int32_t>> run_all(Model& model, const Tokenizer& tok, EngineOptions o,
                                          const std::vector<std::vector<int32_t>>& prompts, EngineStats* stats,
                                          bool waves = false) {
  auto request = [&](const std::vector<int32_t>& p) {
    GenerateRequest r;
    r.prompt = p;
    r.max_new_tokens = 40;
    r.max_context = o.max_model_len;
    r.sampling.temperature = 0;
    return r;
  };
  if (waves) {
    Engine engine(model, tok, o);
    std::vector<std::vector<int32_t>> out;
    for (const auto& p : prompts) {
      auto job = engine.submit(request(p));
      while (auto e = job->next(std::chrono::milliseconds(60000))) {
        if (e->kind == EngineEvent::kToken) continue;
        EXPECT_EQ(e->kind, EngineEvent::kDone) << e->text;
        out.push_back(e->result.ids);
        break;
      }
    }
    *stats = engine.stats();
    return out;
  }
  Engine engine(model, tok, o);
  std::vector<std::shared_ptr<EngineJob>> jobs;
  for (const auto& p : prompts) jobs.push_back(engine.submit(request(p)));
  std::vector<std::vector<int32_t>> out;
  for (auto& job : jobs) {
    while (true) {
      auto e = job->next(std::chrono::milliseconds(60000));
      if (!e) {
        ADD_FAILURE() << "no event for a minute";
        return out;
      }
      if (e->kind == EngineEvent::kError) {
        ADD_FAILURE() << e->text;
        out.emplace_back();
        break;
      }
      if (e->kind == EngineEvent::kDone) {
        out.push_back(e->result.ids);
        break;
      }
    }
  }
  // The last job's done event comes after its blocks went back.
  *stats = engine.stats();
  return out;
}

TEST(EngineSlidingPool, SameTokensAsKeepingEveryPosition) {
  auto backend = make_cpu_backend();
  auto model = load_model(kDir, *backend);
  model->set_kv_dtype(DType::F32);
  Tokenizer tok = Tokenizer::from_file(kDir + "/tokenizer.json");
  // Six prompts of 100 to 180 tokens; 2..5 start with prompt 0's first 96 tokens (six blocks).
  std::vector<std::vector<int32_t>> prompts;
  for (int s = 0; s < 6; ++s) {
    std::vector<int32_t> p;
    for (int i = 0; i < 100 + 16 * s; ++i) p.push_back(int32_t((i * 131 + s * 977 + 7) % 380));
    prompts.push_back(p);
  }
  for (int s = 2; s < 6; ++s) std::copy_n(prompts[0].begin(), 96, prompts[size_t(s)].begin());
  EngineOptions full;
  full.max_num_seqs = 3;
  full.max_num_batched_tokens = 64;
  full.max_model_len = 256;  // prompts up to 180 + 40 new tokens
  EngineStats full_stats, sliding_stats;
  const auto want = run_all(*model, tok, full, prompts, &full_stats);

  EngineOptions sliding = full;
  // The minimum: a step's 4 blocks and 3 sequences' windows (1 block of 16 for window 5, + 2).
  sliding.sliding_blocks = 1 + 4 + 3 * 3;
  sliding.kv_blocks = 1 + 18;  // 3 sequences of up to 220 positions need up to 42: preemptions
  const auto got = run_all(*model, tok, sliding, prompts, &sliding_stats);
  ASSERT_EQ(got.size(), want.size());
  for (size_t s = 0; s < want.size(); ++s) EXPECT_EQ(got[s], want[s]) << "prompt " << s;
  EXPECT_GT(sliding_stats.prefix_hit_tokens, 0);
  EXPECT_GT(sliding_stats.preemptions, 0);
  EXPECT_EQ(sliding_stats.kv_blocks_used, 0);

  // One after another with a main pool that keeps every prefix but a sliding pool at its minimum:
  // prompt 0 again after the others is a full hit in the main pool whose window blocks the
  // sliding pool no longer has, so the hit must shrink to where it has them.
  std::vector<std::vector<int32_t>> waves = {prompts[0], prompts[1], prompts[3], prompts[4], prompts[0]};
  EngineStats a, b;
  EngineOptions keep_all = sliding;
  keep_all.kv_blocks = 0;  // every sequence at max_model_len, with room to spare for cached prefixes
  keep_all.kv_blocks = 1 + 3 * 16 * 4;
  const auto want_waves = run_all(*model, tok, full, waves, &a, true);
  const auto got_waves = run_all(*model, tok, keep_all, waves, &b, true);
  ASSERT_EQ(got_waves.size(), want_waves.size());
  for (size_t s = 0; s < want_waves.size(); ++s) EXPECT_EQ(got_waves[s], want_waves[s]) << "wave " << s;
  EXPECT_LT(b.prefix_hit_tokens, a.prefix_hit_tokens) << "the window's blocks were still there: no shrunk hit";

  // Too small a sliding pool is refused at start.
  EngineOptions tiny = sliding;
  tiny.sliding_blocks = 8;
  EXPECT_THROW(Engine(*model, tok, tiny), Error);
}

}  // namespace
}  // namespace nibble
