#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

#include "core/status.h"

namespace nibble {
namespace {

// Length of the longest suffix of `text` that is a proper prefix of some stop string.
size_t held_back(std::string_view text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (auto& s : stops)
    for (size_t n = std::min(s.size() - 1, text.size()); n > hold; --n)
      if (text.substr(text.size() - n) == std::string_view(s).substr(0, n)) {
        hold = n;
        break;
      }
  return hold;
}

}  // namespace

GenerateResult generate(Model& model, const Tokenizer& tokenizer, const GenerateRequest& req,
                        const TokenCallback& on_token) {
  using Clock = std::chrono::steady_clock;
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

  const int64_t budget = std::min(req.max_new_tokens, req.max_context - n_prompt);
  KvCache kv = model.make_kv_cache(n_prompt + budget);
  // The cache dies with this call; so do the decode steps recorded for it (also on an exception,
  // e.g. a server cancelling the request from the token callback).
  struct ReleaseGraphs {
    Model& model;
    const KvCache& kv;
    ~ReleaseGraphs() { model.release_graphs(kv); }
  } release{model, kv};
  Sampler sampler(req.sampling, req.prompt);
  StreamDecoder detok(tokenizer);
  GenerateResult result;
  result.finish_reason = "length";
  std::string pending;  // decoded text not yet passed to on_token

  // Without penalties or logprobs the token is picked on the device (greedy argmax, or the
  // temperature/top-k/top-p/min-p draw with the request's generator's next number): each step
  // returns the token id, not a row of logits.
  const bool on_device = sampler.picks_on_device() && req.top_logprobs < 0;
  std::vector<float> logits;
  int32_t device_id = -1;
  auto step_forward = [&](std::span<const int32_t> tokens, int64_t pos0) {
    if (!on_device)
      model.forward(tokens, pos0, kv, false, logits);
    else if (sampler.temperature() == 0.f)
      device_id = model.forward_greedy(tokens, pos0, kv);
    else
      device_id = model.forward_sample(tokens, pos0, kv, sampler.next_device_inputs());
  };
  auto t0 = Clock::now();
  if (budget > 0) step_forward(req.prompt, 0);
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  auto t1 = Clock::now();
  for (int64_t step = 0; step < budget; ++step) {
    if (step > 0) {
      const int32_t last = result.ids.back();
      step_forward({&last, 1}, n_prompt + step - 1);
    }
    GeneratedToken tok;
    if (on_device) {
      tok.id = device_id;
      sampler.record(tok.id);
    } else {
      tok.id = sampler.sample(logits);
    }
    if (req.top_logprobs >= 0) {
      tok.logprob = Sampler::logprob_of(logits, tok.id);
      tok.top = Sampler::top_logprobs(logits, req.top_logprobs);
    }
    result.ids.push_back(tok.id);
    if (std::find(req.stop_ids.begin(), req.stop_ids.end(), tok.id) != req.stop_ids.end()) {
      result.finish_reason = "stop";
      pending += detok.flush();
      result.text += pending;
      on_token(tok, pending);
      pending.clear();
      break;
    }
    pending += detok.push(tok.id);
    // Stop strings are searched in the text not yet shown plus the tail that could start one.
    std::string_view visible = pending;
    size_t cut = std::string::npos;
    for (auto& s : req.stop_strings) cut = std::min(cut, visible.find(s));
    if (cut != std::string::npos) {
      result.text += pending.substr(0, cut);
      on_token(tok, std::string_view(pending).substr(0, cut));
      pending.clear();
      result.finish_reason = "stop";
      break;
    }
    const size_t show = pending.size() - held_back(pending, req.stop_strings);
    result.text += pending.substr(0, show);
    on_token(tok, std::string_view(pending).substr(0, show));
    pending.erase(0, show);
  }
  if (result.finish_reason == "length") {
    pending += detok.flush();
    result.text += pending;
    GeneratedToken none;
    none.id = -1;
    if (!pending.empty()) on_token(none, pending);
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return result;
}

}  // namespace nibble
