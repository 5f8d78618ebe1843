// Where a model's weights come from, already in the backend's memory and layout: a Hugging Face
// checkpoint (validated against config.json, then uploaded module by module), or random "dummy"
// weights of exactly the shapes and formats the config implies, generated on the backend itself,
// so full-size models can be benchmarked without their files (vLLM's --load-format dummy).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "format/hf_config.h"
#include "format/safetensors.h"
#include "model/weights.h"

namespace nibble {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual LinearWeight linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias = false) = 0;
  virtual WeightVector vector(const std::string& name, int64_t n) = 0;
  virtual std::vector<MlpWeights> experts(const std::string& prefix, int64_t n_experts,
                                          int64_t inter, int64_t hidden) = 0;
  // Whether the source stores module `prefix` (e.g. an lm_head apart from tied embeddings).
  virtual bool has(const std::string& prefix) const = 0;
  // Called once every module is loaded: reports tensors nothing claimed.
  virtual void finish() {}
};

std::unique_ptr<WeightSource> checkpoint_source(std::shared_ptr<const Checkpoint> ckpt,
                                                const ModelConfig& config, Backend& backend);

struct DummyOptions {
  bool int4 = false;     // every *_proj Linear as INT4 (router, embeddings, lm_head stay BF16)
  int group_size = 128;
  uint64_t seed = 1;
};
std::unique_ptr<WeightSource> dummy_source(const ModelConfig& config, Backend& backend,
                                           const DummyOptions& options);

}  // namespace nibble
