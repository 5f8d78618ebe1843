// nibble serve: the OpenAI-compatible server (src/server/), with vLLM's flag names.
#include <fmt/format.h>

#include <csignal>

#include "cli/commands.h"
#include "core/status.h"
#include "server/openai_server.h"

namespace nibble::cli {
namespace {

OpenAiServer* g_server = nullptr;

extern "C" void on_signal(int) {
  if (g_server) g_server->request_stop();  // only sets a flag: safe in a signal handler
}

void serve(ServeOptions o, const std::string& positional) {
  NIBBLE_CHECK(o.model_dir.empty() || positional.empty() || o.model_dir == positional,
               "give the model once (as the argument or with --model)");
  if (o.model_dir.empty()) o.model_dir = positional;
  NIBBLE_CHECK(!o.model_dir.empty(), "nibble serve needs a model directory (nibble serve DIR or --model DIR)");
  NIBBLE_CHECK(o.port >= 0 && o.port <= 65535, "--port {}: must be 0..65535", o.port);
  OpenAiServer server(o);
  const int port = server.bind();
  g_server = &server;
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  fmt::print(stderr, "nibble serve: {} on http://{}:{} (device {}){}\n",
             o.served_model_name.empty() ? o.model_dir : o.served_model_name, o.host, port, o.device,
             o.api_key.empty() ? "" : ", API key required");
  server.run();
  g_server = nullptr;
  server.stop();
  fmt::print(stderr, "nibble serve: stopped\n");
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  auto positional = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (chat/completions, completions, models)");
  cmd->add_option("model", *positional, "Hugging Face model directory")->check(CLI::ExistingDirectory);
  cmd->add_option("-m,--model", o->model_dir, "Hugging Face model directory")->check(CLI::ExistingDirectory);
  cmd->add_option("--host", o->host, "Address to listen on (default 127.0.0.1: this machine only)");
  cmd->add_option("--port", o->port, "Port (default 8000; 0 picks a free one)");
  cmd->add_option("--served-model-name", o->served_model_name, "Model name in the API (default: the model path)");
  cmd->add_option("--max-model-len", o->max_model_len, "Context length, prompt plus output (default: the model's)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "Sequences generated at once, and the most choices (n) (default 8)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-num-batched-tokens", o->max_num_batched_tokens,
                  "Tokens per engine step, decode tokens plus prompt chunks (default 2048)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--api-key", o->api_key, "Require 'Authorization: Bearer KEY' on /v1/ routes");
  cmd->add_option("--device", o->device, "cpu or cuda");
  cmd->add_option("--reasoning-parser", o->reasoning_parser,
                  "Split <think> blocks into reasoning_content: auto (when the chat template uses them), qwen3, none");
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "KV cache element type: auto (float16), float32 or fp8 (E4M3, half the bytes of float16)");
  cmd->add_option("--quantize-layers", o->quantize_layers,
                  "Quantize these 16-bit layers to 4 bits at load: a list of lm_head, qkv, o, router (see --quantize-format)");
  cmd->add_option("--quantize-format", o->quantize_format,
                  "Format of --quantize-layers: int4 (group 128, the default) or mxfp4 (blocks of 32, gpt-oss's)");
  cmd->add_flag("--enforce-eager", o->enforce_eager, "Launch every op as it comes (no recorded graphs)");
  cmd->add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                  "Fraction of GPU memory nibble may use; the KV cache gets what the weights and activations leave "
                  "(default 0.9)");
  cmd->add_option("--kv-cache-memory-bytes", o->kv_cache_memory_bytes,
                  "KV cache size in bytes (overrides --gpu-memory-utilization; CPU default 4 GiB)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--load-format", o->load_format, "auto (the checkpoint) or dummy (random weights, for benchmarks)");
  cmd->add_option("--quantization", o->quantization, "With --load-format dummy: int4 for GPTQ-like INT4 weights, mxfp4 for gpt-oss's MXFP4 experts");
  cmd->add_option("--generation-config", o->generation_config,
                  "Sampling defaults: auto (the model's generation_config.json), vllm (none), or a directory");
  cmd->add_option("--block-size", o->block_size, "Positions per KV cache block, a power of two (default 16)");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->enable_prefix_caching,
                "Reuse the KV blocks of earlier requests' prompt prefixes (default on)");
  cmd->callback([o, positional] { serve(*o, *positional); });
}

}  // namespace nibble::cli
