// Where a model's weights come from, already in the backend's memory and layout: a Hugging Face
// checkpoint (validated against config.json, then uploaded module by module), or random "dummy"
// weights of exactly the shapes and formats the config implies, generated on the backend itself,
// so full-size models can be benchmarked without their files (vLLM's --load-format dummy).
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "format/hf_config.h"
#include "format/safetensors.h"
#include "model/weights.h"

namespace nibble {

// The role of a Linear module for --quantize-layers: "lm_head", "router" (an MoE's mlp.gate),
// "qkv" (self_attn q/k/v_proj), "o" (self_attn o_proj), else "" (nothing to choose).
std::string linear_role(const std::string& prefix);

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Module `prefix`: as stored, or quantized to INT4 (round to nearest, asymmetric, f16 scales per
  // group) when its role is one of quantize_at_load's (a module stored in 4 bits stays as it is).
  // `role` overrides the role of the name: a tied lm_head is the embedding table, loaded again as
  // "lm_head" when that role is quantized.
  LinearWeight linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias = false,
                      const std::string& role = {}) {
    return load_linear(prefix, n, k, has_bias, quantizes(role.empty() ? linear_role(prefix) : role) ? group_ : 0);
  }
  // format "int4" (groups of group_size) or "mxfp4" (blocks of 32, group_size unused).
  void quantize_at_load(std::vector<std::string> roles, int group_size, const std::string& format = "int4") {
    roles_ = std::move(roles);
    group_ = group_size;
    mxfp4_ = format == "mxfp4";
  }
  bool quantizes(const std::string& role) const {
    return !role.empty() && std::find(roles_.begin(), roles_.end(), role) != roles_.end();
  }
  virtual WeightVector vector(const std::string& name, int64_t n) = 0;
  virtual std::vector<MlpWeights> experts(const std::string& prefix, int64_t n_experts,
                                          int64_t inter, int64_t hidden) = 0;
  // gpt-oss's fused experts with biases and interleaved gate/up (WeightLoader::gpt_oss_experts).
  virtual std::vector<MlpWeights> gpt_oss_experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                                  int64_t hidden) = 0;
  // Whether the source stores module `prefix` (e.g. an lm_head apart from tied embeddings).
  virtual bool has(const std::string& prefix) const = 0;
  // Called once every module is loaded: reports tensors nothing claimed.
  virtual void finish() {}

 protected:
  // int4_group > 0: quantize a 16/32-bit module to 4 bits: INT4 in groups of that size, or MXFP4
  // when quantizes_to_mxfp4().
  virtual LinearWeight load_linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias,
                                   int int4_group) = 0;
  bool quantizes_to_mxfp4() const { return mxfp4_; }

 private:
  std::vector<std::string> roles_;
  int group_ = 128;
  bool mxfp4_ = false;
};

std::unique_ptr<WeightSource> checkpoint_source(std::shared_ptr<const Checkpoint> ckpt,
                                                const ModelConfig& config, Backend& backend);

struct DummyOptions {
  bool int4 = false;     // every *_proj Linear as INT4 (router, embeddings, lm_head stay BF16)
  bool mxfp4 = false;    // gpt-oss experts as MXFP4, as its checkpoints ship them (else BF16)
  int group_size = 128;
  uint64_t seed = 1;
};
std::unique_ptr<WeightSource> dummy_source(const ModelConfig& config, Backend& backend,
                                           const DummyOptions& options);

}  // namespace nibble
