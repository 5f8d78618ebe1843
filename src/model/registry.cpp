#include <cmath>
#include <numbers>

#include "core/status.h"
#include "model/arch/registry.h"

namespace nibble {
namespace {

struct Architecture {
  const char* model_type;
  CreateModelFn create;
};

constexpr Architecture kArchitectures[] = {
    {"qwen3_moe", create_qwen3_moe},
    {"qwen3", create_qwen3_moe},  // dense Qwen3: the same graph with num_experts = 0
    {"gpt_oss", create_gpt_oss},
};

}  // namespace

std::vector<std::string> supported_model_types() {
  std::vector<std::string> out;
  for (auto& a : kArchitectures) out.push_back(a.model_type);
  return out;
}

std::vector<std::string> parse_quantize_layers(const std::string& list) {
  std::vector<std::string> roles;
  size_t at = 0;
  while (at <= list.size() && !list.empty()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string role = list.substr(at, comma - at);
    NIBBLE_CHECK(role == "lm_head" || role == "qkv" || role == "o" || role == "router",
                 "--quantize-layers: unknown layer '{}' (expected a comma-separated list of lm_head, qkv, o, router)",
                 role);
    roles.push_back(role);
    at = comma + 1;
  }
  return roles;
}

std::unique_ptr<Model> load_model(const std::string& model_dir, Backend& backend,
                                  const LoadOptions& options) {
  ModelConfig config = load_model_config(model_dir);
  NIBBLE_CHECK(options.load_format == "auto" || options.load_format == "dummy",
               "--load-format {}: expected auto or dummy", options.load_format);
  NIBBLE_CHECK(options.quantization.empty() || options.load_format == "dummy",
               "--quantization applies to --load-format dummy (checkpoints carry their own format)");
  NIBBLE_CHECK(options.quantization.empty() || options.quantization == "int4" || options.quantization == "mxfp4",
               "--quantization {}: expected int4 or mxfp4", options.quantization);
  NIBBLE_CHECK(options.quantization != "mxfp4" || config.model_type == "gpt_oss", "--quantization mxfp4: "
               "dummy MXFP4 weights are made for gpt_oss experts only (model_type is {})", config.model_type);
  NIBBLE_CHECK(options.quantize_format == "int4" || options.quantize_format == "mxfp4",
               "--quantize-format {}: expected int4 or mxfp4", options.quantize_format);
  for (auto& a : kArchitectures) {
    if (config.model_type != a.model_type) continue;
    std::unique_ptr<WeightSource> source;
    if (options.load_format == "dummy") {
      // gpt-oss's own config.json declares its MXFP4 experts: dummy weights follow it.
      std::string quantization = options.quantization;
      if (quantization.empty() && config.quant.method == "mxfp4") quantization = "mxfp4";
      NIBBLE_CHECK(config.quant.method.empty() || config.quant.method == quantization,
                   "{}: --load-format dummy needs an unquantized config or gpt-oss's MXFP4 one (use "
                   "--quantization int4 for 4-bit weights)", config.path);
      if (!quantization.empty()) {  // what a checkpoint of that format would declare
        config.quant.method = quantization == "int4" ? "gptq" : "mxfp4";
        config.quant.bits = 4;
        config.quant.group_size = quantization == "int4" ? options.group_size : 32;
      }
      source = dummy_source(config, backend, {.int4 = quantization == "int4", .mxfp4 = quantization == "mxfp4",
                                              .group_size = options.group_size});
    } else {
      source = checkpoint_source(std::make_shared<const Checkpoint>(Checkpoint::open(model_dir)),
                                 config, backend);
    }
    source->quantize_at_load(options.quantize_layers, options.quantize_group_size, options.quantize_format);
    auto model = a.create(config, *source, backend);
    source->finish();
    model->set_use_graphs(!options.enforce_eager);
    model->set_kv_dtype(options.kv_cache_dtype);
    return model;
  }
  std::string list;
  for (auto& t : supported_model_types()) list += (list.empty() ? "" : ", ") + t;
  fail("{}: model_type '{}' is not supported (supported: {})", config.path, config.model_type, list);
}

// inv_freq[i] = theta^(-2i/d); YaRN blends interpolated and extrapolated frequencies with a linear
// ramp between the correction dimensions and scales cos/sin by its attention factor (transformers'
// _compute_yarn_parameters).
RopeTable make_rope_table(const ModelConfig& config) {
  const auto& r = config.rope;
  const int64_t dim = config.head_dim;
  RopeTable table;
  std::vector<float> inv_freq(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i)
    inv_freq[size_t(i)] = float(1.0 / std::pow(r.theta, double(2 * i) / double(dim)));
  if (r.type != "yarn") {
    table.inv_freq = host_vector(std::move(inv_freq));
    return table;
  }

  auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  table.attention_factor = float(r.attention_factor > 0 ? r.attention_factor
                                 : (r.mscale != 0 && r.mscale_all_dim != 0)
                                     ? mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
                                     : mscale(r.factor, 1.0));
  auto correction_dim = [&](double rotations) {
    return double(dim) * std::log(r.original_max_position_embeddings /
                                  (rotations * 2 * std::numbers::pi)) / (2 * std::log(r.theta));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1.0 - ramp;
    const double f = inv_freq[size_t(i)];
    inv_freq[size_t(i)] = float(f / r.factor * (1 - extrapolation) + f * extrapolation);
  }
  table.inv_freq = host_vector(std::move(inv_freq));
  return table;
}

DType parse_kv_cache_dtype(const std::string& name) {
  if (name == "auto" || name == "float16" || name == "fp16" || name == "f16") return DType::F16;
  if (name == "float32" || name == "fp32" || name == "f32") return DType::F32;
  if (name == "fp8" || name == "fp8_e4m3") return DType::F8_E4M3;
  fail("--kv-cache-dtype '{}': expected auto, float16, float32 or fp8 (fp8_e4m3)", name);
}

}  // namespace nibble
