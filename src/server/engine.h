// The serving engine: one worker thread owns the model and runs the sequences; HTTP threads
// submit jobs and read their events (tokens, then done or an error). A job whose client went
// away is cancelled: skipped if still queued, dropped before the next step if running, its KV
// blocks returned to the pool at once.
//
// Scheduling follows vLLM v1: up to max_num_seqs sequences run at once; each step spends at most
// max_num_batched_tokens tokens, first on the running sequences in arrival order (a decoding one
// takes one token, one still in its prompt a chunk of it), then on admitting waiting requests
// (chunked prefill). All of a step's sequences go through the model as one batch
// (Model::forward_batch), so the weights are read once per step, not once per sequence.
// KV memory is one paged pool (KvPool) handed out in blocks (BlockPool): a new request first
// takes the cached blocks that already hold its prompt's prefix (prefix caching), and when a
// running sequence needs a block and none is free, the latest-admitted sequence is preempted: its
// blocks go back to the pool and it waits at the head of the queue to be recomputed (its blocks
// often still cached), its output so far kept.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "model/model.h"
#include "runtime/block_pool.h"
#include "runtime/generate.h"
#include "runtime/kv_pool.h"
#include "tokenizer/tokenizer.h"

namespace nibble {

struct EngineEvent {
  enum Kind { kToken, kDone, kError };
  Kind kind = kToken;
  GeneratedToken token;
  std::string text;       // kToken: newly visible text; kError: the message
  GenerateResult result;  // kDone
};

class EngineJob {
 public:
  explicit EngineJob(GenerateRequest r) : request(std::move(r)) {}
  // The next event, or nullopt after `timeout` without one.
  std::optional<EngineEvent> next(std::chrono::milliseconds timeout);
  void cancel() { cancelled = true; }

  const GenerateRequest request;
  std::atomic<bool> cancelled{false};

 private:
  friend class Engine;
  void push(EngineEvent e);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
};

struct EngineStats {
  int64_t waiting = 0, running = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0, cancelled = 0, finished = 0;
  int64_t kv_blocks = 0, kv_blocks_used = 0, block_size = 0;
  int64_t prefix_queried_tokens = 0, prefix_hit_tokens = 0, preemptions = 0, steps = 0;
  double forward_seconds = 0, step_seconds = 0;  // in Model::forward_batch; in whole engine steps
};

struct EngineOptions {
  int64_t max_num_seqs = 8;               // sequences running at once
  int64_t max_num_batched_tokens = 2048;  // tokens per engine step (decode tokens + prompt chunks)
  int64_t max_model_len = 4096;           // positions per sequence
  int64_t kv_blocks = 0;                  // blocks in the pool (0: enough for every sequence at max_model_len)
  // Blocks of the sliding-window layers' own pool (models with such layers; 0: they share the
  // main pool and keep every position). Sequences hold there only what their windows reach.
  int64_t sliding_blocks = 0;
  int block_size_log2 = 4;                // 16 positions per block
  bool prefix_caching = true;
};

class Engine {
 public:
  Engine(Model& model, const Tokenizer& tokenizer, EngineOptions options = {});
  ~Engine();
  std::shared_ptr<EngineJob> submit(GenerateRequest request);
  EngineStats stats();

 private:
  struct Running;
  void loop();
  Model& model_;
  const Tokenizer& tokenizer_;
  EngineOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<EngineJob>> queue_;
  EngineStats stats_;
  std::unique_ptr<KvPool> pool_;
  std::unique_ptr<BlockPool> blocks_;
  std::unique_ptr<BlockPool> sliding_;  // the sliding-window layers' blocks, when they have a pool
  int64_t window_ = 0;                  // their window in positions
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace nibble
