// Turns checkpoint tensors into ModelWeights pieces, checking every dtype and shape against what
// config.json implies. A module is INT4 when the checkpoint holds `<prefix>.qweight`, dense when it
// holds `<prefix>.weight`; both are accepted anywhere, as GPTQ/AutoRound leave some modules (the
// router, lm_head) unquantized.
#pragma once

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "format/hf_config.h"
#include "format/safetensors.h"
#include "model/weights.h"

namespace nibble {

class WeightLoader {
 public:
  WeightLoader(const Checkpoint& ckpt, const ModelConfig& config) : ckpt_(ckpt), config_(config) {}

  LinearWeight linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias = false);
  WeightVector vector(const std::string& name, int64_t n);
  // Experts of one MoE layer, stored per expert (`experts.E.gate_proj.weight`, what checkpoints on
  // the Hub hold) or fused (`experts.gate_up_proj` [E, 2I, H] + `experts.down_proj` [E, H, I], what
  // transformers 5 keeps in memory).
  std::vector<MlpWeights> experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                  int64_t hidden);
  // Experts of one gpt-oss MoE layer (FORMATS.md §5), fused over experts with biases, gate and up
  // rows interleaved: MXFP4 (`gate_up_proj_blocks` U8 [E, 2I, H/32, 16] + `_scales` [E, 2I, H/32],
  // viewed in place) or dense as transformers keeps them (`gate_up_proj` [E, H, 2I], inputs first:
  // transposed at load into owned memory of the stored dtype). Biases `gate_up_proj_bias` [E, 2I]
  // and `down_proj_bias` [E, H] in either case.
  std::vector<MlpWeights> gpt_oss_experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                          int64_t hidden);
  // Tensors of the checkpoint that no module claimed (reported as a warning: usually a sign that
  // config.json and the weights disagree).
  std::vector<std::string> unused() const;

 private:
  const TensorInfo& tensor(const std::string& name);
  // `name` checked against dtype and shape (an Error naming what differs).
  const TensorInfo& tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape);
  const Checkpoint& ckpt_;
  const ModelConfig& config_;
  std::mutex used_mutex_;  // experts() loads in parallel
  std::set<std::string> used_;
};

}  // namespace nibble
