// config.json and generation_config.json of a Hugging Face checkpoint, parsed into the fields the
// engine uses. Unknown fields are ignored, missing required ones and impossible values are Errors
// naming the file and the field. Both the transformers 4 spelling (rope_theta + rope_scaling) and
// the transformers 5 one (rope_parameters) are accepted.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace nibble {

struct RopeConfig {
  std::string type = "default";  // "default" or "yarn"
  double theta = 10000.0;
  double factor = 1.0;
  double original_max_position_embeddings = 0;
  double beta_fast = 32, beta_slow = 1;
  double attention_factor = 0;  // 0: derived from factor (and mscale / mscale_all_dim)
  double mscale = 0, mscale_all_dim = 0;
  bool truncate = true;
};

// Weight-only 4-bit formats (quantization_config in config.json): INT4 as written by
// GPTQ/AutoRound, or MXFP4 as gpt-oss ships its experts.
struct QuantConfig {
  std::string method;  // "" (none), "gptq", "auto-round", "mxfp4"
  int bits = 0;
  int group_size = 0;  // -1: one group spanning K
  bool sym = true;
  bool desc_act = false;
  // Stored zero points are the true zero minus one (GPTQ v1 and AutoRound's gptq packing).
  bool zero_minus_one = true;
  // mxfp4: module patterns left in 16 bits ("model.layers.*.self_attn", "lm_head", ...).
  std::vector<std::string> modules_to_not_convert;
};

struct ModelConfig {
  std::string path;  // config.json, for messages
  std::string model_type;
  std::vector<std::string> architectures;
  std::string dtype;  // "bfloat16", "float16", "float32" as stored

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  std::string hidden_act = "silu";
  RopeConfig rope;
  // Per layer "full_attention" or "sliding_attention" (empty: all full); sliding layers attend to
  // the last `sliding_window` positions, their own included (transformers' mask: kv > q - window).
  std::vector<std::string> layer_types;
  int64_t sliding_window = 0;
  double swiglu_limit = 0;  // gpt-oss's clamped SwiGLU experts

  // Mixture of experts (0 experts: dense).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;

  std::vector<int64_t> eos_token_ids;
  int64_t bos_token_id = -1;
  QuantConfig quant;

  bool is_moe_layer(int64_t layer) const;
  // The window of layer `layer`'s attention in positions, 0 for full attention.
  int64_t layer_window(int64_t layer) const {
    return !layer_types.empty() && layer_types[size_t(layer)] == "sliding_attention" ? sliding_window : 0;
  }
};

// Sampling defaults and stop ids from generation_config.json (all optional).
struct GenerationConfig {
  std::vector<int64_t> eos_token_ids;
  double temperature = -1, top_p = -1, min_p = -1, repetition_penalty = -1;
  int64_t top_k = -1;
};

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& path);
ModelConfig load_model_config(const std::string& model_dir);
GenerationConfig load_generation_config(const std::string& model_dir);
nlohmann::json read_json_file(const std::string& path);

}  // namespace nibble
