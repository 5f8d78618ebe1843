// Weights of a loaded model as the backends compute with them: raw pointers (host memory for the
// CPU backend, device memory for CUDA) plus a keep-alive handle for whatever owns that memory.
// On the CPU, dense weights are views into the memory-mapped checkpoint (no copy, stored dtype
// kept) and INT4 weights point into the Int4Matrix they were repacked into at load.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "format/quant/int4_gptq.h"
#include "format/quant/mxfp4.h"
#include "format/safetensors.h"

namespace nibble {

enum class WeightFormat { kF32, kF16, kBF16, kInt4, kMxfp4 };
const char* weight_format_name(WeightFormat f);

// INT4 weights: codes, f16 scales [n][n_groups] and u8 zero points [n][n_groups].
// kRowMajor (format/quant/int4_gptq.h): codes [n][(k+1)/2], the layout of the CPU reference.
// kWarpInterleaved (kernels/gemv.cuh): the CUDA decode layout, made at upload.
// zeros == null means symmetric: every zero point is 8.
enum class Int4Layout : uint8_t { kRowMajor, kWarpInterleaved };
struct Int4View {
  Int4Layout layout = Int4Layout::kRowMajor;
  const uint8_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint8_t* zeros = nullptr;
  int64_t group_size = 0, n_groups = 0;
};

// MXFP4 weights (format/quant/mxfp4.h): E2M1 codes [n][k/2] and E8M0 scales [n][k/32].
// kRowMajor: by output channel as gpt-oss checkpoints store them (the CPU reference's layout).
// kDecode: the CUDA kernels' layout (kernels/gemv_mxfp4.cuh), made at upload: words of 4 blocks
// interleaved and their bits rearranged, scale rows padded to whole groups of 4 and biased.
enum class Mxfp4Layout : uint8_t { kRowMajor, kDecode };
struct Mxfp4View {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  Mxfp4Layout layout = Mxfp4Layout::kRowMajor;
};

// y = x · Wᵀ + b for W of shape [n, k].
struct LinearWeight {
  std::string name;  // module name, e.g. "model.layers.3.self_attn.q_proj"
  int64_t n = 0, k = 0;
  WeightFormat format = WeightFormat::kF32;
  const void* dense = nullptr;  // [n, k] row-major in `format` (F32/F16/BF16)
  Int4View int4;                // when format is kInt4
  Mxfp4View mxfp4;              // when format is kMxfp4
  const float* bias = nullptr;  // [n] or none
  // Owners of the memory behind the pointers (an Int4Matrix, device buffers, the bias) when it is
  // not the checkpoint's mapping.
  std::vector<std::shared_ptr<const void>> storage;

  // Row `row` of W as f32; host memory only (the CPU reference's inner loop, embedding lookup).
  void row_f32(int64_t row, float* out) const;
  size_t bytes() const;  // bytes stored (what one full pass over the weight reads)
};

// A small f32 vector (norm weights, biases, RoPE frequencies).
struct WeightVector {
  const float* data = nullptr;
  int64_t n = 0;
  std::shared_ptr<const void> storage;
};

// A dense [n, k] weight viewed in place: rows offset_rows .. offset_rows+n of checkpoint tensor `t`
// (a slice when experts are fused into one tensor). Error unless t holds F32, F16 or BF16.
LinearWeight view_dense(const std::string& name, const TensorInfo& t, int64_t offset_rows,
                        int64_t n, int64_t k);
// An INT4 weight owning its host Int4Matrix.
LinearWeight int4_weight(const std::string& name, Int4Matrix matrix);
// An MXFP4 weight owning its host Mxfp4Matrix.
LinearWeight mxfp4_weight(const std::string& name, Mxfp4Matrix matrix);
WeightVector host_vector(std::vector<float> values);

struct MlpWeights {
  MlpWeights() = default;
  MlpWeights(LinearWeight g, LinearWeight u, LinearWeight d)
      : gate(std::move(g)), up(std::move(u)), down(std::move(d)) {}
  LinearWeight gate, up, down;
  // gpt-oss keeps gate and up as one matrix [2·inter, hidden] whose rows alternate gate_0, up_0,
  // gate_1, up_1, …; when set, gate and up are empty.
  LinearWeight gate_up;
  int64_t inter() const { return gate_up.n ? gate_up.n / 2 : gate.n; }
};

// What an expert computes between its up and down projections, per element j < inter:
//   kSiluMul:       silu(gate_j) · up_j                                   (Qwen, Llama, Mixtral)
//   kClampedSwiglu: (clamp(up_j, ±limit) + 1) · g · sigmoid(alpha · g),  g = min(gate_j, limit)
//                   (gpt-oss, alpha 1.702, limit = config swiglu_limit)
enum class MoeActivation { kSiluMul, kClampedSwiglu };
float moe_activation(MoeActivation act, float gate, float up, float alpha, float limit);

struct MoeWeights {
  LinearWeight router;  // [n_experts, hidden], with a bias in gpt-oss
  std::vector<MlpWeights> experts;
  int64_t top_k = 0;
  // Renormalise the top-k probabilities to sum 1, which is the same as a softmax over the top-k
  // logits (gpt-oss's router: top-k first, softmax over the selected).
  bool normalize = true;
  MoeActivation activation = MoeActivation::kSiluMul;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.f;  // kClampedSwiglu
  // What a backend derives from these weights on first use (the CUDA backend's device table of
  // expert matrices); it lives and dies with the weights.
  mutable std::shared_ptr<void> backend_state;
};

struct LayerWeights {
  WeightVector input_norm, post_attention_norm;
  LinearWeight q, k, v, o;
  LinearWeight qkv;  // q, k and v as one projection where the backend fused them (then q/k/v empty)
  WeightVector q_norm, k_norm;  // per-head RMSNorm over head_dim
  WeightVector sinks;           // gpt-oss: one learned logit per q head, or none
  int64_t sliding_window = 0;   // keys within this many positions (self included); 0: all
  bool is_moe = false;
  MlpWeights mlp;  // dense layers
  MoeWeights moe;  // MoE layers
};

struct ModelWeights {
  LinearWeight embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  WeightVector final_norm;
  LinearWeight lm_head;  // a copy of `embed`'s view when embeddings are tied
};

}  // namespace nibble
