#include "server/engine.h"

#include "core/status.h"

namespace nibble {
std::optional<EngineEvent> EngineJob::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  EngineEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void EngineJob::push(EngineEvent e) {
  {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_one();
}

Engine::Engine(Model& model, const Tokenizer& tokenizer, EngineOptions options)
    : model_(model), tokenizer_(tokenizer), options_(options) {
  NIBBLE_CHECK(options_.max_num_seqs >= 1, "--max-num-seqs must be at least 1");
  NIBBLE_CHECK(options_.max_num_batched_tokens >= 1, "--max-num-batched-tokens must be at least 1");
  worker_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

std::shared_ptr<EngineJob> Engine::submit(GenerateRequest request) {
  auto job = std::make_shared<EngineJob>(std::move(request));
  {
    std::lock_guard lock(mu_);
    queue_.push_back(job);
    ++stats_.waiting;
  }
  cv_.notify_one();
  return job;
}

EngineStats Engine::stats() {
  std::lock_guard lock(mu_);
  return stats_;
}

namespace {
struct Running {
  std::shared_ptr<EngineJob> job;
  std::unique_ptr<Generation> gen;
  int64_t generated = 0;
};
}  // namespace

void Engine::loop() {
  std::vector<Running> running;
  auto finish = [&](Running& r, EngineEvent end) {
    {
      std::lock_guard lock(mu_);
      stats_.prompt_tokens += int64_t(r.job->request.prompt.size());
      stats_.generation_tokens += r.generated;
      (r.job->cancelled ? stats_.cancelled : stats_.finished) += 1;
    }
    r.gen.reset();  // frees the KV cache before the client hears of the end
    r.job->push(std::move(end));
  };
  auto error_event = [](std::string text) {
    EngineEvent e;
    e.kind = EngineEvent::kError;
    e.text = std::move(text);
    return e;
  };
  while (true) {
    // Admit queued jobs while there is room.
    std::vector<std::shared_ptr<EngineJob>> admitted;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !running.empty(); });
      if (stopping_) return;
      while (int64_t(running.size() + admitted.size()) < options_.max_num_seqs && !queue_.empty()) {
        admitted.push_back(queue_.front());
        queue_.pop_front();
        --stats_.waiting;
      }
    }
    for (size_t i = 0; i < admitted.size(); ++i) {
      Running r{admitted[i], nullptr, 0};
      if (r.job->cancelled) {
        finish(r, error_event("cancelled"));
        continue;
      }
      try {
        r.gen = std::make_unique<Generation>(model_, tokenizer_, r.job->request);
        running.push_back(std::move(r));
      } catch (const std::exception& e) {
        if (!running.empty()) {  // likely out of KV memory: wait for a running sequence to end
          std::lock_guard lock(mu_);
          for (size_t j = admitted.size(); j-- > i;) {
            queue_.push_front(admitted[j]);
            ++stats_.waiting;
          }
          break;
        }
        finish(r, error_event(e.what()));
      }
    }
    {
      std::lock_guard lock(mu_);
      stats_.running = int64_t(running.size());
    }
    // One engine step: a token for each decoding sequence, then prompt chunks with the rest of
    // the token budget, oldest first.
    int64_t budget = options_.max_num_batched_tokens;
    auto step = [&](Running& r, int64_t max_prefill) {
      try {
        r.gen->step(
            [&](const GeneratedToken& t, std::string_view text) {
              if (t.id >= 0) ++r.generated;
              EngineEvent e;
              e.token = t;
              e.text = std::string(text);
              r.job->push(std::move(e));
            },
            max_prefill);
      } catch (const std::exception& e) {
        finish(r, error_event(e.what()));
      }
    };
    for (Running& r : running)
      if (r.gen && r.gen->prompt_remaining() == 0 && !r.gen->done()) {
        if (r.job->cancelled) {
          finish(r, error_event("cancelled"));
          continue;
        }
        step(r, 0);
        --budget;
      }
    for (Running& r : running)
      if (r.gen && r.gen->prompt_remaining() > 0) {
        if (r.job->cancelled) {
          finish(r, error_event("cancelled"));
          continue;
        }
        if (budget <= 0) break;
        const int64_t chunk = std::min(budget, r.gen->prompt_remaining());
        step(r, chunk);
        budget -= chunk;
      }
    for (Running& r : running)
      if (r.gen && r.gen->done()) {
        EngineEvent end;
        end.kind = EngineEvent::kDone;
        end.result = r.gen->result();
        finish(r, std::move(end));
      }
    std::erase_if(running, [](const Running& r) { return !r.gen; });
    {
      std::lock_guard lock(mu_);
      stats_.running = int64_t(running.size());
    }
  }
}

}  // namespace nibble
