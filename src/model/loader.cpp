#include "model/loader.h"

#include "core/status.h"

namespace nibble {


const TensorInfo& WeightLoader::tensor(const std::string& name) {
  const TensorInfo* t = ckpt_.find(name);
  NIBBLE_CHECK(t != nullptr, "{}: tensor '{}' is missing (config.json {} implies it)", ckpt_.dir(),
               name, config_.model_type);
  std::lock_guard lock(used_mutex_);
  used_.insert(name);
  return *t;
}

LinearWeight WeightLoader::linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias) {
  LinearWeight w;
  if (ckpt_.has(prefix + ".qweight")) {
    NIBBLE_CHECK(!config_.quant.method.empty(), "{}: tensor '{}.qweight' is GPTQ-packed but {} has "
                 "no quantization_config", ckpt_.dir(), prefix, config_.path);
    GptqTensorSet set;
    set.qweight = &tensor(prefix + ".qweight");
    set.qzeros = &tensor(prefix + ".qzeros");
    set.scales = &tensor(prefix + ".scales");
    if (ckpt_.has(prefix + ".g_idx")) set.g_idx = &tensor(prefix + ".g_idx");
    w = int4_weight(prefix, int4_from_gptq(set, n, k, config_.quant.group_size,
                                           config_.quant.zero_minus_one, prefix));
  } else {
    const TensorInfo& t = tensor(prefix + ".weight");
    NIBBLE_CHECK(t.shape == std::vector<int64_t>({n, k}), "{}: tensor '{}' has shape {}, config "
                 "expects {}", t.file, t.name, t.shape_str(), shape_str({n, k}));
    w = view_dense(prefix, t, 0, n, k);
  }
  if (has_bias) {
    WeightVector bias = vector(prefix + ".bias", n);
    w.bias = bias.data;
    w.storage.push_back(bias.storage);
  }
  return w;
}

WeightVector WeightLoader::vector(const std::string& name, int64_t n) {
  const TensorInfo& t = tensor(name);
  NIBBLE_CHECK(t.shape == std::vector<int64_t>({n}), "{}: tensor '{}' has shape {}, config expects "
               "{}", t.file, name, t.shape_str(), shape_str({n}));
  LinearWeight view = view_dense(name, t, 0, 1, n);
  std::vector<float> out(static_cast<size_t>(n));
  view.row_f32(0, out.data());
  return host_vector(std::move(out));
}

std::vector<MlpWeights> WeightLoader::experts(const std::string& prefix, int64_t n_experts,
                                              int64_t inter, int64_t hidden) {
  std::vector<MlpWeights> out(static_cast<size_t>(n_experts));
  if (ckpt_.has(prefix + ".gate_up_proj")) {
    const TensorInfo& gu = tensor(prefix + ".gate_up_proj");
    const TensorInfo& down = tensor(prefix + ".down_proj");
    NIBBLE_CHECK(gu.shape == std::vector<int64_t>({n_experts, 2 * inter, hidden}), "{}: tensor '{}' "
                 "has shape {}, config expects {}", gu.file, gu.name, gu.shape_str(),
                 shape_str({n_experts, 2 * inter, hidden}));
    NIBBLE_CHECK(down.shape == std::vector<int64_t>({n_experts, hidden, inter}), "{}: tensor '{}' "
                 "has shape {}, config expects {}", down.file, down.name, down.shape_str(),
                 shape_str({n_experts, hidden, inter}));
    for (int64_t e = 0; e < n_experts; ++e) {
      const std::string name = prefix + "." + std::to_string(e);
      out[size_t(e)].gate = view_dense(name + ".gate_proj", gu, e * 2 * inter, inter, hidden);
      out[size_t(e)].up = view_dense(name + ".up_proj", gu, e * 2 * inter + inter, inter, hidden);
      out[size_t(e)].down = view_dense(name + ".down_proj", down, e * hidden, hidden, inter);
    }
    return out;
  }
  // Per-expert modules are independent; repacking INT4 ones is the slow part of loading.
  std::vector<std::string> errors(static_cast<size_t>(n_experts));
#pragma omp parallel for schedule(dynamic) if (n_experts * inter * hidden >= (1 << 20))
  for (int64_t e = 0; e < n_experts; ++e) {
    const std::string name = prefix + "." + std::to_string(e);
    try {
      MlpWeights m;
      m.gate = linear(name + ".gate_proj", inter, hidden);
      m.up = linear(name + ".up_proj", inter, hidden);
      m.down = linear(name + ".down_proj", hidden, inter);
      out[size_t(e)] = std::move(m);
    } catch (const Error& err) {
      errors[size_t(e)] = err.what();
    }
  }
  for (auto& e : errors) NIBBLE_CHECK(e.empty(), "{}", e);
  return out;
}

std::vector<std::string> WeightLoader::unused() const {
  std::vector<std::string> out;
  for (auto& [name, info] : ckpt_.tensors())
    if (!used_.count(name)) out.push_back(name);
  return out;
}

}  // namespace nibble
