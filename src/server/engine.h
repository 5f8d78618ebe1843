// The serving engine: one worker thread owns the model and runs queued generations; HTTP threads
// submit jobs and read their events (tokens, then done or an error). A job whose client went
// away is cancelled: skipped if still queued, stopped at its next token if running.
//
// Today the worker runs one sequence at a time, first come first served (no continuous batching
// or shared paged KV cache yet: the model's forward takes one sequence).
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
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();

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

class Engine {
 public:
  Engine(Model& model, const Tokenizer& tokenizer);
  ~Engine();
  std::shared_ptr<EngineJob> submit(GenerateRequest request);
  EngineStats stats();

 private:
  void loop();
  Model& model_;
  const Tokenizer& tokenizer_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<EngineJob>> queue_;
  EngineStats stats_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace nibble
