#include "model/loader.h"

#include <cstring>

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

const TensorInfo& WeightLoader::tensor(const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
  const TensorInfo& t = tensor(name);
  NIBBLE_CHECK(t.dtype == dtype, "{}: tensor '{}' has dtype {}, expected {}", t.file, name, dtype_name(t.dtype),
               dtype_name(dtype));
  NIBBLE_CHECK(t.shape == shape, "{}: tensor '{}' has shape {}, config expects {}", t.file, name, t.shape_str(),
               shape_str(shape));
  return t;
}

namespace {

// Rows [n, k] of a dense tensor stored inputs-first ([k, n], slice `index` of a stacked tensor),
// transposed into owned memory of the same dtype.
LinearWeight transposed_dense(const std::string& name, const TensorInfo& t, int64_t index, int64_t n, int64_t k) {
  const size_t elem = dtype_size_bytes(t.dtype);
  auto owned = std::make_shared<std::vector<uint8_t>>(size_t(n * k) * elem);
  const uint8_t* src = t.data + size_t(index * n * k) * elem;
  for (int64_t i = 0; i < k; ++i)
    for (int64_t o = 0; o < n; ++o)
      std::memcpy(owned->data() + size_t(o * k + i) * elem, src + size_t(i * n + o) * elem, elem);
  TensorInfo view = t;
  view.data = owned->data();
  view.shape = {n, k};
  LinearWeight w = view_dense(name, view, 0, n, k);
  w.storage.push_back(owned);
  return w;
}

}  // namespace

std::vector<MlpWeights> WeightLoader::gpt_oss_experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                                      int64_t hidden) {
  const int64_t E = n_experts, I = inter, H = hidden;
  auto biases = [&](const std::string& name, int64_t n) {
    const TensorInfo& t = tensor(name);
    NIBBLE_CHECK(t.shape == std::vector<int64_t>({E, n}), "{}: tensor '{}' has shape {}, config expects {}", t.file,
                 name, t.shape_str(), shape_str({E, n}));
    std::vector<float> out(static_cast<size_t>(E * n));
    view_dense(name, t, 0, E, n);  // checks the dtype
    for (int64_t e = 0; e < E; ++e) view_dense(name, t, e, 1, n).row_f32(0, out.data() + e * n);
    return std::make_shared<const std::vector<float>>(std::move(out));
  };
  auto gate_up_bias = biases(prefix + ".gate_up_proj_bias", 2 * I);
  auto down_bias = biases(prefix + ".down_proj_bias", H);
  std::vector<MlpWeights> out(static_cast<size_t>(E));
  auto add_bias = [](LinearWeight& w, const std::shared_ptr<const std::vector<float>>& all, int64_t e) {
    w.bias = all->data() + e * w.n;
    w.storage.push_back(all);
  };
  if (ckpt_.has(prefix + ".gate_up_proj_blocks")) {
    NIBBLE_CHECK(H % kMxfp4Block == 0 && I % kMxfp4Block == 0, "{}: MXFP4 experts need hidden_size ({}) and "
                 "intermediate_size ({}) to be multiples of {}", config_.path, H, I, kMxfp4Block);
    const TensorInfo& gu = tensor(prefix + ".gate_up_proj_blocks", DType::U8, {E, 2 * I, H / 32, 16});
    const TensorInfo& gu_s = tensor(prefix + ".gate_up_proj_scales", DType::U8, {E, 2 * I, H / 32});
    const TensorInfo& dn = tensor(prefix + ".down_proj_blocks", DType::U8, {E, H, I / 32, 16});
    const TensorInfo& dn_s = tensor(prefix + ".down_proj_scales", DType::U8, {E, H, I / 32});
    auto view = [](const std::string& name, const TensorInfo& blocks, const TensorInfo& scales, int64_t e, int64_t n,
                   int64_t k) {
      LinearWeight w;
      w.name = name;
      w.n = n;
      w.k = k;
      w.format = WeightFormat::kMxfp4;
      w.mxfp4 = {blocks.data + e * n * k / 2, scales.data + e * n * k / kMxfp4Block, Mxfp4Layout::kRowMajor};
      return w;
    };
    for (int64_t e = 0; e < E; ++e) {
      const std::string name = prefix + "." + std::to_string(e);
      MlpWeights& m = out[size_t(e)];
      m.gate_up = view(name + ".gate_up_proj", gu, gu_s, e, 2 * I, H);
      m.down = view(name + ".down_proj", dn, dn_s, e, H, I);
    }
  } else {
    const TensorInfo& gu = tensor(prefix + ".gate_up_proj");
    const TensorInfo& dn = tensor(prefix + ".down_proj");
    NIBBLE_CHECK(gu.shape == std::vector<int64_t>({E, H, 2 * I}), "{}: tensor '{}' has shape {}, config expects {} "
                 "(gpt-oss stores experts inputs first)", gu.file, gu.name, gu.shape_str(), shape_str({E, H, 2 * I}));
    NIBBLE_CHECK(dn.shape == std::vector<int64_t>({E, I, H}), "{}: tensor '{}' has shape {}, config expects {} "
                 "(gpt-oss stores experts inputs first)", dn.file, dn.name, dn.shape_str(), shape_str({E, I, H}));
    view_dense(gu.name, gu, 0, 1, 2 * I);  // checks the dtype before anything is copied
    view_dense(dn.name, dn, 0, 1, H);
#pragma omp parallel for schedule(dynamic) if (E * I * H >= (1 << 20))
    for (int64_t e = 0; e < E; ++e) {
      const std::string name = prefix + "." + std::to_string(e);
      out[size_t(e)].gate_up = transposed_dense(name + ".gate_up_proj", gu, e, 2 * I, H);
      out[size_t(e)].down = transposed_dense(name + ".down_proj", dn, e, H, I);
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    add_bias(out[size_t(e)].gate_up, gate_up_bias, e);
    add_bias(out[size_t(e)].down, down_bias, e);
  }
  return out;
}

std::vector<std::string> WeightLoader::unused() const {
  std::vector<std::string> out;
  for (auto& [name, info] : ckpt_.tensors())
    if (!used_.count(name)) out.push_back(name);
  return out;
}

}  // namespace nibble
