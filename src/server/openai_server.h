// `nibble serve`: the OpenAI-compatible HTTP API over the engine. Routes: POST /v1/chat/completions
// and /v1/completions (streamed as Server-Sent Events or not), GET /v1/models, /health, /metrics
// (Prometheus text). Requests are checked field by field (openai_request.h), rendered with the
// model's chat template, and answered in OpenAI's shapes, with reasoning split into
// reasoning_content for models that think in <think> blocks.
#pragma once

#include <memory>
#include <string>

#include "server/http.h"

namespace nibble {

struct ServeOptions {
  std::string model_dir, served_model_name, api_key, device = "cpu";
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_model_len = 0;              // 0: the model's
  int64_t max_num_seqs = 8;               // sequences generated at once (and the most choices, n)
  int64_t max_num_batched_tokens = 2048;  // tokens per engine step: decode tokens plus prompt chunks
  std::string reasoning_parser = "auto";  // auto (on when the chat template writes </think>), qwen3, none
  std::string kv_cache_dtype = "auto";
  std::string quantize_layers;  // --quantize-layers: roles quantized to 4 bits at load
  std::string quantize_format = "int4";  // --quantize-format: int4 or mxfp4
  bool enforce_eager = false;
  // KV cache size: kv_cache_memory_bytes when set, else (GPU) this fraction of the device's
  // memory for everything nibble holds there, else (CPU) up to 4 GiB.
  double gpu_memory_utilization = 0.9;
  int64_t kv_cache_memory_bytes = 0;
  int64_t block_size = 16;  // positions per KV block (a power of two)
  bool enable_prefix_caching = true;
  std::string load_format = "auto";  // "dummy": random weights of the config's shapes (benchmarks)
  std::string quantization;          // with dummy weights: "" (BF16) or "int4"
  // Sampling defaults: "auto" from the model's generation_config.json (as vLLM), "vllm" none
  // (temperature 1, no penalties unless a request asks), or a directory holding one.
  std::string generation_config = "auto";
};

class OpenAiServer {
 public:
  explicit OpenAiServer(const ServeOptions& options);
  ~OpenAiServer();
  int bind();  // returns the port
  void run();
  void request_stop();  // async-signal-safe; run() returns soon after
  void stop();
  // One request, as the HTTP layer calls it (public for tests).
  void handle(const HttpRequest& req, HttpResponse& res);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<HttpServer> http_;
};

}  // namespace nibble
