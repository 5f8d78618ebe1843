// Generation of one sequence: prefill the prompt, then decode token by token until an EOS id, a
// stop string, the token limit or the context limit. Text is streamed through a callback with
// stop strings held back until they can no longer match, so a stop string never reaches the user.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/model.h"
#include "runtime/sampler.h"
#include "tokenizer/tokenizer.h"

namespace nibble {

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 128;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;         // EOS ids: generation ends after emitting one (not shown)
  std::vector<std::string> stop_strings;  // generation ends before the text that matches
  int64_t top_logprobs = -1;             // -1: no logprobs; k >= 0: chosen + top-k
  int64_t max_context = 0;               // prompt + output limit (tokens)
  // Special tokens (<|im_end|>, harmony's <|channel|>) left out of the text; a harmony parser
  // needs them in.
  bool skip_special_tokens = true;
};

struct GeneratedToken {
  int32_t id = 0;
  float logprob = 0;
  std::vector<TokenLogprob> top;
};

struct GenerateResult {
  std::vector<int32_t> ids;
  std::string text;
  std::string finish_reason;  // "stop" (EOS id or stop string) or "length"
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t cached_tokens = 0;  // prompt tokens whose KV came from the prefix cache (a server's)
};

// on_token gets each generated token and the text it makes visible (possibly empty while a UTF-8
// character or a possible stop string is incomplete). Text still held when the token limit ends
// generation comes last with a token whose id is -1.
using TokenCallback = std::function<void(const GeneratedToken&, std::string_view text)>;

// A sequence's tokens and their meaning, without its KV memory: the prompt and the tokens
// generated so far, how the next token is picked (on the device, penalised, then greedy or drawn,
// or from a row of logits on the host when logprobs need them), and what a new token does (the text
// it shows, EOS ids, stop strings, the token limit). Generation below runs one with its own
// KvCache; a server's engine runs many over a shared KvPool.
class Sequence {
 public:
  // Validates the request (throws nibble::Error naming what is wrong).
  Sequence(const Model& model, const Tokenizer& tokenizer, GenerateRequest request);

  // The prompt, then every generated token.
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t n_prompt() const { return n_prompt_; }
  // The most positions it can need (prompt plus its token budget).
  int64_t max_tokens() const { return n_prompt_ + budget_; }
  bool done() const { return done_; }
  // How the step that ends at the last token must pick the next one (kGreedy, kSample or kLogits).
  BatchEntry::Output pick() const;
  // kSample: the draw's inputs (advances the request's generator).
  SampleInputs next_sample_inputs() { return sampler_.next_device_inputs(); }
  // kGreedy, kSample: the penalties to apply first (valid until the next accept()).
  TokenPenalties penalties() const { return {sampler_.penalties(), sampler_.penalty_tokens()}; }
  // The step's result for the last token: the token the device picked, or (kLogits) its logits.
  void accept(int32_t device_token, std::span<const float> logits, const TokenCallback& on_token);
  const GenerateResult& result() const { return result_; }
  GenerateResult& result() { return result_; }
  const GenerateRequest& request() const { return req_; }

 private:
  void finish_length(const TokenCallback& on_token);

  GenerateRequest req_;
  int64_t n_prompt_ = 0, budget_ = 0;
  std::vector<int32_t> tokens_;
  Sampler sampler_;
  StreamDecoder detok_;
  GenerateResult result_;
  std::string pending_;  // decoded text not yet passed to on_token
  bool on_device_ = false, done_ = false;
};

// One sequence's generation over its own KV cache, advanced a step at a time: a step runs a
// chunk of the prompt (the last chunk also picks the first token) or one decode token. The decode
// steps recorded for its cache are released with it.
class Generation {
 public:
  // Validates the request (throws nibble::Error naming what is wrong) and allocates the cache.
  Generation(Model& model, const Tokenizer& tokenizer, GenerateRequest request);
  ~Generation();
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  bool done() const { return seq_.done(); }
  // Prompt tokens not yet run (0 once decoding).
  int64_t prompt_remaining() const { return seq_.n_prompt() - prefilled_; }
  // One step; max_prefill_tokens bounds a prompt chunk (chunked prefill).
  void step(const TokenCallback& on_token, int64_t max_prefill_tokens = INT64_MAX);
  const GenerateResult& result() const { return seq_.result(); }
  const GenerateRequest& request() const { return seq_.request(); }

 private:
  // Takes and drops the decode steps still queued (Model::decode_enqueue).
  void drain();
  Model& model_;
  Sequence seq_;
  int64_t prefilled_ = 0;
  int64_t queued_ = 0;  // decode steps queued on the model and not yet taken
  KvCache kv_;
  std::vector<float> logits_;
};

// Sampling as vLLM sets it: each parameter the request gives, else the model's
// generation_config.json default, else the neutral value.
struct SamplingOverrides {
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k;
};
void apply_generation_defaults(const SamplingOverrides& given, const GenerationConfig& gen, SamplingParams& s);
// The ids that end generation: generation_config.json's eos_token_id, else config.json's.
std::vector<int32_t> eos_token_ids(const GenerationConfig& gen, const ModelConfig& config);

// Length of the longest suffix of `text` that is a proper prefix of one of `patterns`: text that
// may be the start of a stop string (or tag) cut by a token boundary, to be held back.
size_t partial_match_suffix(std::string_view text, std::span<const std::string> patterns);

// Runs a Generation to the end.
GenerateResult generate(Model& model, const Tokenizer& tokenizer, const GenerateRequest& request,
                        const TokenCallback& on_token);

}  // namespace nibble
