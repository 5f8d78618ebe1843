#include "server/openai_server.h"

#include <fmt/format.h>

#include <atomic>
#include <bit>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <span>

#include <unistd.h>

#include "core/status.h"
#include "format/hf_config.h"
#include "model/model.h"
#include "server/engine.h"
#include "server/openai_request.h"
#include "server/reasoning.h"
#include "tokenizer/chat_template.h"

namespace nibble {
namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

// A Prometheus histogram with fixed buckets (seconds).
struct Histogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts;
  double sum = 0;
  int64_t n = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size(), 0) {}
  void observe(double x) {
    for (size_t i = 0; i < bounds.size(); ++i)
      if (x <= bounds[i]) ++counts[i];
    sum += x;
    ++n;
  }
  void write(std::string& out, const std::string& name, const std::string& help) const {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    for (size_t i = 0; i < bounds.size(); ++i)
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], counts[i]);
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, n, name, sum, name, n);
  }
};

std::string random_id(const char* prefix) {
  static std::mt19937_64 rng(std::random_device{}());
  static std::mutex mu;
  std::lock_guard lock(mu);
  return fmt::format("{}-{:016x}{:08x}", prefix, rng(), uint32_t(rng()));
}

std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(HttpResponse& res, int status, const json& body) { res.send(status, "application/json", dump(body)); }

void send_error(HttpResponse& res, const RequestError& e) {
  res.send(e.status, "application/json", e.body().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// One choice being generated: its job, text, tokens, logprobs and reasoning split.
struct Choice {
  std::shared_ptr<EngineJob> job;
  std::string text, reasoning;
  std::vector<GeneratedToken> tokens;
  std::unique_ptr<OutputSplitter> parser;
  json tool_calls = json::array();  // OpenAI's message.tool_calls
  std::string finish_reason;
  int64_t completion_tokens = 0, cached_tokens = 0;
  size_t text_offset = 0;  // streamed completions' logprobs
};

}  // namespace

struct OpenAiServer::Impl {
  ServeOptions o;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;
  std::string template_error;
  // How chat output is split: <think> blocks (Qwen3), harmony channels (gpt-oss), or not at all.
  enum class Splitter { kNone, kThink, kHarmony } splitter = Splitter::kNone;
  GenerationConfig gen;
  int64_t max_model_len = 0;
  std::unique_ptr<Engine> engine;
  int64_t created = std::time(nullptr);

  std::mutex metrics_mu;
  std::map<std::string, int64_t> requests;  // "endpoint,status"
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}};
  Histogram itl{{0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1,    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1,    2.5}};
  Histogram e2e{{0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960}};

  explicit Impl(const ServeOptions& opts) : o(opts) {
    backend = make_backend(o.device);
    LoadOptions load;
    load.enforce_eager = o.enforce_eager;
    load.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
    load.quantize_layers = parse_quantize_layers(o.quantize_layers);
    load.quantize_format = o.quantize_format;
    load.load_format = o.load_format;
    load.quantization = o.quantization;
    model = load_model(o.model_dir, *backend, load);
    const std::string tok_path = (std::filesystem::path(o.model_dir) / "tokenizer.json").string();
    NIBBLE_CHECK(std::filesystem::exists(tok_path), "{}: missing (nibble serve needs the model's tokenizer)", tok_path);
    tokenizer = Tokenizer::from_file(tok_path);
    NIBBLE_CHECK(o.generation_config == "auto" || o.generation_config == "vllm" ||
                     std::filesystem::is_directory(o.generation_config),
                 "--generation-config {}: must be auto, vllm or a directory", o.generation_config);
    if (o.generation_config != "vllm")
      gen = load_generation_config(o.generation_config == "auto" ? o.model_dir : o.generation_config);
    max_model_len = o.max_model_len > 0 ? o.max_model_len : model->config().max_position_embeddings;
    NIBBLE_CHECK(max_model_len >= 2, "--max-model-len {} is too small", max_model_len);
    if (o.served_model_name.empty()) o.served_model_name = o.model_dir;
    try {
      const std::string src = load_chat_template_source(o.model_dir);
      chat_template = ChatTemplate::parse(src, o.model_dir + " chat template");
      const bool auto_pick = o.reasoning_parser == "auto";
      if (o.reasoning_parser == "gpt-oss" || o.reasoning_parser == "harmony" ||
          (auto_pick && src.find("<|channel|>") != std::string::npos))
        splitter = Splitter::kHarmony;
      else if (o.reasoning_parser == "qwen3" || (auto_pick && src.find("</think>") != std::string::npos))
        splitter = Splitter::kThink;
    } catch (const Error& e) {
      template_error = e.what();  // /v1/chat/completions answers with it; /v1/completions still works
    }
    NIBBLE_CHECK(o.reasoning_parser == "auto" || o.reasoning_parser == "qwen3" || o.reasoning_parser == "gpt-oss" ||
                     o.reasoning_parser == "harmony" || o.reasoning_parser == "none",
                 "--reasoning-parser {}: must be auto, qwen3, gpt-oss (harmony) or none", o.reasoning_parser);
    engine = std::make_unique<Engine>(*model, *tokenizer, engine_options());
  }

  // The KV pool's size, as vLLM sizes it: --kv-cache-memory-bytes, else on a GPU what
  // --gpu-memory-utilization of its memory leaves after what is already used (the weights) and
  // a reserve for a step's activations, else (CPU) 4 GiB. Never more blocks than 4x what
  // max_num_seqs full-length sequences can use at once (the rest would only hold old prefixes).
  EngineOptions engine_options() {
    EngineOptions e;
    e.max_num_seqs = o.max_num_seqs;
    e.max_num_batched_tokens = o.max_num_batched_tokens;
    e.max_model_len = max_model_len;
    e.prefix_caching = o.enable_prefix_caching;
    NIBBLE_CHECK(o.block_size >= 1 && o.block_size <= 1024 && std::has_single_bit(uint64_t(o.block_size)),
                 "--block-size {}: must be a power of two from 1 to 1024", o.block_size);
    e.block_size_log2 = std::countr_zero(uint64_t(o.block_size));
    NIBBLE_CHECK(o.gpu_memory_utilization > 0 && o.gpu_memory_utilization <= 1,
                 "--gpu-memory-utilization {}: must be in (0, 1]", o.gpu_memory_utilization);
    NIBBLE_CHECK(o.kv_cache_memory_bytes >= 0, "--kv-cache-memory-bytes must not be negative");
    // Sliding-window layers (gpt-oss) get a pool of their own sized for what the windows reach:
    // a step's blocks, each sequence's window and as much again for cached prefixes' windows.
    const bool sliding = model->n_sliding_layers() > 0;
    const int64_t window_blocks = (model->config().sliding_window + o.block_size - 1) / o.block_size;
    if (sliding)
      e.sliding_blocks = 1 + 2 * ((o.max_num_batched_tokens + o.block_size - 1) / o.block_size +
                                  o.max_num_seqs * (window_blocks + 2));
    const int64_t sliding_bytes = e.sliding_blocks * model->sliding_kv_bytes_per_block(e.block_size_log2);
    const int64_t per_block = model->kv_bytes_per_block(e.block_size_log2, sliding);
    const int64_t per_seq = (max_model_len + o.block_size - 1) / o.block_size;
    int64_t bytes = o.kv_cache_memory_bytes;
    size_t free_bytes = 0, total_bytes = 0;
    std::string how = "--kv-cache-memory-bytes";
    if (bytes == 0 && backend->memory_info(&free_bytes, &total_bytes)) {
      const ModelConfig& c = model->config();
      const int64_t per_token_floats = 8 * c.hidden_size + 3 * (c.num_attention_heads + 2 * c.num_key_value_heads) *
                                                               c.head_dim +
                                       3 * std::max(c.num_experts_per_tok * c.moe_intermediate_size, c.intermediate_size);
      const int64_t reserve = (int64_t(1) << 30) + 4 * o.max_num_batched_tokens * per_token_floats +
                              8 * o.max_num_seqs * c.vocab_size;
      bytes = int64_t(o.gpu_memory_utilization * double(total_bytes)) - int64_t(total_bytes - free_bytes) - reserve;
      how = fmt::format("--gpu-memory-utilization {} of {:.1f} GiB, {:.1f} GiB in use, {:.1f} GiB kept for "
                        "activations", o.gpu_memory_utilization, double(total_bytes) / (1 << 30),
                        double(total_bytes - free_bytes) / (1 << 30), double(reserve) / (1 << 30));
      NIBBLE_CHECK(bytes > 0, "no memory left for the KV cache ({}): raise --gpu-memory-utilization or set "
                   "--kv-cache-memory-bytes", how);
    } else if (bytes == 0) {
      bytes = int64_t(4) << 30;
      how = "the CPU default of 4 GiB";
    }
    NIBBLE_CHECK(bytes > sliding_bytes, "the KV cache's {:.2f} GiB ({}) do not cover the sliding-window layers' "
                 "{:.2f} GiB", double(bytes) / (1 << 30), how, double(sliding_bytes) / (1 << 30));
    e.kv_blocks = std::min((bytes - sliding_bytes) / per_block, 4 * per_seq * o.max_num_seqs + 1);
    fmt::print(stderr, "nibble serve: KV cache of {} blocks of {} positions ({} tokens, {:.2f} GiB; {})\n",
               e.kv_blocks - 1, o.block_size, (e.kv_blocks - 1) * o.block_size,
               double(e.kv_blocks * per_block) / (1 << 30), how);
    if (sliding)
      fmt::print(stderr, "nibble serve: its {} sliding-window layers (window {}) in a pool of their own: {} blocks, "
                 "{:.2f} GiB\n", model->n_sliding_layers(), model->config().sliding_window, e.sliding_blocks - 1,
                 double(sliding_bytes) / (1 << 30));
    return e;
  }

  void count(const std::string& endpoint, int status) {
    std::lock_guard lock(metrics_mu);
    ++requests[endpoint + "," + std::to_string(status)];
  }

  bool authorized(const HttpRequest& req) const {
    return o.api_key.empty() || req.header("authorization") == "Bearer " + o.api_key;
  }

  json models() const {
    return {{"object", "list"},
            {"data", json::array({{{"id", o.served_model_name},
                                   {"object", "model"},
                                   {"created", created},
                                   {"owned_by", "nibble"},
                                   {"root", o.model_dir},
                                   {"max_model_len", max_model_len}}})}};
  }

  static int64_t resident_bytes() {
    std::ifstream statm("/proc/self/statm");
    int64_t size = 0, resident = 0;
    statm >> size >> resident;
    return resident * int64_t(sysconf(_SC_PAGESIZE));
  }

  std::string metrics() {
    const EngineStats s = engine->stats();
    std::string out;
    auto gauge = [&](const char* name, const char* help, const char* type, int64_t v) {
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, v);
    };
    std::lock_guard lock(metrics_mu);
    out += "# HELP nibble_requests_total HTTP requests by endpoint and status\n# TYPE nibble_requests_total counter\n";
    for (auto& [k, v] : requests) {
      const size_t comma = k.find(',');
      out += fmt::format("nibble_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", k.substr(0, comma),
                         k.substr(comma + 1), v);
    }
    gauge("nibble_num_requests_waiting", "Generations queued", "gauge", s.waiting);
    gauge("nibble_num_requests_running", "Generations running", "gauge", s.running);
    gauge("nibble_prompt_tokens_total", "Prompt tokens processed", "counter", s.prompt_tokens);
    gauge("nibble_generation_tokens_total", "Tokens generated", "counter", s.generation_tokens);
    gauge("nibble_request_success_total", "Generations finished", "counter", s.finished);
    gauge("nibble_request_cancelled_total", "Generations cancelled (client gone)", "counter", s.cancelled);
    gauge("nibble_kv_cache_blocks_total", "KV cache blocks in the pool", "gauge", s.kv_blocks);
    gauge("nibble_kv_cache_blocks_used", "KV cache blocks held by running sequences", "gauge", s.kv_blocks_used);
    gauge("nibble_kv_cache_blocks_free", "KV cache blocks free (cached prefixes included)", "gauge",
          s.kv_blocks - s.kv_blocks_used);
    out += fmt::format("# HELP nibble_kv_cache_usage_perc Fraction of KV cache blocks in use\n"
                       "# TYPE nibble_kv_cache_usage_perc gauge\nnibble_kv_cache_usage_perc {}\n",
                       s.kv_blocks ? double(s.kv_blocks_used) / double(s.kv_blocks) : 0.0);
    gauge("nibble_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", "counter",
          s.prefix_queried_tokens);
    gauge("nibble_prefix_cache_hits_total", "Prompt tokens found in the prefix cache", "counter", s.prefix_hit_tokens);
    gauge("nibble_num_preemptions_total", "Sequences preempted (blocks ran out) to be recomputed", "counter",
          s.preemptions);
    gauge("nibble_engine_steps_total", "Batched forward steps run", "counter", s.steps);
    out += fmt::format("# HELP nibble_engine_forward_seconds_total Time in batched forward passes\n"
                       "# TYPE nibble_engine_forward_seconds_total counter\nnibble_engine_forward_seconds_total {}\n"
                       "# HELP nibble_engine_step_seconds_total Time in engine steps (scheduling, forward, results)\n"
                       "# TYPE nibble_engine_step_seconds_total counter\nnibble_engine_step_seconds_total {}\n",
                       s.forward_seconds, s.step_seconds);
    gauge("process_resident_memory_bytes", "Resident memory of the server process", "gauge", resident_bytes());
    ttft.write(out, "nibble_time_to_first_token_seconds", "Time from request to first token");
    itl.write(out, "nibble_inter_token_latency_seconds", "Time between consecutive tokens");
    e2e.write(out, "nibble_e2e_request_latency_seconds", "Time from request to last token");
    return out;
  }

  // The request's sampling over the model's generation_config defaults (as vLLM).
  GenerateRequest make_request(const ApiRequest& r, std::vector<int32_t> prompt) {
    const int64_t n_prompt = int64_t(prompt.size());
    const std::string what = r.kind == ApiRequest::kChat ? "messages" : "prompt";
    if (n_prompt >= max_model_len)
      throw RequestError(400, r.kind == ApiRequest::kChat ? "messages" : "prompt",
                         fmt::format("This model's maximum context length is {} tokens. However, your {} has {} "
                                     "tokens (prompt plus at least one generated token must fit).",
                                     max_model_len, what, n_prompt));
    if (r.max_tokens && n_prompt + *r.max_tokens > max_model_len)
      throw RequestError(400, "max_tokens",
                         fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                                     "tokens ({} in the {}, {} in the completion). Please reduce the length of the "
                                     "{} or completion.",
                                     max_model_len, n_prompt + *r.max_tokens, n_prompt, what, *r.max_tokens, what));
    for (int32_t id : prompt)
      if (id >= model->config().vocab_size)
        throw RequestError(400, "prompt",
                           fmt::format("token id {} is outside the vocabulary (0..{})", id, model->config().vocab_size - 1));
    GenerateRequest g;
    g.prompt = std::move(prompt);
    g.max_context = max_model_len;
    g.max_new_tokens = r.max_tokens.value_or(max_model_len - n_prompt);
    g.stop_strings = r.stop;
    g.top_logprobs = r.logprobs;
    if (!r.ignore_eos) g.stop_ids = eos_token_ids(gen, model->config());
    g.stop_ids.insert(g.stop_ids.end(), r.stop_token_ids.begin(), r.stop_token_ids.end());
    SamplingParams& s = g.sampling;
    s = r.sampling;
    apply_generation_defaults({r.temperature, r.top_p, r.min_p, r.repetition_penalty, r.top_k}, gen, s);
    if (!r.has_seed) s.seed = std::random_device{}() | (uint64_t(std::random_device{}()) << 32);
    return g;
  }

  json logprob_entry(const GeneratedToken& t) const {
    auto one = [&](int32_t id, float lp) {
      const std::string bytes = tokenizer->token_bytes(id);
      json b = json::array();
      for (unsigned char c : bytes) b.push_back(int(c));
      return json{{"token", bytes}, {"logprob", lp}, {"bytes", b}};
    };
    json e = one(t.id, t.logprob);
    json top = json::array();
    for (auto& x : t.top) top.push_back(one(x.id, x.logprob));
    e["top_logprobs"] = top;
    return e;
  }
  // The logprobs of `tokens` in the endpoint's shape: chat {"content": [entries]}, completions
  // parallel lists with each token's byte offset in the text (`offset` carries on across chunks).
  json logprobs_json(std::span<const GeneratedToken> tokens, bool chat, size_t& offset) const {
    if (chat) {
      json content = json::array();
      for (auto& t : tokens) content.push_back(logprob_entry(t));
      return {{"content", content}};
    }
    json toks = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
    for (auto& t : tokens) {
      const std::string text = tokenizer->token_bytes(t.id);
      toks.push_back(text);
      lps.push_back(t.logprob);
      json top = json::object();
      for (auto& x : t.top) top[tokenizer->token_bytes(x.id)] = x.logprob;
      tops.push_back(top);
      offs.push_back(offset);
      offset += text.size();
    }
    return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
  }


  void handle_generate(const HttpRequest& req, HttpResponse& res, bool chat) {
    const std::string endpoint = chat ? "chat" : "completions";
    const auto t0 = Clock::now();
    ApiRequest r;
    std::vector<int32_t> prompt;
    bool starts_in_reasoning = false;
    try {
      const json body = parse_request_body(req.body);
      RequestLimits limits;
      limits.max_n = o.max_num_seqs;
      r = chat ? parse_chat_request(body, limits) : parse_completion_request(body, limits);
      if (!r.model.empty() && r.model != o.served_model_name)
        throw RequestError(404, "model", fmt::format("The model `{}` does not exist.", r.model));
      if (chat) {
        if (!chat_template) throw RequestError(400, "messages", template_error);
        std::string text;
        try {
          text = chat_template->render(
              chat_template_context(o.model_dir, r.messages, r.tools, r.add_generation_prompt, r.chat_template_kwargs));
        } catch (const Error& e) {
          throw RequestError(400, "messages", e.what());
        }
        prompt = tokenizer->encode(text);
        const size_t tail = text.find_last_not_of(" \t\r\n");
        starts_in_reasoning = splitter == Splitter::kThink && tail != std::string::npos && tail >= 6 &&
                              text.compare(tail - 6, 7, "<think>") == 0;
      } else {
        prompt = r.prompt_ids.empty() ? tokenizer->encode(r.prompt) : r.prompt_ids;
      }
      GenerateRequest g = make_request(r, prompt);
      // The harmony parser reads the channel markers, and returns none of them.
      g.skip_special_tokens = chat && splitter == Splitter::kHarmony ? false : r.skip_special_tokens;
      validate(g.sampling);
      std::vector<Choice> choices(size_t(r.n));
      for (int64_t i = 0; i < r.n; ++i) {
        GenerateRequest gi = g;
        gi.sampling.seed = g.sampling.seed + uint64_t(i);
        choices[size_t(i)].job = engine->submit(std::move(gi));
        if (chat && splitter == Splitter::kThink)
          choices[size_t(i)].parser = std::make_unique<ReasoningParser>(starts_in_reasoning);
        if (chat && splitter == Splitter::kHarmony) choices[size_t(i)].parser = std::make_unique<HarmonyParser>();
      }
      const int status =
          r.stream ? stream(res, r, choices, prompt, chat, t0) : whole(res, r, choices, prompt, chat, t0);
      count(endpoint, status);
    } catch (const RequestError& e) {
      count(endpoint, e.status);
      send_error(res, e);
    } catch (const Error& e) {
      count(endpoint, 400);
      send_error(res, RequestError(400, "", e.what()));
    }
  }

  // Waits for a choice's next event, cancelling every job when the client is gone.
  std::optional<EngineEvent> next_event(std::vector<Choice>& choices, Choice& c, HttpResponse& res) {
    while (true) {
      if (auto e = c.job->next(std::chrono::milliseconds(50))) return e;
      if (res.client_gone()) {
        for (auto& x : choices) x.job->cancel();
        return std::nullopt;
      }
    }
  }

  void observe_token(Clock::time_point t0, Clock::time_point& last, bool first) {
    const auto now = Clock::now();
    std::lock_guard lock(metrics_mu);
    if (first)
      ttft.observe(std::chrono::duration<double>(now - t0).count());
    else
      itl.observe(std::chrono::duration<double>(now - last).count());
    last = now;
  }

  json usage(const std::vector<Choice>& choices, size_t n_prompt) const {
    int64_t completion = 0;
    for (auto& c : choices) completion += c.completion_tokens;
    return {{"prompt_tokens", n_prompt},
            {"completion_tokens", completion},
            {"total_tokens", int64_t(n_prompt) + completion},
            {"prompt_tokens_details", {{"cached_tokens", choices.empty() ? 0 : choices[0].cached_tokens}}}};
  }

  // A parser's tool-call deltas into c.tool_calls (OpenAI's shape, arguments concatenated).
  static void add_tool_calls(Choice& c, const OutputSplitter::Delta& d) {
    for (auto& t : d.tool_calls) {
      if (!t.name.empty())
        c.tool_calls.push_back(
            {{"id", random_id("call")}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", ""}}}});
      json& args = c.tool_calls[size_t(t.index)]["function"]["arguments"];
      args = args.get<std::string>() + t.arguments;
    }
  }
  static void take(Choice& c, const OutputSplitter::Delta& d) {
    c.reasoning += d.reasoning;
    c.text += d.content;
    add_tool_calls(c, d);
  }

  int whole(HttpResponse& res, const ApiRequest& r, std::vector<Choice>& choices, const std::vector<int32_t>& prompt,
            bool chat, Clock::time_point t0) {
    for (auto& c : choices) {
      Clock::time_point last;
      bool first = true;
      while (true) {
        auto e = next_event(choices, c, res);
        if (!e) return 499;  // client closed the connection; nothing to send
        if (e->kind == EngineEvent::kError) {
          for (auto& x : choices) x.job->cancel();
          throw RequestError(400, "", e->text);
        }
        if (e->kind == EngineEvent::kDone) {
          c.finish_reason = e->result.finish_reason;
          c.completion_tokens = int64_t(e->result.ids.size());
          c.cached_tokens = e->result.cached_tokens;
          break;
        }
        if (e->token.id >= 0) {
          observe_token(t0, last, first);
          first = false;
          c.tokens.push_back(e->token);
        }
        if (c.parser) {
          take(c, c.parser->push(e->text));
        } else {
          c.text += e->text;
        }
      }
      if (c.parser) take(c, c.parser->flush());
      if (!c.tool_calls.empty() && c.finish_reason == "stop") c.finish_reason = "tool_calls";
    }
    {
      std::lock_guard lock(metrics_mu);
      e2e.observe(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    json out_choices = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      Choice& c = choices[i];
      json logprobs = nullptr;
      size_t offset = 0;
      if (r.logprobs >= 0) logprobs = logprobs_json(c.tokens, chat, offset);
      if (chat) {
        json msg = {{"role", "assistant"}, {"content", c.text}};
        if (c.parser) msg["reasoning_content"] = c.reasoning.empty() ? json(nullptr) : json(c.reasoning);
        if (!c.tool_calls.empty()) {
          msg["tool_calls"] = c.tool_calls;
          if (c.text.empty()) msg["content"] = nullptr;
        }
        out_choices.push_back(
            {{"index", i}, {"message", msg}, {"logprobs", logprobs}, {"finish_reason", c.finish_reason}});
      } else {
        const std::string text = r.echo ? (r.prompt.empty() ? tokenizer->decode(prompt) : r.prompt) + c.text : c.text;
        out_choices.push_back(
            {{"index", i}, {"text", text}, {"logprobs", logprobs}, {"finish_reason", c.finish_reason}});
      }
    }
    send_json(res, 200,
              {{"id", random_id(chat ? "chatcmpl" : "cmpl")},
               {"object", chat ? "chat.completion" : "text_completion"},
               {"created", std::time(nullptr)},
               {"model", o.served_model_name},
               {"choices", out_choices},
               {"usage", usage(choices, prompt.size())}});
    return 200;
  }

  int stream(HttpResponse& res, const ApiRequest& r, std::vector<Choice>& choices, const std::vector<int32_t>& prompt,
             bool chat, Clock::time_point t0) {
    const std::string id = random_id(chat ? "chatcmpl" : "cmpl");
    const int64_t created_at = std::time(nullptr);
    auto chunk = [&](size_t index, json delta_or_text, json finish, json logprobs) {
      json choice = {{"index", index}};
      if (chat)
        choice["delta"] = std::move(delta_or_text);
      else
        choice["text"] = std::move(delta_or_text);
      choice["logprobs"] = std::move(logprobs);
      choice["finish_reason"] = std::move(finish);
      json c = {{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created_at},
                {"model", o.served_model_name},
                {"choices", json::array({choice})}};
      if (r.include_usage) c["usage"] = nullptr;
      return sse(c);
    };
    auto cancel_all = [&] {
      for (auto& x : choices) x.job->cancel();
      return 499;
    };
    if (!res.start_stream(200, "text/event-stream")) return cancel_all();
    for (size_t i = 0; i < choices.size(); ++i) {
      Choice& c = choices[i];
      if (chat && !res.write_chunk(chunk(i, {{"role", "assistant"}, {"content", ""}}, nullptr, nullptr)))
        return cancel_all();
      if (!chat && r.echo &&
          !res.write_chunk(chunk(i, r.prompt.empty() ? tokenizer->decode(prompt) : r.prompt, nullptr, nullptr)))
        return cancel_all();
      Clock::time_point last;
      bool first = true;
      while (true) {
        auto e = next_event(choices, c, res);
        if (!e) return 499;
        if (e->kind == EngineEvent::kError) {
          res.write_chunk(
              sse({{"error", {{"message", e->text}, {"type", "BadRequestError"}, {"param", nullptr}, {"code", 400}}}}));
          res.write_chunk("data: [DONE]\n\n");
          res.end_stream();
          return 400;
        }
        std::string content, reasoning_delta;
        json tool_deltas = json::array();
        auto split = [&](OutputSplitter::Delta d) {
          content = d.content;
          reasoning_delta = d.reasoning;
          add_tool_calls(c, d);
          for (auto& t : d.tool_calls) {
            if (!t.name.empty())  // the call opens: its id, type and name, then argument deltas
              tool_deltas.push_back({{"index", t.index},
                                     {"id", c.tool_calls[size_t(t.index)]["id"]},
                                     {"type", "function"},
                                     {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
            else
              tool_deltas.push_back({{"index", t.index}, {"function", {{"arguments", t.arguments}}}});
          }
        };
        if (e->kind == EngineEvent::kDone) {
          c.finish_reason = e->result.finish_reason;
          c.completion_tokens = int64_t(e->result.ids.size());
          c.cached_tokens = e->result.cached_tokens;
          if (c.parser) split(c.parser->flush());
          if (!c.tool_calls.empty() && c.finish_reason == "stop") c.finish_reason = "tool_calls";
        } else {
          if (e->token.id >= 0) {
            observe_token(t0, last, first);
            first = false;
          }
          if (c.parser) {
            split(c.parser->push(e->text));
          } else {
            content = e->text;
          }
        }
        json logprobs = nullptr;
        if (r.logprobs >= 0 && e->kind == EngineEvent::kToken && e->token.id >= 0)
          logprobs = logprobs_json({&e->token, 1}, chat, c.text_offset);
        if (!reasoning_delta.empty() &&
            !res.write_chunk(chunk(i, {{"reasoning_content", reasoning_delta}}, nullptr, nullptr)))
          return cancel_all();
        if ((!content.empty() || !logprobs.is_null()) &&
            !res.write_chunk(chunk(i, chat ? json{{"content", content}} : json(content), nullptr, logprobs)))
          return cancel_all();
        if (!tool_deltas.empty() && !res.write_chunk(chunk(i, {{"tool_calls", tool_deltas}}, nullptr, nullptr)))
          return cancel_all();
        if (e->kind == EngineEvent::kDone) {
          if (!res.write_chunk(chunk(i, chat ? json::object() : json(""), c.finish_reason, nullptr)))
            return cancel_all();
          break;
        }
      }
    }
    if (r.include_usage) {
      json u = {{"id", id},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created_at},
                {"model", o.served_model_name},
                {"choices", json::array()},
                {"usage", usage(choices, prompt.size())}};
      if (!res.write_chunk(sse(u))) return cancel_all();
    }
    res.write_chunk("data: [DONE]\n\n");
    res.end_stream();
    std::lock_guard lock(metrics_mu);
    e2e.observe(std::chrono::duration<double>(Clock::now() - t0).count());
    return 200;
  }
};

OpenAiServer::OpenAiServer(const ServeOptions& options) : impl_(std::make_unique<Impl>(options)) {
  HttpServerOptions h;
  h.host = options.host;
  h.port = options.port;
  http_ = std::make_unique<HttpServer>(h, [this](const HttpRequest& req, HttpResponse& res) { handle(req, res); });
}

OpenAiServer::~OpenAiServer() {
  if (http_) http_->stop();
}

int OpenAiServer::bind() { return http_->bind(); }
void OpenAiServer::run() { http_->run(); }
void OpenAiServer::request_stop() { http_->request_stop(); }
void OpenAiServer::stop() { http_->stop(); }

void OpenAiServer::handle(const HttpRequest& req, HttpResponse& res) {
  Impl& s = *impl_;
  const std::string& p = req.path;
  auto method_is = [&](const char* m) {
    if (req.method == m) return true;
    send_error(res, RequestError(405, "", fmt::format("{} {}: method not allowed (use {})", req.method, p, m),
                                 "MethodNotAllowed"));
    return false;
  };
  if (p == "/health") {
    if (method_is("GET")) res.send(200, "text/plain", "");
    return;
  }
  if (p == "/metrics") {
    if (method_is("GET")) res.send(200, "text/plain; version=0.0.4", s.metrics());
    return;
  }
  if (p.rfind("/v1/", 0) == 0 && !s.authorized(req)) {
    s.count("auth", 401);
    send_error(res, RequestError(401, "", "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                 "AuthenticationError"));
    return;
  }
  if (p == "/v1/models") {
    if (method_is("GET")) send_json(res, 200, s.models());
    return;
  }
  if (p == "/v1/chat/completions" || p == "/v1/completions") {
    if (method_is("POST")) s.handle_generate(req, res, p == "/v1/chat/completions");
    return;
  }
  send_error(res, RequestError(404, "", fmt::format("no route {} {}", req.method, p), "NotFoundError"));
}

}  // namespace nibble
