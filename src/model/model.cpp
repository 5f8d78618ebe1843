#include <algorithm>
#include <bit>

#include "core/status.h"
#include "model/model.h"

namespace nibble {

void Model::forward(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits,
                    std::vector<float>& logits) {
  run(tokens, pos0, kv, all_logits, &logits, nullptr, nullptr);
}

int32_t Model::forward_greedy(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv) {
  int32_t id = -1;
  run(tokens, pos0, kv, false, nullptr, nullptr, &id);
  return id;
}

int32_t Model::forward_sample(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, const SampleInputs& in) {
  int32_t id = -1;
  run(tokens, pos0, kv, false, nullptr, &in, &id);
  return id;
}

void Model::run(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits,
                std::vector<float>* logits, const SampleInputs* sample, int32_t* token_id) {
  const int64_t T = int64_t(tokens.size()), vocab = config_.vocab_size;
  NIBBLE_CHECK(T > 0, "forward: no tokens");
  NIBBLE_CHECK(pos0 >= 0 && pos0 + T <= kv.max_tokens(), "sequence of {} tokens does not fit the "
               "context of {} tokens", pos0 + T, kv.max_tokens());
  for (int32_t id : tokens)
    NIBBLE_CHECK(id >= 0 && id < vocab, "token id {} is outside the vocabulary (0..{})", id, vocab - 1);
  std::vector<int32_t> positions(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = int32_t(pos0 + t);
  const int64_t rows = all_logits ? T : 1;
  if (logits) logits->resize(size_t(rows * vocab));

  // A decode step's work is sized by its context bucket (a power of two, at least 256), eager or
  // recorded, so both run the same kernels with the same splits and give the same bits.
  const int64_t bucket = std::min<int64_t>(kv.max_tokens(), std::max<int64_t>(256, std::bit_ceil(uint64_t(pos0 + 1))));
  if (T > 1 || !use_graphs_ || tracer_ || !backend_.supports_graphs()) {
    Buffer ids(backend_, size_t(T) * 4), pos(backend_, size_t(T) * 4);
    Buffer out(backend_, size_t(rows * vocab) * 4);
    backend_.copy_to_backend(ids.data(), tokens.data(), size_t(T) * 4);
    backend_.copy_to_backend(pos.data(), positions.data(), size_t(T) * 4);
    compute({ids.data<int32_t>(), pos.data<int32_t>(), T, T == 1 ? bucket : pos0 + T, all_logits, out.data()}, kv);
    if (token_id) {
      Buffer id(backend_, 4), in(backend_, sizeof(SampleInputs));
      if (sample) {
        backend_.copy_to_backend(in.data(), sample, sizeof(SampleInputs));
        backend_.sample(out.data(), vocab, in.data<SampleInputs>(), id.data<int32_t>());
      } else {
        backend_.argmax(out.data(), 1, vocab, id.data<int32_t>());
      }
      backend_.copy_to_host(token_id, id.data(), 4);
    } else {
      backend_.copy_to_host(logits->data(), out.data(), logits->size() * 4);
    }
    return;
  }
  // Decode: the inputs go to fixed buffers, and the step runs as the graph recorded for this
  // cache and context bucket (so a 16K context records ~8 graphs).
  if (!decode_ids_.data()) {
    decode_ids_ = Buffer(backend_, 4);
    decode_positions_ = Buffer(backend_, 4);
    decode_logits_ = Buffer(backend_, size_t(vocab) * 4);
    decode_token_ = Buffer(backend_, 4);
    decode_sample_ = Buffer(backend_, sizeof(SampleInputs));
  }
  backend_.copy_to_backend(decode_ids_.data(), tokens.data(), 4);
  backend_.copy_to_backend(decode_positions_.data(), positions.data(), 4);
  if (sample) backend_.copy_to_backend(decode_sample_.data(), sample, sizeof(SampleInputs));
  const Step step{decode_ids_.data<int32_t>(), decode_positions_.data<int32_t>(), 1, bucket, false,
                  decode_logits_.data()};
  // Greedy and sampled steps record the argmax or the draw too: graphs of their own. The draw's
  // parameters are read from device memory, so one graph serves every request's.
  const uint64_t key = (id_ << 48) ^ (kv.id() << 24) ^ uint64_t(bucket) ^
                       (token_id ? uint64_t(sample ? 2 : 1) << 46 : 0);
  auto step_ops = [&] {
    compute(step, kv);
    if (token_id && sample)
      backend_.sample(decode_logits_.data(), vocab, decode_sample_.data<SampleInputs>(), decode_token_.data<int32_t>());
    else if (token_id)
      backend_.argmax(decode_logits_.data(), 1, vocab, decode_token_.data<int32_t>());
  };
  if (!backend_.replay(key)) {
    // A first recording can fail for a passing reason (a table built on first use); a key that
    // failed twice runs uncaptured from then on.
    const bool give_up = std::count(capture_failures_.begin(), capture_failures_.end(), key) >= 2;
    bool recorded = false;
    if (!give_up) {
      backend_.begin_capture(key);
      step_ops();
      recorded = backend_.end_capture(key);
    }
    if (recorded) {
      graph_keys_[kv.id()].push_back(key);
      backend_.replay(key);
    } else {
      if (!give_up) capture_failures_.push_back(key);
      step_ops();
    }
  }
  if (token_id)
    backend_.copy_to_host(token_id, decode_token_.data(), 4);
  else
    backend_.copy_to_host(logits->data(), decode_logits_.data(), size_t(vocab) * 4);
}

void Model::release_graphs(const KvCache& kv) {
  auto it = graph_keys_.find(kv.id());
  if (it == graph_keys_.end()) return;
  for (uint64_t key : it->second) backend_.drop_graph(key);
  graph_keys_.erase(it);
}

}  // namespace nibble
