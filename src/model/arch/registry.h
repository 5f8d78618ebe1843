// The architectures nibble runs: one line per model_type in registry.cpp.
#pragma once

#include <memory>

#include "format/safetensors.h"
#include "model/model.h"

namespace nibble {

using CreateModelFn = std::unique_ptr<Model> (*)(const ModelConfig&, const Checkpoint&, Backend&);

std::unique_ptr<Model> create_qwen3_moe(const ModelConfig&, const Checkpoint&, Backend&);

}  // namespace nibble
