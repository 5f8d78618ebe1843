#include "server/engine.h"

namespace nibble {
namespace {
struct Cancelled {};
}  // namespace

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

Engine::Engine(Model& model, const Tokenizer& tokenizer) : model_(model), tokenizer_(tokenizer) {
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

void Engine::loop() {
  while (true) {
    std::shared_ptr<EngineJob> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      job = queue_.front();
      queue_.pop_front();
      --stats_.waiting;
      ++stats_.running;
    }
    EngineEvent end;
    int64_t generated = 0;
    try {
      if (job->cancelled) throw Cancelled{};
      end.result = generate(model_, tokenizer_, job->request, [&](const GeneratedToken& t, std::string_view text) {
        if (job->cancelled) throw Cancelled{};
        if (t.id >= 0) ++generated;
        EngineEvent e;
        e.token = t;
        e.text = std::string(text);
        job->push(std::move(e));
      });
      end.kind = EngineEvent::kDone;
    } catch (const Cancelled&) {
      end.kind = EngineEvent::kError;
      end.text = "cancelled";
    } catch (const std::exception& e) {
      end.kind = EngineEvent::kError;
      end.text = e.what();
    }
    {
      std::lock_guard lock(mu_);
      --stats_.running;
      stats_.prompt_tokens += int64_t(job->request.prompt.size());
      stats_.generation_tokens += generated;
      (job->cancelled ? stats_.cancelled : stats_.finished) += 1;
    }
    job->push(std::move(end));
  }
}

}  // namespace nibble
