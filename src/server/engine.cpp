#include "server/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <cstdlib>

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
  NIBBLE_CHECK(options_.max_model_len >= 2, "--max-model-len {} is too small", options_.max_model_len);
  const int64_t block = int64_t(1) << options_.block_size_log2;
  const int64_t per_seq = (options_.max_model_len + block - 1) / block;
  if (options_.kv_blocks == 0) options_.kv_blocks = per_seq * options_.max_num_seqs + 1;
  // As vLLM: one sequence of max_model_len must fit, or a long request could never run.
  NIBBLE_CHECK(options_.kv_blocks - 1 >= per_seq,
               "the KV cache holds {} blocks of {} positions ({} tokens), less than one sequence of "
               "--max-model-len {} needs ({} blocks): give the cache more memory (--gpu-memory-utilization or "
               "--kv-cache-memory-bytes) or lower --max-model-len",
               options_.kv_blocks - 1, block, (options_.kv_blocks - 1) * block, options_.max_model_len, per_seq);
  if (model_.n_sliding_layers() == 0) options_.sliding_blocks = 0;
  if (options_.sliding_blocks > 0) {
    window_ = model_.config().sliding_window;
    // A step writes up to max_num_batched_tokens positions of sliding blocks before it can drop
    // any, and each running sequence keeps its window: less than that could deadlock.
    const int64_t need = (options_.max_num_batched_tokens + block - 1) / block +
                         options_.max_num_seqs * ((window_ + block - 1) / block + 2);
    NIBBLE_CHECK(options_.sliding_blocks - 1 >= need, "the sliding-window layers' KV pool holds {} blocks; {} "
                 "sequences of window {} and steps of {} tokens need {}", options_.sliding_blocks - 1,
                 options_.max_num_seqs, window_, options_.max_num_batched_tokens, need);
    sliding_ = std::make_unique<BlockPool>(options_.sliding_blocks, block, options_.prefix_caching);
  }
  pool_ = model_.make_kv_pool(options_.kv_blocks, options_.block_size_log2, options_.max_num_seqs, per_seq,
                              options_.sliding_blocks);
  blocks_ = std::make_unique<BlockPool>(options_.kv_blocks, block, options_.prefix_caching);
  stats_.kv_blocks = blocks_->n_blocks();
  stats_.block_size = block;
  worker_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
  model_.release_graphs(*pool_);
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

// A sequence the engine has taken from the queue: its tokens and sampling (Sequence), its KV
// blocks and table row while running, and how far its KV goes.
struct Engine::Running {
  std::shared_ptr<EngineJob> job;
  std::unique_ptr<Sequence> seq;
  std::vector<int32_t> blocks;
  // Its blocks in the sliding-window layers' pool by logical block, 0 where the window has left.
  std::vector<int32_t> sliding;
  int64_t row = -1;
  int64_t computed = 0;    // positions whose K/V are in the blocks
  int64_t registered = 0;  // full blocks offered to the prefix cache
  int64_t generated = 0;
  bool admitted_once = false;
  std::chrono::steady_clock::time_point started;
};

void Engine::loop() {
  using Output = BatchEntry::Output;
  using Clock = std::chrono::steady_clock;
  const int64_t block = blocks_->block_size();
  std::vector<std::unique_ptr<Running>> running;   // in admission order
  std::deque<std::unique_ptr<Running>> preempted;  // wait ahead of the queue, oldest first
  // NIBBLE_ENGINE_TRACE=1: a line per step on stderr (sizes and times), for tuning.
  const bool trace = std::getenv("NIBBLE_ENGINE_TRACE") != nullptr;
  std::vector<int64_t> free_rows;
  for (int64_t r = options_.max_num_seqs; r-- > 0;) free_rows.push_back(r);

  auto release_sliding = [&](Running& r, size_t end) {  // logical blocks [0, end) of r.sliding
    std::vector<int32_t> held;
    for (size_t i = 0; i < end && i < r.sliding.size(); ++i)
      if (r.sliding[i]) held.push_back(std::exchange(r.sliding[i], 0));
    if (!held.empty()) sliding_->release(held);
  };
  auto release = [&](Running& r) {
    blocks_->release(r.blocks);
    r.blocks.clear();
    if (sliding_) {
      release_sliding(r, r.sliding.size());
      r.sliding.clear();
    }
    r.computed = r.registered = 0;
    if (r.row >= 0) free_rows.push_back(r.row);
    r.row = -1;
  };
  auto publish = [&] {
    std::lock_guard lock(mu_);
    stats_.running = int64_t(running.size());
    stats_.kv_blocks_used = blocks_->n_used();
  };
  // The blocks go back, and the metrics say so, before the client hears of the end.
  auto finish = [&](Running& r, EngineEvent end) {
    release(r);
    std::shared_ptr<EngineJob> job = std::move(r.job);  // r no longer counts as running
    {
      std::lock_guard lock(mu_);
      stats_.prompt_tokens += int64_t(job->request.prompt.size());
      stats_.generation_tokens += r.generated;
      (job->cancelled ? stats_.cancelled : stats_.finished) += 1;
      stats_.kv_blocks_used = blocks_->n_used();
      stats_.running = std::count_if(running.begin(), running.end(), [](const auto& x) { return x->job != nullptr; });
    }
    job->push(std::move(end));
  };
  auto error_event = [](std::string text) {
    EngineEvent e;
    e.kind = EngineEvent::kError;
    e.text = std::move(text);
    return e;
  };
  // Blocks for positions up to `end` (exclusive); false when the pool has too few free.
  auto ensure_blocks = [&](Running& r, int64_t end) {
    const int64_t need = (end + block - 1) / block - int64_t(r.blocks.size());
    if (need > 0 && !blocks_->allocate(need, r.blocks)) return false;
    pool_->set_row(r.row, r.blocks);
    if (sliding_) {  // every block the step writes, also in the sliding layers' pool
      const int64_t more = (end + block - 1) / block - int64_t(r.sliding.size());
      if (more > 0 && !sliding_->allocate(more, r.sliding)) return false;
      pool_->set_sliding_row(r.row, r.sliding);
    }
    return true;
  };
  // After r's K/V reach r.computed: its full blocks registered for prefix caching (in the sliding
  // pool under the same chain), and the sliding blocks no later query can see (all positions
  // before r.computed - window + 1) dropped.
  auto advance = [&](Running& r) {
    for (; r.registered + block <= r.computed; r.registered += block) {
      const int64_t i = r.registered / block;
      blocks_->cache_full_block(r.blocks, i, r.seq->tokens());
      if (sliding_ && r.sliding[size_t(i)]) {
        const int32_t b = r.blocks[size_t(i)];
        const auto chunk = std::span<const int32_t>(r.seq->tokens()).subspan(size_t(i * block), size_t(block));
        if (blocks_->hash_of(b)) sliding_->cache_block(r.sliding[size_t(i)], blocks_->hash_of(b),
                                                       blocks_->parent_hash_of(b), chunk);
      }
    }
    if (sliding_) {
      release_sliding(r, size_t(std::max<int64_t>(0, (r.computed - window_ + 1) / block)));
      pool_->set_sliding_row(r.row, r.sliding);
    }
  };
  auto preempt = [&](std::unique_ptr<Running> victim) {
    release(*victim);
    preempted.push_front(std::move(victim));
    std::lock_guard lock(mu_);
    ++stats_.preemptions;
    ++stats_.waiting;
  };

  while (true) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !running.empty() || !preempted.empty(); });
      if (stopping_) return;
    }
    const auto step_start = Clock::now();
    // Cancelled sequences leave first: their blocks are free for this step.
    for (auto& r : running)
      if (r->job->cancelled) finish(*r, error_event("cancelled"));
    std::erase_if(running, [](const auto& r) { return !r->job; });

    // 1. The running sequences, oldest first: a token each (or a prompt chunk).
    struct Scheduled {
      Running* r;
      int64_t n;
    };
    std::vector<Scheduled> batch;
    int64_t budget = options_.max_num_batched_tokens;
    bool preempted_now = false;
    for (size_t i = 0; i < running.size() && budget > 0; ++i) {
      Running& r = *running[i];
      const int64_t n = std::min(budget, int64_t(r.seq->tokens().size()) - r.computed);
      bool fits = ensure_blocks(r, r.computed + n);
      while (!fits && running.size() - 1 > i) {  // preempt the latest admitted
        preempt(std::move(running.back()));
        running.pop_back();
        preempted_now = true;
        fits = ensure_blocks(r, r.computed + n);
      }
      if (!fits) {  // r is the latest itself: it waits
        preempt(std::move(running[i]));
        running.pop_back();
        preempted_now = true;
        break;
      }
      batch.push_back({&r, n});
      budget -= n;
    }
    // 2. Waiting sequences (preempted ones first) while there is room, none was preempted in this
    // step and their blocks can be had.
    while (!preempted_now && budget > 0 && int64_t(running.size()) < options_.max_num_seqs) {
      std::unique_ptr<Running> r;
      if (!preempted.empty()) {
        r = std::move(preempted.front());
        preempted.pop_front();
      } else {
        std::lock_guard lock(mu_);
        if (queue_.empty()) break;
        r = std::make_unique<Running>();
        r->job = queue_.front();
        queue_.pop_front();
      }
      {
        std::lock_guard lock(mu_);
        --stats_.waiting;
      }
      if (r->job->cancelled) {
        finish(*r, error_event("cancelled"));
        continue;
      }
      if (!r->seq) {
        try {
          r->seq = std::make_unique<Sequence>(model_, tokenizer_, r->job->request);
          r->started = Clock::now();
        } catch (const std::exception& e) {
          finish(*r, error_event(e.what()));
          continue;
        }
        if (r->seq->done()) {  // nothing to generate (max_tokens 0)
          EngineEvent end;
          end.kind = EngineEvent::kDone;
          end.result = r->seq->result();
          finish(*r, std::move(end));
          continue;
        }
      }
      // The prefix cache: whole blocks, leaving at least the last token to compute (its logits).
      const auto& tokens = r->seq->tokens();
      r->blocks = blocks_->take_cached_prefix(tokens, int64_t(tokens.size()) - 1);
      if (sliding_) {
        // The hit goes only as far as the sliding layers' pool still holds the window before it:
        // the longest n whose blocks covering positions n·bs - window + 1 .. n·bs - 1 are cached.
        auto chunk = [&](size_t i) {
          return std::span<const int32_t>(tokens).subspan(i * size_t(block), size_t(block));
        };
        auto sliding_block = [&](size_t i) {
          const int32_t b = r->blocks[i];
          return sliding_->find_cached(blocks_->hash_of(b), blocks_->parent_hash_of(b), chunk(i));
        };
        size_t n = r->blocks.size();
        auto first_needed = [&](size_t n) {
          return size_t(std::max<int64_t>(0, (int64_t(n) * block - window_ + 1) / block));
        };
        while (n > 0) {
          bool all = true;
          for (size_t i = first_needed(n); i < n && all; ++i) all = sliding_block(i) >= 0;
          if (all) break;
          --n;
        }
        blocks_->release(std::span<const int32_t>(r->blocks).subspan(n));
        r->blocks.resize(n);
        r->sliding.assign(n, 0);
        for (size_t i = first_needed(n); i < n; ++i) {
          const int32_t b = r->blocks[i];
          r->sliding[i] = sliding_->take_cached(blocks_->hash_of(b), blocks_->parent_hash_of(b), chunk(i));
        }
      }
      r->computed = r->registered = int64_t(r->blocks.size()) * block;
      if (!r->admitted_once) r->seq->result().cached_tokens = r->computed;
      r->row = free_rows.back();
      free_rows.pop_back();
      const int64_t n = std::min(budget, int64_t(tokens.size()) - r->computed);
      if (!ensure_blocks(*r, r->computed + n)) {  // no room yet: back to the head of the line
        release(*r);
        {
          std::lock_guard lock(mu_);
          ++stats_.waiting;
        }
        preempted.push_front(std::move(r));
        break;
      }
      r->admitted_once = true;
      {
        std::lock_guard lock(mu_);
        stats_.prefix_queried_tokens += int64_t(tokens.size());
        stats_.prefix_hit_tokens += r->computed;
      }
      batch.push_back({r.get(), n});
      budget -= n;
      running.push_back(std::move(r));
    }
    publish();
    if (batch.empty()) {
      // Nothing could run: only possible while waiting for a cancelled job's turn to be seen.
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(5));
      continue;
    }

    // 3. One forward over the batch.
    std::vector<BatchEntry> entries;
    for (const Scheduled& s : batch) {
      Running& r = *s.r;
      BatchEntry e;
      e.tokens = std::span<const int32_t>(r.seq->tokens()).subspan(size_t(r.computed), size_t(s.n));
      e.pos0 = r.computed;
      e.row = r.row;
      const bool last = r.computed + s.n == int64_t(r.seq->tokens().size());
      e.output = last ? r.seq->pick() : Output::kNone;
      if (e.output == Output::kSample) e.sample = r.seq->next_sample_inputs();
      if (e.output == Output::kGreedy || e.output == Output::kSample) e.penalties = r.seq->penalties();
      entries.push_back(e);
    }
    BatchOutput out;
    const auto t0 = Clock::now();
    try {
      model_.forward_batch(entries, *pool_, out);
    } catch (const std::exception& e) {
      for (const Scheduled& s : batch) finish(*s.r, error_event(e.what()));
      std::erase_if(running, [](const auto& r) { return !r->job; });
      publish();
      continue;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (trace) {
      int64_t n_tokens = 0, n_decode = 0;
      for (const Scheduled& sc : batch) {
        n_tokens += sc.n;
        n_decode += sc.n == 1;
      }
      fmt::print(stderr, "engine step: {} sequences ({} decoding), {} tokens, scheduled in {:.3f} ms, forward {:.3f} ms\n",
                 batch.size(), n_decode, n_tokens, std::chrono::duration<double, std::milli>(t0 - step_start).count(),
                 1e3 * seconds);
    }
    {
      std::lock_guard lock(mu_);
      ++stats_.steps;
      stats_.forward_seconds += seconds;
    }

    // 4. Results: new tokens to the clients, full blocks to the prefix cache.
    size_t logits_at = 0;
    const int64_t vocab = model_.config().vocab_size;
    for (size_t i = 0; i < batch.size(); ++i) {
      Running& r = *batch[i].r;
      const bool prefill = r.computed < r.seq->n_prompt();
      r.computed += batch[i].n;
      advance(r);
      (prefill ? r.seq->result().prefill_seconds : r.seq->result().decode_seconds) += seconds;
      if (entries[i].output == Output::kNone) continue;
      std::span<const float> logits;
      if (entries[i].output == Output::kLogits) {
        logits = std::span<const float>(out.logits).subspan(logits_at, size_t(vocab));
        logits_at += size_t(vocab);
      }
      r.seq->accept(out.tokens[i], logits, [&](const GeneratedToken& t, std::string_view text) {
        if (t.id >= 0) ++r.generated;
        EngineEvent e;
        e.token = t;
        e.text = std::string(text);
        r.job->push(std::move(e));
      });
      if (r.seq->done()) {
        EngineEvent end;
        end.kind = EngineEvent::kDone;
        end.result = r.seq->result();
        finish(r, std::move(end));
      }
    }
    std::erase_if(running, [](const auto& r) { return !r->job; });
    publish();
    std::lock_guard lock(mu_);
    stats_.step_seconds += std::chrono::duration<double>(Clock::now() - step_start).count();
  }
}

}  // namespace nibble
