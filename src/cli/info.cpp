// nibble info: what a checkpoint is and what decoding it costs, from config.json and the
// safetensors headers alone (no weights are read, so it is instant on a 60 GB model).
#include <fmt/format.h>

#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/status.h"
#include "format/hf_config.h"
#include "format/safetensors.h"
#include "model/model.h"

namespace nibble::cli {
namespace {

struct InfoOptions {
  std::string model_dir;
  bool json = false;
};

struct FormatStats {
  int64_t tensors = 0, params = 0, bytes = 0;
};

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (b >= 1000 && u < 4) b /= 1000, ++u;
  return fmt::format("{:.2f} {}", b, units[u]);
}

void info(const InfoOptions& o) {
  ModelConfig c = load_model_config(o.model_dir);
  auto types = supported_model_types();
  const bool supported = std::find(types.begin(), types.end(), c.model_type) != types.end();
  Checkpoint ckpt = Checkpoint::open(o.model_dir);

  // Parameters and bytes by module. GPTQ modules count K·N parameters (8 per qweight word) and
  // their qweight + qzeros + scales (+ g_idx) bytes. Per decoded token the model reads every
  // non-expert weight, top-k of n experts' weights, and one row of the embedding table.
  std::map<std::string, FormatStats> formats;
  double total_params = 0, expert_params = 0, bytes_dense = 0, bytes_experts = 0;
  double embed_bytes = 0, embed_row_bytes = 0;
  for (auto& [name, t] : ckpt.tensors()) {
    const bool gptq_part = name.ends_with(".qzeros") || name.ends_with(".scales") ||
                           name.ends_with(".g_idx");
    // gpt-oss MXFP4: `_blocks` hold two weights a byte, `_scales` belong to them.
    const bool mxfp4 = name.ends_with("_blocks"), mxfp4_part = name.ends_with("_scales");
    double params = name.ends_with(".qweight") ? double(t->numel()) * 8
                    : mxfp4                    ? double(t->numel()) * 2
                    : gptq_part || mxfp4_part  ? 0
                                               : double(t->numel());
    std::string fmt_name = name.ends_with(".qweight") || gptq_part
                               ? fmt::format("INT4 ({} g{}{})", c.quant.method, c.quant.group_size,
                                             c.quant.sym ? " sym" : " asym")
                           : mxfp4 || mxfp4_part ? std::string("MXFP4 (e2m1, e8m0/32)")
                                                 : std::string(dtype_name(t->dtype));
    auto& f = formats[fmt_name];
    f.tensors += gptq_part || mxfp4_part ? 0 : 1;
    f.params += int64_t(params);
    f.bytes += int64_t(t->nbytes);
    total_params += params;
    if (name.find(".mlp.experts.") != std::string::npos || name.ends_with(".mlp.experts.gate_up_proj") ||
        name.ends_with(".mlp.experts.down_proj")) {
      expert_params += params;
      bytes_experts += double(t->nbytes);
    } else if (name == "model.embed_tokens.weight") {
      embed_bytes = double(t->nbytes);
      embed_row_bytes = t->shape.size() == 2 ? double(t->nbytes) / double(t->shape[0]) : 0;
    } else {
      bytes_dense += double(t->nbytes);
    }
  }
  const bool tied = c.tie_word_embeddings && !ckpt.has("lm_head.weight") && !ckpt.has("lm_head.qweight");
  const double active_fraction = c.num_experts > 0 ? double(c.num_experts_per_tok) / double(c.num_experts) : 1.0;
  const double active_params = total_params - expert_params * (1 - active_fraction);
  const double bytes_per_token = bytes_dense + bytes_experts * active_fraction +
                                 (tied ? embed_bytes : embed_row_bytes);
  const int64_t kv_elems_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim;
  int64_t sliding_layers = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) sliding_layers += c.layer_window(i) > 0;

  if (o.json) {
    nlohmann::json j = {{"model_type", c.model_type}, {"supported", supported},
                        {"architectures", c.architectures}, {"layers", c.num_hidden_layers},
                        {"hidden_size", c.hidden_size}, {"num_attention_heads", c.num_attention_heads},
                        {"num_key_value_heads", c.num_key_value_heads}, {"head_dim", c.head_dim},
                        {"num_experts", c.num_experts}, {"num_experts_per_tok", c.num_experts_per_tok},
                        {"vocab_size", c.vocab_size}, {"params_total", int64_t(total_params)},
                        {"params_active_per_token", int64_t(active_params)},
                        {"weight_bytes_per_token", int64_t(bytes_per_token)},
                        {"kv_bytes_per_token_bf16", kv_elems_per_token * 2},
                        {"kv_bytes_per_token_f32", kv_elems_per_token * 4},
                        {"sliding_window_layers", sliding_layers}, {"sliding_window", c.sliding_window}};
    for (auto& [name, f] : formats)
      j["formats"][name] = {{"tensors", f.tensors}, {"params", f.params}, {"bytes", f.bytes}};
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("model:         {}\n", o.model_dir);
  fmt::print("architecture:  {}{}{}\n", c.model_type,
             c.architectures.empty() ? "" : " (" + c.architectures[0] + ")",
             supported ? "" : "  [not supported by nibble run]");
  fmt::print("shape:         {} layers, hidden {}, {} q / {} kv heads x {}, vocab {}\n",
             c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
             c.head_dim, c.vocab_size);
  if (c.num_experts > 0)
    fmt::print("experts:       {} per MoE layer, top {}, expert FFN {}\n", c.num_experts,
               c.num_experts_per_tok, c.moe_intermediate_size);
  fmt::print("parameters:    {} total, {} active per token\n", human_count(total_params),
             human_count(active_params));
  fmt::print("formats:\n");
  for (auto& [name, f] : formats)
    fmt::print("  {:<22} {:>6} tensors  {:>10} params  {}\n", name, f.tensors,
               human_count(double(f.params)), human_bytes(double(f.bytes)));
  fmt::print("weights read per decoded token: {}\n", human_bytes(bytes_per_token));
  fmt::print("KV cache per token: {} in f16 (the default), {} in fp8, {} in f32 (--kv-cache-dtype)\n",
             human_bytes(double(kv_elems_per_token * 2)), human_bytes(double(kv_elems_per_token)),
             human_bytes(double(kv_elems_per_token * 4)));
  if (sliding_layers > 0)
    fmt::print("sliding window: {} of {} layers attend to the last {} positions and keep only those (nibble serve: "
               "a pool of their own; run/bench: a ring of the window + {} positions), so a long context costs {} "
               "per token in f16 (the other layers)\n",
               sliding_layers, c.num_hidden_layers, c.sliding_window, KvCache::kDefaultRingChunk,
               human_bytes(double(kv_elems_per_token * 2 * (c.num_hidden_layers - sliding_layers) /
                                  c.num_hidden_layers)));
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto o = std::make_shared<InfoOptions>();
  CLI::App* cmd = app.add_subcommand("info", "Describe a checkpoint: architecture, sizes, formats");
  cmd->add_option("-m,--model", o->model_dir, "Hugging Face model directory")->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->callback([o] { info(*o); });
}

}  // namespace nibble::cli
