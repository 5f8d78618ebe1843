// `nibble bench-serve`: load on a running OpenAI-compatible server (nibble serve, vllm serve,
// llama-server) from N concurrent streaming clients, as vLLM's benchmark_serving measures it:
// aggregate output tokens/s, TTFT and inter-token latency percentiles, errors. Prompts are made
// of random words (seeded), requests ask for exactly max_tokens tokens (ignore_eos). Between
// levels it reads the server's /metrics (where it is nibble) for its resident memory and KV
// blocks in use, so a leak shows as growth across a long run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nibble {

struct ServeLoadOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string model;   // "" : the first of /v1/models
  std::string api_key;
  int64_t prompt_words = 128;
  int64_t max_tokens = 128;
  double duration_s = 0;   // > 0: each level runs this long (clients start new requests until then)
  int64_t requests = 0;    // else: this many requests per level (0: 2 x concurrency, at least 8)
  uint64_t seed = 42;
};

struct ServeLoadLevel {
  int64_t concurrency = 0, requests = 0, errors = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
  double seconds = 0, output_tok_s = 0, request_tok_s_p50 = 0;  // per-request decode rate (after the first token)
  double ttft_p50 = 0, ttft_p99 = 0, itl_p50 = 0, itl_p99 = 0, e2e_p50 = 0;
  std::string first_error;
  // From the server's /metrics after the level (-1 where it does not say).
  double server_rss_bytes = -1, kv_blocks_used = -1, kv_blocks_total = -1;
};

ServeLoadLevel run_serve_load(const ServeLoadOptions& options, int64_t concurrency);

// GET path on the server: the body, or throws Error (connection refused, status not 200).
std::string http_get(const std::string& host, int port, const std::string& path, const std::string& api_key = "");

}  // namespace nibble
