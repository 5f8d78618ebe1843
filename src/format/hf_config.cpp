#include "format/hf_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/status.h"

namespace nibble {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct Reader {
  const json& j;
  const std::string& path;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }

  int64_t integer(const char* key, int64_t fallback, bool required = false) const {
    if (!has(key)) {
      NIBBLE_CHECK(!required, "{}: missing required field '{}'", path, key);
      return fallback;
    }
    NIBBLE_CHECK(j[key].is_number_integer(), "{}: field '{}' must be an integer, got {}", path, key,
                 j[key].dump());
    return j[key].get<int64_t>();
  }
  int64_t positive(const char* key, bool required = true, int64_t fallback = 0) const {
    int64_t v = integer(key, fallback, required);
    NIBBLE_CHECK(v > 0 || (!required && !has(key)), "{}: field '{}' must be positive, got {}", path,
                 key, v);
    return v;
  }
  double number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    NIBBLE_CHECK(j[key].is_number(), "{}: field '{}' must be a number, got {}", path, key,
                 j[key].dump());
    return j[key].get<double>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    NIBBLE_CHECK(j[key].is_boolean(), "{}: field '{}' must be true or false, got {}", path, key,
                 j[key].dump());
    return j[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    NIBBLE_CHECK(j[key].is_string(), "{}: field '{}' must be a string, got {}", path, key,
                 j[key].dump());
    return j[key].get<std::string>();
  }
  std::vector<int64_t> int_list(const char* key) const {  // accepts a single integer too
    std::vector<int64_t> out;
    if (!has(key)) return out;
    if (j[key].is_number_integer()) return {j[key].get<int64_t>()};
    NIBBLE_CHECK(j[key].is_array(), "{}: field '{}' must be an integer or a list of integers", path,
                 key);
    for (auto& v : j[key]) {
      NIBBLE_CHECK(v.is_number_integer(), "{}: field '{}' must hold integers, got {}", path, key,
                   v.dump());
      out.push_back(v.get<int64_t>());
    }
    return out;
  }
};

RopeConfig parse_rope(const json& j, const std::string& path) {
  Reader r{j, path};
  RopeConfig rope;
  rope.theta = r.number("rope_theta", 10000.0);
  // transformers 5 writes rope_parameters (holding rope_theta); 4 wrote rope_scaling next to it.
  const json* params = nullptr;
  std::string field;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (r.has(key)) {
      NIBBLE_CHECK(j[key].is_object(), "{}: field '{}' must be an object", path, key);
      params = &j[key];
      field = key;
      break;
    }
  }
  if (!params) return rope;
  Reader p{*params, path};
  rope.theta = p.number("rope_theta", rope.theta);
  rope.type = p.string("rope_type", p.string("type", "default"));
  if (rope.type == "default") return rope;
  NIBBLE_CHECK(rope.type == "yarn", "{}: {}.rope_type '{}' is not supported (supported: default, "
               "yarn)", path, field, rope.type);
  rope.factor = p.number("factor", 0);
  rope.original_max_position_embeddings =
      p.number("original_max_position_embeddings", r.number("max_position_embeddings", 0));
  NIBBLE_CHECK(rope.original_max_position_embeddings > 0,
               "{}: {}.original_max_position_embeddings is required for yarn", path, field);
  if (rope.factor == 0)
    rope.factor = r.number("max_position_embeddings", 0) / rope.original_max_position_embeddings;
  NIBBLE_CHECK(rope.factor > 0, "{}: {}.factor must be positive", path, field);
  rope.beta_fast = p.number("beta_fast", 32);
  rope.beta_slow = p.number("beta_slow", 1);
  if (rope.beta_fast == 0) rope.beta_fast = 32;  // transformers: `get("beta_fast") or 32`
  if (rope.beta_slow == 0) rope.beta_slow = 1;
  rope.attention_factor = p.number("attention_factor", 0);
  rope.mscale = p.number("mscale", 0);
  rope.mscale_all_dim = p.number("mscale_all_dim", 0);
  rope.truncate = p.boolean("truncate", true);
  return rope;
}

QuantConfig parse_quant(const json& j, const std::string& path) {
  QuantConfig q;
  if (!j.contains("quantization_config") || j["quantization_config"].is_null()) return q;
  const json& qc = j["quantization_config"];
  NIBBLE_CHECK(qc.is_object(), "{}: quantization_config must be an object", path);
  Reader r{qc, path};
  q.method = r.string("quant_method", "");
  NIBBLE_CHECK(q.method == "gptq" || q.method == "auto-round" || q.method == "mxfp4",
               "{}: quantization_config.quant_method '{}' is not supported (supported: gptq, "
               "auto-round, mxfp4)", path, q.method);
  if (q.method == "mxfp4") {  // gpt-oss: the format is fixed, only the unconverted modules are listed
    q.bits = 4;
    q.group_size = 32;
    if (r.has("modules_to_not_convert")) {
      NIBBLE_CHECK(qc["modules_to_not_convert"].is_array(), "{}: quantization_config.modules_to_not_convert "
                   "must be a list of strings", path);
      for (auto& m : qc["modules_to_not_convert"]) {
        NIBBLE_CHECK(m.is_string(), "{}: quantization_config.modules_to_not_convert must hold strings, got {}",
                     path, m.dump());
        q.modules_to_not_convert.push_back(m.get<std::string>());
      }
    }
    return q;
  }
  q.bits = int(r.integer("bits", 0, true));
  NIBBLE_CHECK(q.bits == 4, "{}: quantization_config.bits = {} is not supported (only 4)", path,
               q.bits);
  q.group_size = int(r.integer("group_size", -1));
  NIBBLE_CHECK(q.group_size == -1 || (q.group_size > 0 && q.group_size % 8 == 0),
               "{}: quantization_config.group_size = {} must be -1 or a positive multiple of 8",
               path, q.group_size);
  q.sym = r.boolean("sym", true);
  q.desc_act = r.boolean("desc_act", false);
  NIBBLE_CHECK(!q.desc_act || q.group_size == -1, "{}: quantization_config.desc_act = true "
               "(activation reordering) is not supported", path);
  std::string data_type = r.string("data_type", "int");
  NIBBLE_CHECK(data_type == "int", "{}: quantization_config.data_type '{}' is not supported "
               "(only int)", path, data_type);
  if (q.method == "gptq") {
    q.zero_minus_one = r.string("checkpoint_format", "gptq") != "gptq_v2";
  } else {
    // AutoRound rewrites symmetric int packing to "auto_round:auto_gptq" (GPTQ v1 zeros); its own
    // "auto_round" packer stores zeros as they are.
    std::string packing = r.string("packing_format", "auto_round:auto_gptq");
    q.zero_minus_one = packing.find("gptq") != std::string::npos;
  }
  return q;
}

}  // namespace

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
    return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  NIBBLE_CHECK(in.good(), "{}: cannot open", path);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", path, e.what());
  }
}

ModelConfig parse_model_config(const json& j, const std::string& path) {
  NIBBLE_CHECK(j.is_object(), "{}: must hold a JSON object", path);
  Reader r{j, path};
  ModelConfig c;
  c.path = path;
  c.model_type = r.string("model_type", "");
  NIBBLE_CHECK(!c.model_type.empty(), "{}: missing required field 'model_type'", path);
  if (r.has("architectures") && j["architectures"].is_array())
    for (auto& a : j["architectures"])
      if (a.is_string()) c.architectures.push_back(a.get<std::string>());
  c.dtype = r.string("dtype", r.string("torch_dtype", "bfloat16"));

  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.num_hidden_layers = r.positive("num_hidden_layers");
  c.num_attention_heads = r.positive("num_attention_heads");
  c.num_key_value_heads = r.positive("num_key_value_heads", false, c.num_attention_heads);
  NIBBLE_CHECK(c.num_attention_heads % c.num_key_value_heads == 0, "{}: num_attention_heads ({}) "
               "must be a multiple of num_key_value_heads ({})", path, c.num_attention_heads,
               c.num_key_value_heads);
  c.head_dim = r.positive("head_dim", false, c.hidden_size / c.num_attention_heads);
  NIBBLE_CHECK(c.head_dim % 2 == 0, "{}: head_dim ({}) must be even for RoPE", path, c.head_dim);
  c.intermediate_size = r.integer("intermediate_size", 0);
  c.max_position_embeddings = r.positive("max_position_embeddings", false, 32768);
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  c.attention_bias = r.boolean("attention_bias", false);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  c.hidden_act = r.string("hidden_act", "silu");
  NIBBLE_CHECK(c.hidden_act == "silu", "{}: hidden_act '{}' is not supported (only silu)", path,
               c.hidden_act);
  c.rope = parse_rope(j, path);
  NIBBLE_CHECK(!r.boolean("use_sliding_window", false), "{}: use_sliding_window = true is not "
               "supported for {}", path, c.model_type);
  if (r.has("layer_types")) {
    NIBBLE_CHECK(j["layer_types"].is_array() && int64_t(j["layer_types"].size()) == c.num_hidden_layers,
                 "{}: field 'layer_types' must be a list of {} strings (num_hidden_layers)", path,
                 c.num_hidden_layers);
    for (auto& t : j["layer_types"]) {
      NIBBLE_CHECK(t.is_string() && (t == "full_attention" || t == "sliding_attention"), "{}: layer_types "
                   "entry {} is not supported (expected full_attention or sliding_attention)", path, t.dump());
      c.layer_types.push_back(t.get<std::string>());
    }
  } else if (c.model_type == "gpt_oss") {  // GptOssConfig's default: even layers slide
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
  }
  if (std::find(c.layer_types.begin(), c.layer_types.end(), "sliding_attention") != c.layer_types.end())
    c.sliding_window = r.positive("sliding_window");
  c.swiglu_limit = r.number("swiglu_limit", 0);
  NIBBLE_CHECK(c.swiglu_limit >= 0, "{}: field 'swiglu_limit' must not be negative", path);

  // transformers 5 writes num_experts under its attribute-map name num_local_experts.
  c.num_experts = r.integer("num_experts", r.integer("num_local_experts", 0));
  NIBBLE_CHECK(c.num_experts >= 0, "{}: field 'num_experts' must not be negative", path);
  if (c.num_experts > 0) {
    c.num_experts_per_tok = r.positive("num_experts_per_tok");
    NIBBLE_CHECK(c.num_experts_per_tok <= c.num_experts, "{}: num_experts_per_tok ({}) exceeds "
                 "num_experts ({})", path, c.num_experts_per_tok, c.num_experts);
    // gpt-oss (like Mixtral) names the experts' width intermediate_size.
    c.moe_intermediate_size = r.has("moe_intermediate_size") ? r.positive("moe_intermediate_size")
                                                              : r.positive("intermediate_size");
    c.norm_topk_prob = r.boolean("norm_topk_prob", true);
    c.decoder_sparse_step = r.positive("decoder_sparse_step", false, 1);
    c.mlp_only_layers = r.int_list("mlp_only_layers");
  }
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer)
    NIBBLE_CHECK(c.is_moe_layer(layer) || c.intermediate_size > 0, "{}: layer {} is a dense MLP "
                 "layer but 'intermediate_size' is missing", path, layer);
  c.eos_token_ids = r.int_list("eos_token_id");
  c.bos_token_id = r.integer("bos_token_id", -1);
  c.quant = parse_quant(j, path);
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  const std::string path = (fs::path(model_dir) / "config.json").string();
  NIBBLE_CHECK(fs::exists(path), "{}: missing (is {} a Hugging Face model directory?)", path,
               model_dir);
  return parse_model_config(read_json_file(path), path);
}

GenerationConfig load_generation_config(const std::string& model_dir) {
  GenerationConfig g;
  const std::string path = (fs::path(model_dir) / "generation_config.json").string();
  if (!fs::exists(path)) return g;
  json j = read_json_file(path);
  NIBBLE_CHECK(j.is_object(), "{}: must hold a JSON object", path);
  Reader r{j, path};
  g.eos_token_ids = r.int_list("eos_token_id");
  g.temperature = r.number("temperature", -1);
  g.top_p = r.number("top_p", -1);
  g.min_p = r.number("min_p", -1);
  g.top_k = r.integer("top_k", -1);
  g.repetition_penalty = r.number("repetition_penalty", -1);
  return g;
}

}  // namespace nibble
