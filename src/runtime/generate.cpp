#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

#include "core/status.h"

namespace nibble {
namespace {

GenerateRequest validated(const Model& model, GenerateRequest req) {
  const int64_t n_prompt = int64_t(req.prompt.size());
  NIBBLE_CHECK(n_prompt > 0, "the prompt is empty");
  NIBBLE_CHECK(n_prompt < req.max_context, "the prompt has {} tokens; the context holds {} (prompt "
               "plus at least one generated token)", n_prompt, req.max_context);
  NIBBLE_CHECK(req.max_new_tokens >= 0, "the number of tokens to generate must not be negative");
  for (auto& s : req.stop_strings) NIBBLE_CHECK(!s.empty(), "stop strings must not be empty");
  const int64_t vocab = model.config().vocab_size;
  for (int32_t id : req.prompt)
    NIBBLE_CHECK(id >= 0 && id < vocab, "prompt token id {} is outside the vocabulary (0..{})", id,
                 vocab - 1);
  return req;
}
}  // namespace

Sequence::Sequence(const Model& model, const Tokenizer& tokenizer, GenerateRequest request)
    : req_(validated(model, std::move(request))),
      n_prompt_(int64_t(req_.prompt.size())),
      budget_(std::min(req_.max_new_tokens, req_.max_context - n_prompt_)),
      tokens_(req_.prompt),
      sampler_(req_.sampling, req_.prompt),
      detok_(tokenizer, req_.skip_special_tokens) {
  result_.finish_reason = "length";
  // Without logprobs the token is picked on the device (penalties, then the greedy argmax or the
  // temperature/top-k/top-p/min-p draw with the request's generator's next number): each step
  // returns the token id, not a row of logits.
  on_device_ = req_.top_logprobs < 0;
  if (budget_ == 0) done_ = true;
}

BatchEntry::Output Sequence::pick() const {
  using Output = BatchEntry::Output;
  if (!on_device_) return Output::kLogits;
  return sampler_.temperature() == 0.f ? Output::kGreedy : Output::kSample;
}

void Sequence::accept(int32_t device_token, std::span<const float> logits, const TokenCallback& on_token) {
  if (done_) return;
  GeneratedToken tok;
  if (on_device_) {
    tok.id = device_token;
    sampler_.record(tok.id);
  } else {
    tok.id = sampler_.sample(logits);
  }
  if (req_.top_logprobs >= 0) {
    tok.logprob = Sampler::logprob_of(logits, tok.id);
    tok.top = Sampler::top_logprobs(logits, req_.top_logprobs);
  }
  result_.ids.push_back(tok.id);
  tokens_.push_back(tok.id);
  if (std::find(req_.stop_ids.begin(), req_.stop_ids.end(), tok.id) != req_.stop_ids.end()) {
    result_.finish_reason = "stop";
    done_ = true;
    pending_ += detok_.flush();
    result_.text += pending_;
    std::string shown = std::move(pending_);
    pending_.clear();
    on_token(tok, shown);
    return;
  }
  pending_ += detok_.push(tok.id);
  // Stop strings are searched in the text not yet shown plus the tail that could start one.
  size_t cut = std::string::npos;
  for (auto& s : req_.stop_strings) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    result_.finish_reason = "stop";
    done_ = true;
    std::string shown = pending_.substr(0, cut);
    result_.text += shown;
    pending_.clear();
    on_token(tok, shown);
    return;
  }
  const size_t show = pending_.size() - partial_match_suffix(pending_, req_.stop_strings);
  std::string shown = pending_.substr(0, show);
  result_.text += shown;
  pending_.erase(0, show);
  on_token(tok, shown);
  if (int64_t(result_.ids.size()) >= budget_) finish_length(on_token);
}

void Sequence::finish_length(const TokenCallback& on_token) {
  done_ = true;
  pending_ += detok_.flush();
  result_.text += pending_;
  GeneratedToken none;
  none.id = -1;
  std::string shown = std::move(pending_);
  pending_.clear();
  if (!shown.empty()) on_token(none, shown);
}

Generation::Generation(Model& model, const Tokenizer& tokenizer, GenerateRequest request)
    : model_(model), seq_(model, tokenizer, std::move(request)), kv_(model.make_kv_cache(seq_.max_tokens())) {}

// The cache dies with the generation; so do the decode steps recorded for it (and any step still
// queued over it).
Generation::~Generation() {
  try {
    drain();
  } catch (...) {  // a device error already reported by the step that met it
  }
  model_.release_graphs(kv_);
}

void Generation::drain() {
  for (; queued_ > 0; --queued_) model_.decode_take(kv_);
}

void Generation::step(const TokenCallback& on_token, int64_t max_prefill_tokens) {
  using Clock = std::chrono::steady_clock;
  using Output = BatchEntry::Output;
  if (seq_.done()) return;
  const auto t0 = Clock::now();
  const int64_t n_prompt = seq_.n_prompt();
  const bool prefill = prefilled_ < n_prompt;
  std::span<const int32_t> tokens;
  int64_t pos0 = 0;
  if (prefill) {
    const int64_t chunk = std::min(std::max<int64_t>(1, max_prefill_tokens), n_prompt - prefilled_);
    tokens = std::span<const int32_t>(seq_.tokens()).subspan(size_t(prefilled_), size_t(chunk));
    pos0 = prefilled_;
    prefilled_ += chunk;
    if (prefilled_ < n_prompt) {
      model_.forward(tokens, pos0, kv_, false, logits_);  // not the last chunk: nothing to pick yet
      seq_.result().prefill_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      return;
    }
  } else {
    tokens = std::span<const int32_t>(seq_.tokens()).last(1);
    pos0 = int64_t(seq_.tokens().size()) - 1;
  }
  int32_t id = -1;
  const Output pick = seq_.pick();
  if (!prefill && pick != Output::kLogits && !seq_.penalties().active() && (queued_ > 0 || model_.decode_room(kv_))) {
    // Pipelined: this step is queued already (or is queued now), and the next one is queued on
    // its token before the host reads it, when the sequence can still want it (and no other
    // sequence's step ran on the model in between).
    auto enqueue = [&](int32_t token, int64_t pos) {
      SampleInputs in;
      if (pick == Output::kSample) in = seq_.next_sample_inputs();
      model_.decode_enqueue(token, pos, kv_, pick == Output::kSample ? &in : nullptr);
      ++queued_;
    };
    if (queued_ == 0) enqueue(tokens[0], pos0);
    if (pos0 + 2 <= seq_.max_tokens() && model_.decode_can_chain(kv_, pos0 + 1)) enqueue(-1, pos0 + 1);
    id = model_.decode_take(kv_);
    --queued_;
    seq_.result().decode_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    seq_.accept(id, logits_, on_token);
    if (seq_.done()) drain();  // a step queued past an EOS or a stop string is not wanted
    return;
  }
  switch (pick) {
    case Output::kGreedy:
      id = model_.forward_greedy(tokens, pos0, kv_, seq_.penalties());
      break;
    case Output::kSample:
      id = model_.forward_sample(tokens, pos0, kv_, seq_.next_sample_inputs(), seq_.penalties());
      break;
    default:
      model_.forward(tokens, pos0, kv_, false, logits_);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  (prefill ? seq_.result().prefill_seconds : seq_.result().decode_seconds) += seconds;
  seq_.accept(id, logits_, on_token);
}

GenerateResult generate(Model& model, const Tokenizer& tokenizer, const GenerateRequest& req,
                        const TokenCallback& on_token) {
  Generation g(model, tokenizer, req);
  while (!g.done()) g.step(on_token);
  return g.result();
}

size_t partial_match_suffix(std::string_view text, std::span<const std::string> patterns) {
  size_t hold = 0;
  for (auto& s : patterns)
    for (size_t n = std::min(s.size() - 1, text.size()); n > hold; --n)
      if (text.substr(text.size() - n) == std::string_view(s).substr(0, n)) {
        hold = n;
        break;
      }
  return hold;
}

void apply_generation_defaults(const SamplingOverrides& given, const GenerationConfig& gen, SamplingParams& s) {
  s.temperature = given.temperature.value_or(gen.temperature >= 0 ? float(gen.temperature) : 1.f);
  s.top_p = given.top_p.value_or(gen.top_p > 0 ? float(gen.top_p) : 1.f);
  s.top_k = given.top_k.value_or(gen.top_k > 0 ? gen.top_k : 0);
  s.min_p = given.min_p.value_or(gen.min_p >= 0 ? float(gen.min_p) : 0.f);
  s.repetition_penalty =
      given.repetition_penalty.value_or(gen.repetition_penalty > 0 ? float(gen.repetition_penalty) : 1.f);
}

std::vector<int32_t> eos_token_ids(const GenerationConfig& gen, const ModelConfig& config) {
  std::vector<int32_t> ids;
  for (int64_t id : gen.eos_token_ids.empty() ? config.eos_token_ids : gen.eos_token_ids) ids.push_back(int32_t(id));
  return ids;
}

}  // namespace nibble
