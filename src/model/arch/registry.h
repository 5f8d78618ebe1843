// The architectures nibble runs: one line per model_type in registry.cpp.
#pragma once

#include <memory>

#include "model/model.h"
#include "model/weight_source.h"

namespace nibble {

using CreateModelFn = std::unique_ptr<Model> (*)(const ModelConfig&, WeightSource&, Backend&);

std::unique_ptr<Model> create_qwen3_moe(const ModelConfig&, WeightSource&, Backend&);
std::unique_ptr<Model> create_gpt_oss(const ModelConfig&, WeightSource&, Backend&);

}  // namespace nibble
