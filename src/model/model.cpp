#include <algorithm>
#include <bit>
#include <initializer_list>

#include "core/status.h"
#include "model/model.h"

namespace nibble {
namespace {
// Batch sizes decode steps are recorded for (vLLM's capture sizes): 1, 2, 4, 8, then steps of 8.
int64_t batch_bucket(int64_t n) { return n <= 8 ? int64_t(std::bit_ceil(uint64_t(n))) : (n + 7) / 8 * 8; }
// A decode step's attention work is sized by its context bucket (a power of two, at least 256),
// eager or recorded, so both run the same kernels with the same splits and give the same bits.
int64_t context_bucket(int64_t context, int64_t limit) {
  return std::min<int64_t>(limit, std::max<int64_t>(256, int64_t(std::bit_ceil(uint64_t(context)))));
}
// A recorded step's key from its parts (splitmix64 over each).
uint64_t graph_key(std::initializer_list<uint64_t> parts) {
  uint64_t h = 0;
  for (uint64_t p : parts) {
    h ^= p + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}
}  // namespace

void Model::forward(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits,
                    std::vector<float>& logits) {
  run(tokens, pos0, kv, all_logits, &logits, nullptr, nullptr);
}

int32_t Model::forward_greedy(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv,
                              const TokenPenalties& penalties) {
  int32_t id = -1;
  run(tokens, pos0, kv, false, nullptr, nullptr, &id, penalties.active() ? &penalties : nullptr);
  return id;
}

int32_t Model::forward_sample(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, const SampleInputs& in,
                              const TokenPenalties& penalties) {
  int32_t id = -1;
  run(tokens, pos0, kv, false, nullptr, &in, &id, penalties.active() ? &penalties : nullptr);
  return id;
}

void Model::penalize(float* logits, std::span<const std::pair<int64_t, const TokenPenalties*>> rows) {
  if (rows.empty()) return;
  std::vector<PenaltyRow> table;
  std::vector<PenaltyToken> flat;
  for (auto [row, p] : rows) {
    table.push_back({row, int64_t(flat.size()), int64_t(p->tokens.size()), p->penalties});
    flat.insert(flat.end(), p->tokens.begin(), p->tokens.end());
  }
  auto fit = [&](Buffer& b, size_t bytes) {
    if (b.bytes() < bytes) b = Buffer(backend_, std::max(bytes, 2 * b.bytes()));
  };
  fit(penalty_rows_, table.size() * sizeof(PenaltyRow));
  fit(penalty_tokens_, std::max<size_t>(1, flat.size()) * sizeof(PenaltyToken));
  backend_.copy_to_backend(penalty_rows_.data(), table.data(), table.size() * sizeof(PenaltyRow));
  if (!flat.empty()) backend_.copy_to_backend(penalty_tokens_.data(), flat.data(), flat.size() * sizeof(PenaltyToken));
  backend_.apply_penalties(logits, config_.vocab_size, penalty_rows_.data<PenaltyRow>(), int64_t(table.size()),
                           penalty_tokens_.data<PenaltyToken>());
}

void Model::run(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits,
                std::vector<float>* logits, const SampleInputs* sample, int32_t* token_id,
                const TokenPenalties* penalties) {
  const int64_t T = int64_t(tokens.size()), vocab = config_.vocab_size;
  NIBBLE_CHECK(T > 0, "forward: no tokens");
  NIBBLE_CHECK(pos0 >= 0 && pos0 + T <= kv.max_tokens(), "sequence of {} tokens does not fit the "
               "context of {} tokens", pos0 + T, kv.max_tokens());
  for (int32_t id : tokens)
    NIBBLE_CHECK(id >= 0 && id < vocab, "token id {} is outside the vocabulary (0..{})", id, vocab - 1);
  if (T > kv.max_chunk()) {
    // A ring cache (sliding-window layers, KvCache) holds the window and one chunk of new tokens:
    // longer inputs go a chunk at a time; only the last picks a token or returns the last logits.
    std::vector<float> part;
    if (logits) logits->clear();
    for (int64_t t0 = 0; t0 < T; t0 += kv.max_chunk()) {
      const int64_t n = std::min(kv.max_chunk(), T - t0);
      const bool last = t0 + n == T;
      std::vector<float>* out = all_logits || last ? (logits ? &part : nullptr) : nullptr;
      run(tokens.subspan(size_t(t0), size_t(n)), pos0 + t0, kv, all_logits, out, last ? sample : nullptr,
          last ? token_id : nullptr, last ? penalties : nullptr);
      if (out) logits->insert(logits->end(), part.begin(), part.end());
    }
    return;
  }
  chain_pos_ = -1;  // a queued chain cannot continue past another step
  std::vector<int32_t> positions(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = int32_t(pos0 + t);
  const int64_t rows = all_logits ? T : 1;
  if (logits) logits->resize(size_t(rows * vocab));

  const int64_t bucket = context_bucket(pos0 + 1, kv.max_tokens());
  if (T > 1 || !use_graphs_ || tracer_ || !backend_.supports_graphs()) {
    Buffer ids(backend_, size_t(T) * 4), pos(backend_, size_t(T) * 4);
    Buffer out(backend_, size_t(rows * vocab) * 4);
    backend_.copy_to_backend(ids.data(), tokens.data(), size_t(T) * 4);
    backend_.copy_to_backend(pos.data(), positions.data(), size_t(T) * 4);
    Step step{ids.data<int32_t>(), pos.data<int32_t>(), T, T == 1 ? bucket : pos0 + T, all_logits, out.data()};
    step.cache = &kv;
    compute(step);
    if (token_id) {
      // A picked token means the last token's logits only: one row.
      Buffer id(backend_, 4), in(backend_, sizeof(SampleInputs));
      const std::pair<int64_t, const TokenPenalties*> row{0, penalties};
      if (penalties) penalize(out.data(), {&row, 1});
      if (sample) {
        backend_.copy_to_backend(in.data(), sample, sizeof(SampleInputs));
        backend_.sample(out.data(), vocab, in.data<SampleInputs>(), id.data<int32_t>());
      } else {
        backend_.argmax(out.data(), 1, vocab, id.data<int32_t>());
      }
      backend_.copy_to_host(token_id, id.data(), 4);
    } else if (logits) {
      backend_.copy_to_host(logits->data(), out.data(), logits->size() * 4);
    }
    return;
  }
  // Decode: the inputs go to fixed buffers, and the step runs as the graph recorded for this
  // cache and context bucket (so a 16K context records ~8 graphs).
  ensure_decode_buffers();
  backend_.copy_to_backend(decode_ids_.data(), tokens.data(), 4);
  backend_.copy_to_backend(decode_positions_.data(), positions.data(), 4);
  if (sample) backend_.copy_to_backend(decode_sample_.data(), sample, sizeof(SampleInputs));
  // Penalties (whose token list grows every step) run after the logits graph, then the pick.
  replay_decode(kv, bucket, token_id && !penalties, sample != nullptr);
  if (penalties) {
    const std::pair<int64_t, const TokenPenalties*> row{0, penalties};
    penalize(decode_logits_.data(), {&row, 1});
    pick_decode(sample != nullptr);
  }
  if (token_id)
    backend_.copy_to_host(token_id, decode_token_.data(), 4);
  else
    backend_.copy_to_host(logits->data(), decode_logits_.data(), size_t(config_.vocab_size) * 4);
}

void Model::ensure_decode_buffers() {
  if (decode_ids_.data()) return;
  decode_ids_ = Buffer(backend_, 4);
  decode_positions_ = Buffer(backend_, 4);
  decode_logits_ = Buffer(backend_, size_t(config_.vocab_size) * 4);
  decode_token_ = Buffer(backend_, 4);
  decode_sample_ = Buffer(backend_, sizeof(SampleInputs));
}

void Model::pick_decode(bool sample) {
  if (sample)
    backend_.sample(decode_logits_.data(), config_.vocab_size, decode_sample_.data<SampleInputs>(),
                    decode_token_.data<int32_t>());
  else
    backend_.argmax(decode_logits_.data(), 1, config_.vocab_size, decode_token_.data<int32_t>());
}

void Model::replay_decode(KvCache& kv, int64_t bucket, bool pick, bool sample) {
  Step step{decode_ids_.data<int32_t>(), decode_positions_.data<int32_t>(), 1, bucket, false, decode_logits_.data()};
  step.cache = &kv;
  // Greedy and sampled steps record the pick too, and the next step's inputs from it: graphs of
  // their own. The draw's parameters are read from device memory, so one graph serves every
  // request's.
  const uint64_t key = (id_ << 48) ^ (kv.id() << 24) ^ uint64_t(bucket) ^ (pick ? uint64_t(sample ? 2 : 1) << 46 : 0);
  const Step::Pick greedy{decode_token_.data<int32_t>(), decode_ids_.data<int32_t>(), decode_positions_.data<int32_t>()};
  if (pick && !sample) step.pick = &greedy;  // the head may pick (project_logits)
  record_or_replay(key, [&] {
    step.picked = false;
    compute(step);
    if (!pick) return;
    if (sample) {
      pick_decode(true);
      backend_.advance_decode(decode_token_.data<int32_t>(), 1, decode_ids_.data<int32_t>(),
                              decode_positions_.data<int32_t>());
    } else if (!step.picked) {
      backend_.argmax_advance_decode(decode_logits_.data(), 1, config_.vocab_size, decode_token_.data<int32_t>(),
                                     decode_ids_.data<int32_t>(), decode_positions_.data<int32_t>());
    }
  }, graph_keys_[kv.id()]);
}

bool Model::decode_room(const KvCache& kv) const {
  const auto mine = std::count_if(decode_queue_.begin(), decode_queue_.end(),
                                  [&](const QueuedDecode& q) { return q.kv == kv.id(); });
  return int64_t(decode_queue_.size()) < Backend::kMailboxSlots && mine < kDecodeQueue;
}

void Model::decode_enqueue(int32_t token, int64_t pos0, KvCache& kv, const SampleInputs* sample) {
  const int64_t vocab = config_.vocab_size;
  NIBBLE_CHECK(decode_room(kv), "decode_enqueue: {} steps are queued already", decode_queue_.size());
  NIBBLE_CHECK(token < vocab, "token id {} is outside the vocabulary (0..{})", token, vocab - 1);
  NIBBLE_CHECK(pos0 >= 0 && pos0 < kv.max_tokens(), "sequence of {} tokens does not fit the context of {} tokens",
               pos0 + 1, kv.max_tokens());
  const bool chained = token < 0;
  NIBBLE_CHECK(!chained || decode_can_chain(kv, pos0),
               "decode_enqueue: a step on the previous step's token must follow it (position {}, over the same cache)",
               pos0);
  if (!pipeline_decode_ || !use_graphs_ || tracer_ || !backend_.supports_graphs()) {
    // Each step runs now; the chained token is the one the last step returned.
    const int32_t in = chained ? chain_token_ : token;
    const int32_t id = sample ? forward_sample({&in, 1}, pos0, kv, *sample) : forward_greedy({&in, 1}, pos0, kv);
    decode_queue_.push_back({kv.id(), -1, id});
    chain_token_ = id;
  } else {
    ensure_decode_buffers();
    if (!chained) {  // a fresh chain: its first inputs from the host (in order after queued steps)
      const int32_t position = int32_t(pos0);
      backend_.copy_to_backend(decode_ids_.data(), &token, 4);
      backend_.copy_to_backend(decode_positions_.data(), &position, 4);
    }
    // In order after the queued steps, which may still be reading the last draw's inputs.
    if (sample) backend_.copy_to_backend_queued(decode_sample_.data(), sample, sizeof(SampleInputs));
    replay_decode(kv, context_bucket(pos0 + 1, kv.max_tokens()), true, sample != nullptr);
    int slot = 0;  // the first mailbox slot no queued step holds (decode_room: there is one)
    while (std::any_of(decode_queue_.begin(), decode_queue_.end(), [&](const QueuedDecode& q) { return q.slot == slot; }))
      ++slot;
    backend_.post_ints(slot, decode_token_.data<int32_t>(), 1);
    decode_queue_.push_back({kv.id(), slot, -1});
  }
  chain_kv_ = kv.id();
  chain_pos_ = pos0;
}

int32_t Model::decode_take(const KvCache& kv) {
  auto it = std::find_if(decode_queue_.begin(), decode_queue_.end(), [&](const QueuedDecode& q) { return q.kv == kv.id(); });
  NIBBLE_CHECK(it != decode_queue_.end(), "decode_take: no decode step is queued over this cache");
  const QueuedDecode q = *it;
  decode_queue_.erase(it);
  if (q.slot < 0) return q.token;
  int32_t id = -1;
  backend_.take_ints(q.slot, &id, 1);
  return id;
}

bool Model::record_or_replay(uint64_t key, const std::function<void()>& ops, std::vector<uint64_t>& keys) {
  if (backend_.replay(key)) return true;
  // A first recording can fail for a passing reason (a table built on first use); a key that
  // failed twice runs uncaptured from then on.
  const bool give_up = std::count(capture_failures_.begin(), capture_failures_.end(), key) >= 2;
  if (!give_up) {
    backend_.begin_capture(key);
    ops();
    if (backend_.end_capture(key)) {
      keys.push_back(key);
      backend_.replay(key);
      return true;
    }
    capture_failures_.push_back(key);
  }
  ops();
  return false;
}

void Model::release_graphs(const KvCache& kv) {
  auto it = graph_keys_.find(kv.id());
  if (it == graph_keys_.end()) return;
  for (uint64_t key : it->second) backend_.drop_graph(key);
  graph_keys_.erase(it);
}

void Model::release_graphs(const KvPool& pool) {
  auto it = pool_graph_keys_.find(pool.id());
  if (it == pool_graph_keys_.end()) return;
  for (uint64_t key : it->second) backend_.drop_graph(key);
  pool_graph_keys_.erase(it);
}


void Model::forward_batch(std::span<const BatchEntry> entries, KvPool& pool, BatchOutput& out) {
  using Output = BatchEntry::Output;
  const int64_t vocab = config_.vocab_size;
  NIBBLE_CHECK(!entries.empty(), "forward: an empty batch");
  // Single-token entries first (decoding sequences), then prompt chunks.
  std::vector<size_t> order;
  for (size_t e = 0; e < entries.size(); ++e)
    if (entries[e].tokens.size() == 1) order.push_back(e);
  const int64_t n_single = int64_t(order.size());
  for (size_t e = 0; e < entries.size(); ++e)
    if (entries[e].tokens.size() != 1) order.push_back(e);
  std::vector<int32_t> ids, positions, rows;
  std::vector<StepSegment> segments;
  int64_t single_context = 1, n_logit_rows = n_single;
  for (size_t i = 0; i < order.size(); ++i) {
    const BatchEntry& e = entries[order[i]];
    const int64_t n = int64_t(e.tokens.size());
    NIBBLE_CHECK(n > 0, "forward: an entry without tokens");
    NIBBLE_CHECK(e.row >= 0 && e.row < pool.n_rows(), "forward: table row {} of {}", e.row, pool.n_rows());
    NIBBLE_CHECK(e.pos0 >= 0 && e.pos0 + n <= pool.max_tokens_per_row(), "sequence of {} tokens does not fit the "
                 "context of {} tokens", e.pos0 + n, pool.max_tokens_per_row());
    for (int32_t id : e.tokens)
      NIBBLE_CHECK(id >= 0 && id < vocab, "token id {} is outside the vocabulary (0..{})", id, vocab - 1);
    if (int64_t(i) >= n_single)
      segments.push_back({int64_t(ids.size()), n, e.pos0, e.row, e.output == Output::kNone ? -1 : n_logit_rows++});
    else
      single_context = std::max(single_context, e.pos0 + 1);
    for (int64_t t = 0; t < n; ++t) {
      ids.push_back(e.tokens[size_t(t)]);
      positions.push_back(int32_t(e.pos0 + t));
      rows.push_back(int32_t(e.row));
    }
  }
  const int64_t bucket = context_bucket(single_context, pool.max_tokens_per_row());
  pool.sync();

  // Logits rows of the step: entry order[i] (single) is row i; segment j its logits_row.
  std::vector<int64_t> logit_row(entries.size(), -1);
  for (int64_t i = 0; i < n_single; ++i) logit_row[order[size_t(i)]] = i;
  for (size_t j = 0; j < segments.size(); ++j) logit_row[order[size_t(n_single) + j]] = segments[j].logits_row;

  const bool record = segments.empty() && use_graphs_ && !tracer_ && backend_.supports_graphs();
  const int64_t rows_run = record ? std::min(batch_bucket(n_single), batch_bucket(pool.n_rows())) : 0;
  Buffer eager_ids, eager_pos, eager_rows, eager_logits, eager_tokens;
  float* logits = nullptr;
  int32_t* tokens = nullptr;
  if (record) {
    // Padding rows: token 0 at position 0 of the padding row, whose table points at the reserved block.
    ids.resize(size_t(rows_run), 0);
    positions.resize(size_t(rows_run), 0);
    rows.resize(size_t(rows_run), int32_t(pool.padding_row()));
    if (batch_capacity_ < rows_run) {
      batch_capacity_ = batch_bucket(pool.n_rows());
      const size_t n = size_t(batch_capacity_);
      batch_ids_ = Buffer(backend_, n * 4);
      batch_positions_ = Buffer(backend_, n * 4);
      batch_rows_ = Buffer(backend_, n * 4);
      batch_logits_ = Buffer(backend_, n * size_t(vocab) * 4);
      batch_tokens_ = Buffer(backend_, n * 4);
    }
    backend_.copy_to_backend(batch_ids_.data(), ids.data(), ids.size() * 4);
    backend_.copy_to_backend(batch_positions_.data(), positions.data(), positions.size() * 4);
    backend_.copy_to_backend(batch_rows_.data(), rows.data(), rows.size() * 4);
    logits = batch_logits_.data();
    tokens = batch_tokens_.data<int32_t>();
    Step step{batch_ids_.data<int32_t>(), batch_positions_.data<int32_t>(), rows_run, bucket, false, logits};
    step.pool = &pool;
    step.seq_rows = batch_rows_.data<int32_t>();
    step.n_single = rows_run;
    // The capacity is part of the key: the buffers the graph was recorded on.
    const uint64_t key = graph_key({id_, pool.id(), uint64_t(batch_capacity_), uint64_t(rows_run), uint64_t(bucket)});
    record_or_replay(key, [&] {
      compute(step);
      backend_.argmax(logits, rows_run, vocab, tokens);
    }, pool_graph_keys_[pool.id()]);
  } else {
    const size_t T = ids.size();
    eager_ids = Buffer(backend_, T * 4);
    eager_pos = Buffer(backend_, T * 4);
    eager_rows = Buffer(backend_, T * 4);
    eager_logits = Buffer(backend_, size_t(std::max<int64_t>(1, n_logit_rows) * vocab) * 4);
    eager_tokens = Buffer(backend_, size_t(std::max<int64_t>(1, n_logit_rows)) * 4);
    backend_.copy_to_backend(eager_ids.data(), ids.data(), T * 4);
    backend_.copy_to_backend(eager_pos.data(), positions.data(), T * 4);
    backend_.copy_to_backend(eager_rows.data(), rows.data(), T * 4);
    logits = eager_logits.data();
    tokens = eager_tokens.data<int32_t>();
    Step step{eager_ids.data<int32_t>(), eager_pos.data<int32_t>(), int64_t(T), bucket, false, logits};
    step.pool = &pool;
    step.seq_rows = eager_rows.data<int32_t>();
    step.n_single = n_single;
    step.segments = segments;
    compute(step);
    if (n_logit_rows) backend_.argmax(logits, n_logit_rows, vocab, tokens);
  }

  // The argmax ran over every row. Penalised rows are penalised now and the argmax runs again;
  // sampled rows draw into the same token array, which then comes back in one copy; logits rows
  // are copied.
  const int64_t token_rows = std::max<int64_t>(n_logit_rows, rows_run);
  std::vector<std::pair<int64_t, const TokenPenalties*>> penalized;
  std::vector<SampleInputs> draws;
  for (size_t e = 0; e < entries.size(); ++e) {
    if (entries[e].output == Output::kGreedy || entries[e].output == Output::kSample)
      if (entries[e].penalties.active()) penalized.push_back({logit_row[e], &entries[e].penalties});
    if (entries[e].output == Output::kSample) draws.push_back(entries[e].sample);
  }
  if (!penalized.empty()) {
    penalize(logits, penalized);
    backend_.argmax(logits, token_rows, vocab, tokens);
  }
  Buffer draw_inputs;
  if (!draws.empty()) {
    draw_inputs = Buffer(backend_, draws.size() * sizeof(SampleInputs));
    backend_.copy_to_backend(draw_inputs.data(), draws.data(), draws.size() * sizeof(SampleInputs));
    size_t k = 0;
    for (size_t e = 0; e < entries.size(); ++e)
      if (entries[e].output == Output::kSample) {
        const int64_t r = logit_row[e];
        backend_.sample(logits + r * vocab, vocab, draw_inputs.data<SampleInputs>() + k++, tokens + r);
      }
  }
  out.tokens.assign(entries.size(), -1);
  out.logits.clear();
  std::vector<int32_t> picked(static_cast<size_t>(token_rows));
  if (!picked.empty()) backend_.copy_to_host(picked.data(), tokens, picked.size() * 4);
  for (size_t e = 0; e < entries.size(); ++e) {
    const int64_t r = logit_row[e];
    switch (entries[e].output) {
      case Output::kNone:
        break;
      case Output::kGreedy:
      case Output::kSample:
        out.tokens[e] = picked[size_t(r)];
        break;
      case Output::kLogits: {
        const size_t at = out.logits.size();
        out.logits.resize(at + size_t(vocab));
        backend_.copy_to_host(out.logits.data() + at, logits + r * vocab, size_t(vocab) * 4);
        break;
      }
    }
  }
}

void Model::attend(const Step& s, int64_t layer, const float* q, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                   float scale, float* out, const float* sinks, int64_t window) const {
  if (s.cache) {
    backend_.attention(q, s.cache->layer(layer), s.n_tokens, s.positions, s.max_context, n_head, n_head_kv, head_dim,
                       scale, out, sinks, window);
    return;
  }
  const int64_t row = n_head * head_dim;
  if (s.n_single)
    backend_.attention(q, s.pool->layer(layer, s.seq_rows), s.n_single, s.positions, s.max_context, n_head, n_head_kv,
                       head_dim, scale, out, sinks, window);
  for (const StepSegment& g : s.segments)
    backend_.attention(q + g.first * row, s.pool->row_layer(layer, g.row), g.count, s.positions + g.first,
                       g.pos0 + g.count, n_head, n_head_kv, head_dim, scale, out + g.first * row, sinks, window);
}

int64_t Model::project_logits(const Step& s, const float* x, const WeightVector& norm, float eps,
                              const LinearWeight& lm_head) const {
  const int64_t H = config_.hidden_size, vocab = config_.vocab_size;
  if (s.cache) {
    const int64_t first = s.all_logits ? 0 : s.n_tokens - 1;
    if (s.pick && s.n_tokens - first == 1) {
      backend_.rms_norm_linear_pick(x + first * H, norm, eps, lm_head, s.logits, s.pick->out, s.pick->ids,
                                    s.pick->positions);
      s.picked = true;
      return 1;
    }
    backend_.rms_norm_linear(x + first * H, norm, eps, lm_head, s.n_tokens - first, s.logits);
    return s.n_tokens - first;
  }
  int64_t rows = 0;
  if (s.n_single) backend_.rms_norm_linear(x, norm, eps, lm_head, s.n_single, s.logits);
  rows = s.n_single;
  for (const StepSegment& g : s.segments)
    if (g.logits_row >= 0) {
      backend_.rms_norm_linear(x + (g.first + g.count - 1) * H, norm, eps, lm_head, 1, s.logits + g.logits_row * vocab);
      ++rows;
    }
  return rows;
}

}  // namespace nibble
