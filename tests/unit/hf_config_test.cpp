// config.json parsing: a real checkpoint's config, the two RoPE spellings, YaRN frequencies against
// an independent transcription of transformers' _compute_yarn_parameters, and the Errors that
// name the file and the field for configs the engine cannot run.
#include "format/hf_config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"

namespace nibble {
namespace {

using json = nlohmann::json;

// Qwen/Qwen3-Coder-30B-A3B-Instruct config.json, verbatim (embedded: tests must not depend on
// files outside the repository).
constexpr const char* kQwen3CoderConfig = R"json({
  "architectures": [
    "Qwen3MoeForCausalLM"
  ],
  "attention_dropout": 0.0,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5472,
  "max_position_embeddings": 262144,
  "max_window_layers": 28,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "qkv_bias": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 10000000,
  "router_aux_loss_coef": 0.0,
  "shared_expert_intermediate_size": 0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.52.3",
  "use_cache": true,
  "use_qk_norm": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})json";

// gpt-oss-20b's config.json as published in a third-party copy (jihengzhang/jihz-gpt-oss-20b; the
// official file adds quantization_config, which GptOss20bRealConfig adds the way the converter
// writes it), verbatim.
constexpr const char* kGptOss20bConfig = R"json({
  "architectures": [
    "GptOssForCausalLM"
  ],
  "attention_bias": true,
  "attention_dropout": 0.0,
  "eos_token_id": 200002,
  "experts_per_token": 4,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2880,
  "initial_context_length": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 2880,
  "layer_types": [
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention"
  ],
  "max_position_embeddings": 131072,
  "model_type": "gpt_oss",
  "num_attention_heads": 64,
  "num_experts_per_tok": 4,
  "num_hidden_layers": 24,
  "num_key_value_heads": 8,
  "num_local_experts": 32,
  "output_router_logits": false,
  "pad_token_id": 199999,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "rope_type": "yarn",
    "truncate": false
  },
  "rope_theta": 150000,
  "router_aux_loss_coef": 0.9,
  "sliding_window": 128,
  "swiglu_limit": 7.0,
  "tie_word_embeddings": false,
  "transformers_version": "4.55.0.dev0",
  "use_cache": true,
  "vocab_size": 201088
})json";

const std::string kPath = "/models/test/config.json";

// A small dense config that parses; error tests break one field of it.
json dense() {
  return json::parse(R"({"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64})");
}

json moe() {
  json j = dense();
  j["model_type"] = "qwen3_moe";
  j.erase("intermediate_size");
  j["num_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 128;
  return j;
}

TEST(HfConfig, Qwen3CoderRealConfig) {
  ModelConfig c = parse_model_config(json::parse(kQwen3CoderConfig), kPath);
  EXPECT_EQ(c.path, kPath);
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.architectures, std::vector<std::string>{"Qwen3MoeForCausalLM"});
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.rope.type, "default");  // rope_scaling: null
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
  for (int64_t layer = 0; layer < 48; ++layer) EXPECT_TRUE(c.is_moe_layer(layer)) << layer;
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_EQ(c.quant.method, "");

  RopeTable t = make_rope_table(c);  // default RoPE: theta^(-2i/d), no attention scaling
  ASSERT_EQ(size_t(t.inv_freq.n), 64u);
  for (size_t i = 0; i < 64; ++i)
    EXPECT_NEAR(t.inv_freq.data[i], std::pow(1e7, -2.0 * double(i) / 128), 1e-6 * std::pow(1e7, -2.0 * double(i) / 128));
  EXPECT_EQ(t.attention_factor, 1.f);
}

TEST(HfConfig, MoeLayerSelection) {
  json j = moe();
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  j["intermediate_size"] = 512;
  ModelConfig c = parse_model_config(j, kPath);
  // Qwen2/3-MoE: MoE iff not in mlp_only_layers and (layer+1) % step == 0.
  std::vector<bool> got;
  for (int64_t l = 0; l < 6; ++l) got.push_back(c.is_moe_layer(l));
  EXPECT_EQ(got, (std::vector<bool>{false, true, false, false, false, true}));
}

TEST(HfConfig, RopeSpellingsAgree) {
  json v5 = dense(), v4 = dense(), v4b = dense();
  v5["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1000000.0}, {"factor", 4.0},
                           {"original_max_position_embeddings", 32768}, {"beta_fast", 16}};
  v4["rope_theta"] = 1000000;
  v4["rope_scaling"] = {{"type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", 32768},
                        {"beta_fast", 16.0}};
  v4b["rope_theta"] = 1e6;
  v4b["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768},
                         {"beta_fast", 16}};
  for (const json& other : {v4, v4b}) {
    RopeConfig a = parse_model_config(v5, kPath).rope, b = parse_model_config(other, kPath).rope;
    EXPECT_EQ(a.type, "yarn");
    EXPECT_EQ(b.type, "yarn");
    EXPECT_EQ(a.theta, 1e6);
    EXPECT_EQ(b.theta, 1e6);
    EXPECT_EQ(a.factor, 4.0);
    EXPECT_EQ(b.factor, 4.0);
    EXPECT_EQ(a.original_max_position_embeddings, b.original_max_position_embeddings);
    EXPECT_EQ(a.original_max_position_embeddings, 32768);
    EXPECT_EQ(a.beta_fast, 16);
    EXPECT_EQ(b.beta_fast, 16);
    EXPECT_EQ(a.beta_slow, b.beta_slow);
    EXPECT_EQ(a.attention_factor, b.attention_factor);
    EXPECT_EQ(a.mscale, b.mscale);
    EXPECT_EQ(a.mscale_all_dim, b.mscale_all_dim);
    EXPECT_EQ(a.truncate, b.truncate);
  }
  // transformers 5's num_local_experts is the same field as num_experts.
  json j = moe();
  j.erase("num_experts");
  j["num_local_experts"] = 32;
  EXPECT_EQ(parse_model_config(j, kPath).num_experts, 32);
}

// transformers modeling_rope_utils._compute_yarn_parameters, transcribed independently.
struct YarnRef {
  std::vector<double> inv_freq;
  double attention_factor;
};
YarnRef yarn_reference(int dim, double base, double factor, double orig, double beta_fast, double beta_slow,
                       bool truncate = true) {
  auto corr = [&](double rotations) {
    return dim * std::log(orig / (rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
  };
  double low = std::max(truncate ? std::floor(corr(beta_fast)) : corr(beta_fast), 0.0);
  double high = std::min(truncate ? std::ceil(corr(beta_slow)) : corr(beta_slow), double(dim - 1));
  if (low == high) high += 0.001;
  YarnRef r;
  r.attention_factor = 0.1 * std::log(factor) + 1.0;
  for (int i = 0; i < dim / 2; ++i) {
    double extrap = 1.0 / std::pow(base, double(2 * i) / dim);
    double interp = extrap / factor;
    double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    r.inv_freq.push_back(interp * ramp + extrap * (1 - ramp));
  }
  return r;
}

TEST(HfConfig, YarnInvFreqMatchesTransformers) {
  struct Case { int dim; double theta, factor, orig; };
  for (Case cs : {Case{128, 1e6, 4, 32768}, Case{64, 1e4, 8, 4096}, Case{128, 1e7, 2, 65536}}) {
    json j = dense();
    j["head_dim"] = cs.dim;
    j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", cs.theta}, {"factor", cs.factor},
                            {"original_max_position_embeddings", cs.orig}};
    RopeTable t = make_rope_table(parse_model_config(j, kPath));
    YarnRef ref = yarn_reference(cs.dim, cs.theta, cs.factor, cs.orig, 32, 1);
    ASSERT_EQ(size_t(t.inv_freq.n), ref.inv_freq.size());
    int interpolated = 0, extrapolated = 0;
    for (size_t i = 0; i < ref.inv_freq.size(); ++i) {
      EXPECT_NEAR(t.inv_freq.data[i], ref.inv_freq[i], 1e-6 * ref.inv_freq[i]) << "dim " << cs.dim << " i " << i;
      double plain = 1.0 / std::pow(cs.theta, double(2 * i) / cs.dim);
      interpolated += std::fabs(ref.inv_freq[i] - plain / cs.factor) < 1e-12 * plain;
      extrapolated += std::fabs(ref.inv_freq[i] - plain) < 1e-12 * plain;
    }
    // The case exercises both ends of the ramp and the ramp itself.
    EXPECT_GT(interpolated, 0);
    EXPECT_GT(extrapolated, 0);
    EXPECT_LT(interpolated + extrapolated, cs.dim / 2);
    EXPECT_NEAR(t.attention_factor, ref.attention_factor, 1e-6);
  }
}

TEST(HfConfig, GptOss20bRealConfig) {
  json j = json::parse(kGptOss20bConfig);
  j["quantization_config"] = {{"quant_method", "mxfp4"},
                              {"modules_to_not_convert", {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                          "model.embed_tokens", "lm_head"}}};
  ModelConfig c = parse_model_config(j, kPath);
  EXPECT_EQ(c.model_type, "gpt_oss");
  EXPECT_EQ(c.hidden_size, 2880);
  EXPECT_EQ(c.head_dim, 64);  // q: 64 heads x 64 = 4096 > hidden
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.num_experts, 32);  // num_local_experts
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);  // intermediate_size: gpt-oss has no moe_intermediate_size
  EXPECT_TRUE(c.attention_bias);
  EXPECT_DOUBLE_EQ(c.swiglu_limit, 7.0);
  EXPECT_EQ(c.sliding_window, 128);
  ASSERT_EQ(c.layer_types.size(), 24u);
  for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(c.layer_window(i), i % 2 == 0 ? 128 : 0) << "layer " << i;
  EXPECT_EQ(c.quant.method, "mxfp4");
  EXPECT_EQ(c.quant.modules_to_not_convert.size(), 4u);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{200002});
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_FALSE(c.rope.truncate);

  // YaRN without truncation (the correction range is not rounded to whole dimensions).
  RopeTable t = make_rope_table(c);
  YarnRef ref = yarn_reference(64, 150000, 32, 4096, 32, 1, false);
  ASSERT_EQ(size_t(t.inv_freq.n), ref.inv_freq.size());
  for (size_t i = 0; i < ref.inv_freq.size(); ++i)
    EXPECT_NEAR(t.inv_freq.data[i], ref.inv_freq[i], 1e-6 * ref.inv_freq[i]) << i;
  EXPECT_NEAR(t.attention_factor, ref.attention_factor, 1e-6);
  YarnRef truncated = yarn_reference(64, 150000, 32, 4096, 32, 1, true);
  double moved = 0;
  for (size_t i = 0; i < ref.inv_freq.size(); ++i)
    moved = std::max(moved, std::fabs(truncated.inv_freq[i] - ref.inv_freq[i]) / ref.inv_freq[i]);
  EXPECT_GT(moved, 1e-3) << "truncate must make a difference on this config, or the check above proves nothing";

  // Without layer_types, GptOssConfig's default: even layers slide.
  j.erase("layer_types");
  c = parse_model_config(j, kPath);
  EXPECT_EQ(c.layer_window(0), 128);
  EXPECT_EQ(c.layer_window(1), 0);
}

// configs/ (the real configs `nibble bench --load-format dummy` takes) parse as the models they are.
TEST(HfConfig, BenchConfigsParse) {
  const std::string dir = std::string(NIBBLE_FIXTURES_DIR) + "/../../configs/";
  ModelConfig coder = load_model_config(dir + "Qwen3-Coder-30B-A3B-Instruct");
  EXPECT_EQ(coder.num_experts, 128);
  ModelConfig small = load_model_config(dir + "gpt-oss-20b"), large = load_model_config(dir + "gpt-oss-120b");
  EXPECT_EQ(small.num_hidden_layers, 24);
  EXPECT_EQ(small.num_experts, 32);
  EXPECT_EQ(large.num_hidden_layers, 36);
  EXPECT_EQ(large.num_experts, 128);
  for (const ModelConfig* c : {&small, &large}) {
    EXPECT_EQ(c->model_type, "gpt_oss");
    EXPECT_EQ(c->num_experts_per_tok, 4);
    EXPECT_EQ(c->moe_intermediate_size, 2880);
    EXPECT_EQ(c->layer_window(0), 128);
    EXPECT_EQ(c->layer_window(c->num_hidden_layers - 1), 0);
  }
  EXPECT_NO_THROW(load_chat_template_source(dir + "gpt-oss-120b"));
}

// Parses j and returns the Error message ("" when it parses).
std::string error_of(const json& j) {
  try {
    parse_model_config(j, kPath);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_error(const json& j, const std::vector<std::string>& words) {
  std::string e = error_of(j);
  ASSERT_FALSE(e.empty()) << "expected an Error mentioning " << words[0];
  EXPECT_NE(e.find(kPath), std::string::npos) << e;
  for (auto& w : words) EXPECT_NE(e.find(w), std::string::npos) << "'" << w << "' not in: " << e;
}

TEST(HfConfig, ErrorsNameFileAndField) {
  ASSERT_EQ(error_of(dense()), "");
  ASSERT_EQ(error_of(moe()), "");
  json j;

  j = dense(), j.erase("model_type");
  expect_error(j, {"model_type"});
  j = dense(), j["hidden_size"] = "2048";
  expect_error(j, {"hidden_size"});
  j = dense(), j["num_attention_heads"] = 6, j["num_key_value_heads"] = 4;
  expect_error(j, {"num_attention_heads", "num_key_value_heads"});
  j = dense(), j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  expect_error(j, {"rope_scaling", "dynamic"});
  j = dense(), j["rope_parameters"] = {{"rope_type", "dynamic"}, {"rope_theta", 1e4}};
  expect_error(j, {"rope_parameters", "dynamic"});
  j = dense(), j["hidden_act"] = "gelu";
  expect_error(j, {"hidden_act", "gelu"});

  json q = {{"quant_method", "gptq"}, {"bits", 4}, {"group_size", 128}, {"sym", true}, {"desc_act", false}};
  j = dense(), j["quantization_config"] = q;
  ASSERT_EQ(error_of(j), "");
  EXPECT_EQ(parse_model_config(j, kPath).quant.group_size, 128);
  j["quantization_config"]["quant_method"] = "awq";
  expect_error(j, {"quant_method", "awq"});
  j = dense(), j["quantization_config"] = q, j["quantization_config"]["bits"] = 8;
  expect_error(j, {"bits"});
  j = dense(), j["quantization_config"] = q, j["quantization_config"]["desc_act"] = true;
  expect_error(j, {"desc_act"});

  j = dense(), j["layer_types"] = {"full_attention", "sliding_attention", "chunked_attention"};
  j["num_hidden_layers"] = 3, j["sliding_window"] = 64;
  expect_error(j, {"layer_types", "chunked_attention"});
  j = dense(), j["layer_types"] = {"full_attention"}, j["num_hidden_layers"] = 2;
  expect_error(j, {"layer_types", "2"});
  j = dense(), j["layer_types"] = {"sliding_attention", "full_attention"}, j["num_hidden_layers"] = 2;
  expect_error(j, {"sliding_window"});  // a sliding layer needs a window
  j = dense(), j["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", "lm_head"}};
  expect_error(j, {"modules_to_not_convert"});

  j = moe(), j["num_experts_per_tok"] = 9;
  expect_error(j, {"num_experts_per_tok"});
  j = dense(), j.erase("intermediate_size");
  expect_error(j, {"intermediate_size"});
  j = moe(), j["mlp_only_layers"] = {1};  // layer 1 is dense, and no intermediate_size
  expect_error(j, {"intermediate_size", "layer 1"});
}

}  // namespace
}  // namespace nibble
