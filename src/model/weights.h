// Weights of a loaded model, in the layouts the backends compute with. Dense weights are views
// into the memory-mapped checkpoint (no copy, stored dtype kept); INT4 weights are repacked once at
// load (format/quant/int4_gptq.h). Small vectors (norm weights, biases) are converted to f32.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "format/quant/int4_gptq.h"
#include "format/safetensors.h"

namespace nibble {

enum class WeightFormat { kF32, kF16, kBF16, kInt4 };
const char* weight_format_name(WeightFormat f);

// y = x · Wᵀ + b for W of shape [n, k].
struct LinearWeight {
  std::string name;  // module name, e.g. "model.layers.3.self_attn.q_proj"
  int64_t n = 0, k = 0;
  WeightFormat format = WeightFormat::kF32;
  const void* dense = nullptr;  // [n, k] row-major in `format` (F32/F16/BF16)
  std::shared_ptr<const Int4Matrix> int4;
  std::vector<float> bias;  // empty when the layer has none

  // Row `row` of W as f32 (embedding lookup; also the CPU reference's inner loop).
  void row_f32(int64_t row, float* out) const;
  size_t bytes() const;  // bytes stored (what one full pass over the weight reads)
};

// A dense [n, k] weight viewed in place: rows offset_rows .. offset_rows+n of checkpoint tensor `t`
// (a slice when experts are fused into one tensor). Error unless t holds F32, F16 or BF16.
LinearWeight view_dense(const std::string& name, const TensorInfo& t, int64_t offset_rows,
                        int64_t n, int64_t k);

struct MlpWeights {
  LinearWeight gate, up, down;
};

struct LayerWeights {
  std::vector<float> input_norm, post_attention_norm;
  LinearWeight q, k, v, o;
  std::vector<float> q_norm, k_norm;  // per-head RMSNorm over head_dim (empty: none)
  bool is_moe = false;
  MlpWeights mlp;                    // dense layers
  LinearWeight router;               // MoE layers: [n_experts, hidden]
  std::vector<MlpWeights> experts;   // MoE layers
};

struct ModelWeights {
  LinearWeight embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;
  LinearWeight lm_head;  // a copy of `embed`'s view when embeddings are tied
};

}  // namespace nibble
