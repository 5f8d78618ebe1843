// Generation of one sequence: prefill the prompt, then decode token by token until an EOS id, a
// stop string, the token limit or the context limit. Text is streamed through a callback with
// stop strings held back until they can no longer match, so a stop string never reaches the user.
#pragma once

#include <cstdint>
#include <functional>
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
};

// on_token gets each generated token and the text it makes visible (possibly empty while a UTF-8
// character or a possible stop string is incomplete). Text still held when the token limit ends
// generation comes last with a token whose id is -1.
using TokenCallback = std::function<void(const GeneratedToken&, std::string_view text)>;

GenerateResult generate(Model& model, const Tokenizer& tokenizer, const GenerateRequest& request,
                        const TokenCallback& on_token);

}  // namespace nibble
