// nibble run: generate from a prompt (text, a chat message rendered with the model's chat
// template, or token ids for debugging) and stream the result.
// Sampling defaults come from the model's generation_config.json, as in vLLM; flags override them.
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/status.h"
#include "model/model.h"
#include "runtime/generate.h"
#include "server/reasoning.h"
#include "tokenizer/chat_template.h"

namespace nibble::cli {
namespace {

struct RunOptions {
  std::string model_dir, prompt, prompt_ids, chat, system, chat_template_kwargs, device = "cpu";
  int64_t n_predict = 128, max_model_len = 0, logprobs = -1;
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int64_t> top_k;
  float presence_penalty = 0, frequency_penalty = 0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool json = false, ignore_eos = false, enforce_eager = false;
  std::string kv_cache_dtype = "auto";
  std::string quantize_layers, quantize_format = "int4";
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    NIBBLE_CHECK(used == item.size() && !item.empty() && v >= 0 && v <= INT32_MAX,
                 "--prompt-ids: '{}' is not a token id", item);
    ids.push_back(int32_t(v));
  }
  NIBBLE_CHECK(!ids.empty(), "--prompt-ids: no token ids given");
  return ids;
}

void run(const RunOptions& o) {
  NIBBLE_CHECK(int(!o.prompt.empty()) + int(!o.prompt_ids.empty()) + int(!o.chat.empty()) == 1,
               "give exactly one of --prompt, --chat and --prompt-ids");
  NIBBLE_CHECK(o.system.empty() || !o.chat.empty(), "--system needs --chat");
  auto backend = make_backend(o.device);
  LoadOptions load;
  load.enforce_eager = o.enforce_eager;
  load.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  load.quantize_layers = parse_quantize_layers(o.quantize_layers);
  load.quantize_format = o.quantize_format;
  auto model = load_model(o.model_dir, *backend, load);
  const std::string tok_path = (std::filesystem::path(o.model_dir) / "tokenizer.json").string();
  NIBBLE_CHECK(std::filesystem::exists(tok_path), "{}: missing (nibble run needs the model's "
               "tokenizer)", tok_path);
  Tokenizer tokenizer = Tokenizer::from_file(tok_path);
  const ModelConfig& config = model->config();
  GenerationConfig gen = load_generation_config(o.model_dir);

  GenerateRequest req;
  // A harmony model (gpt-oss) answers in channels: its reasoning goes to stderr, the answer (and
  // any tool call) to stdout, the markers to neither.
  std::unique_ptr<HarmonyParser> harmony;
  if (!o.chat.empty()) {
    nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
    if (!o.chat_template_kwargs.empty()) {
      kwargs = nlohmann::ordered_json::parse(o.chat_template_kwargs, nullptr, false);
      NIBBLE_CHECK(kwargs.is_object(), "--chat-template-kwargs: '{}' is not a JSON object", o.chat_template_kwargs);
    }
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!o.system.empty()) messages.push_back({{"role", "system"}, {"content", o.system}});
    messages.push_back({{"role", "user"}, {"content", o.chat}});
    const std::string source = load_chat_template_source(o.model_dir);
    const ChatTemplate tmpl = ChatTemplate::parse(source, o.model_dir + " chat template");
    if (source.find("<|channel|>") != std::string::npos) {
      harmony = std::make_unique<HarmonyParser>();
      req.skip_special_tokens = false;
    }
    const std::string text = tmpl.render(chat_template_context(o.model_dir, messages, nullptr, true, kwargs));
    req.prompt = tokenizer.encode(text);
  } else {
    req.prompt = o.prompt_ids.empty() ? tokenizer.encode(o.prompt) : parse_ids(o.prompt_ids);
  }
  req.max_new_tokens = o.n_predict;
  req.max_context = o.max_model_len > 0 ? o.max_model_len : config.max_position_embeddings;
  req.top_logprobs = o.logprobs;
  req.stop_strings = o.stop;
  if (!o.ignore_eos) req.stop_ids = eos_token_ids(gen, config);
  SamplingParams& s = req.sampling;
  apply_generation_defaults({o.temperature, o.top_p, o.min_p, o.repetition_penalty, o.top_k}, gen, s);
  s.presence_penalty = o.presence_penalty;
  s.frequency_penalty = o.frequency_penalty;
  s.seed = o.seed;

  auto show = [](const OutputSplitter::Delta& d) {
    std::cerr << d.reasoning;
    std::cout << d.content;
    for (auto& t : d.tool_calls) std::cout << (t.name.empty() ? "" : "\n[call " + t.name + "] ") << t.arguments;
  };
  auto on_token = [&](const GeneratedToken& tok, std::string_view text) {
    if (harmony && !o.json) {
      show(harmony->push(text));
    } else if (o.json) {
      if (tok.id < 0) return;
      nlohmann::json line = {{"id", tok.id}, {"text", std::string(text)}};
      if (o.logprobs >= 0) {
        line["logprob"] = tok.logprob;
        nlohmann::json top = nlohmann::json::array();
        for (auto& t : tok.top) top.push_back({{"id", t.id}, {"logprob", t.logprob}});
        line["top_logprobs"] = top;
      }
      std::cout << line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
    } else {
      std::cout << text;
    }
    std::cout.flush();
  };
  GenerateResult r = generate(*model, tokenizer, req, on_token);
  if (harmony && !o.json) show(harmony->flush());
  if (!o.json) std::cout << '\n';
  const double n_gen = double(r.ids.size());
  fmt::print(stderr, "\nprompt: {} tokens, {:.1f} tok/s | generated: {} tokens, {:.1f} tok/s | "
             "finish: {}\n", req.prompt.size(),
             r.prefill_seconds > 0 ? double(req.prompt.size()) / r.prefill_seconds : 0.0,
             r.ids.size(), n_gen > 1 && r.decode_seconds > 0 ? (n_gen - 1) / r.decode_seconds : 0.0,
             r.finish_reason);
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* cmd = app.add_subcommand("run", "Generate text from a prompt");
  cmd->add_option("-m,--model", o->model_dir, "Hugging Face model directory")->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("-p,--prompt", o->prompt, "Prompt text");
  cmd->add_option("--prompt-ids", o->prompt_ids, "Prompt as comma-separated token ids");
  cmd->add_option("--chat", o->chat, "A user message, rendered with the model's chat template");
  cmd->add_option("--system", o->system, "A system message before --chat");
  cmd->add_option("--chat-template-kwargs", o->chat_template_kwargs,
                  "JSON object of extra template variables, e.g. '{\"enable_thinking\": false}'");
  cmd->add_option("-n,--max-tokens", o->n_predict, "Tokens to generate")->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", o->temperature, "0 = greedy (default: generation_config)");
  cmd->add_option("--top-k", o->top_k, "Keep the k most likely tokens (0 = off)");
  cmd->add_option("--top-p", o->top_p, "Nucleus sampling mass");
  cmd->add_option("--min-p", o->min_p, "Drop tokens below min_p x the best probability");
  cmd->add_option("--repetition-penalty", o->repetition_penalty, "Penalty on prompt and output tokens");
  cmd->add_option("--presence-penalty", o->presence_penalty, "OpenAI presence penalty");
  cmd->add_option("--frequency-penalty", o->frequency_penalty, "OpenAI frequency penalty");
  cmd->add_option("--seed", o->seed, "Sampling seed");
  cmd->add_option("--stop", o->stop, "Stop string (repeatable)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "Do not stop at EOS tokens");
  cmd->add_option("--logprobs", o->logprobs, "Report the chosen token's logprob and the top K")
      ->check(CLI::Range(0, 100));
  cmd->add_flag("--json", o->json, "One JSON line per generated token");
  cmd->add_option("--max-model-len", o->max_model_len, "Context length (default: the model's)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--device", o->device, "cpu or cuda");
  cmd->add_flag("--enforce-eager", o->enforce_eager, "Launch every op as it comes (no recorded graphs)");
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "KV cache element type: auto (float16), float32 or fp8 (E4M3, half the bytes of float16)");
  cmd->add_option("--quantize-layers", o->quantize_layers,
                  "Quantize these 16-bit layers to 4 bits at load: a list of lm_head, qkv, o, router (see --quantize-format)");
  cmd->add_option("--quantize-format", o->quantize_format,
                  "Format of --quantize-layers: int4 (group 128, the default) or mxfp4 (blocks of 32, gpt-oss's)");
  cmd->callback([o] { run(*o); });
}

}  // namespace nibble::cli
