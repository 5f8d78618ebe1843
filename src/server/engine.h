// The serving engine: one worker thread owns the model and runs the generations; HTTP threads
// submit jobs and read their events (tokens, then done or an error). A job whose client went
// away is cancelled: skipped if still queued, stopped at its next step if running, its KV cache
// freed at once.
//
// Scheduling follows vLLM v1's rule: up to max_num_seqs sequences run at once; each engine step
// gives every decoding sequence one token, then spends what is left of max_num_batched_tokens on
// prompt chunks of the others in arrival order (chunked prefill), so a new request starts while
// long ones are still generating. A sequence whose KV cache cannot be allocated waits until a
// running one finishes. The model still runs the sequences of a step one after the other: a
// batched forward over them is the next step.
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
#include "runtime/generate.h"
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
};

struct EngineOptions {
  int64_t max_num_seqs = 8;               // sequences running at once
  int64_t max_num_batched_tokens = 2048;  // tokens per engine step (decode tokens + prompt chunks)
};

class Engine {
 public:
  Engine(Model& model, const Tokenizer& tokenizer, EngineOptions options = {});
  ~Engine();
  std::shared_ptr<EngineJob> submit(GenerateRequest request);
  EngineStats stats();

 private:
  void loop();
  Model& model_;
  const Tokenizer& tokenizer_;
  EngineOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<EngineJob>> queue_;
  EngineStats stats_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace nibble
